//! gRPC over unix sockets, both ways: kubelet's sockets (registration,
//! PodResources) and the plugin's own endpoints. tonic's transport speaks TCP; a
//! connector dialling the socket and a listener stream stand in.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum UnixError {
    #[error("cannot connect to {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot listen on {}: {source}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A channel to the gRPC server on `path`; connects now, so a missing server is an
/// error here rather than on the first call.
pub async fn connect(path: &Path) -> Result<Channel, UnixError> {
    let dial = path.to_owned();
    // tonic wants a URI; the connector ignores it and dials the socket instead.
    Endpoint::from_static("http://[::1]:0")
        .connect_with_connector(tower::service_fn(move |_| {
            let dial = dial.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(dial).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|source| UnixError::Connect {
            path: path.to_owned(),
            source,
        })
}

/// Listens on `path`, replacing a stale socket file left there (a previous run, or
/// a kubelet that deleted and recreated the directory's files).
pub fn listen(path: &Path) -> Result<tokio_stream::wrappers::UnixListenerStream, UnixError> {
    let listen_err = |source| UnixError::Listen {
        path: path.to_owned(),
        source,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(listen_err(e)),
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(listen_err)?;
    Ok(tokio_stream::wrappers::UnixListenerStream::new(listener))
}
