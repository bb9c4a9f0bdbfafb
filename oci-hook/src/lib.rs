//! One library for every gpushare entry point (gpushare-runc, gpushare-hook, the
//! containerd shim): `admission` is the one path by which a container gets its
//! lease and its spec edits, over a typed view of the spec (`spec`); the request
//! parser (`request`), the edits (`mutate`) and the CUDA check (`cuda_compat`) are
//! pure functions over that view. The entry points only gather their engine's
//! inputs and call admission.

pub mod admission;
pub mod broken_config;
pub mod bundle;
pub mod cli;
pub mod cuda_compat;
pub mod env_keys;
pub mod kubernetes;
pub mod mutate;
pub mod request;
pub mod runc_args;
pub mod spec;

/// Annotations gpushare writes. Requests never use these keys.
pub const ANNOTATION_LEASE: &str = "gpushare.io/lease";
pub const ANNOTATION_ASSIGNED_GPUS: &str = "gpushare.io/assigned-gpus";
/// Marks a spec already edited, so the shim, the wrapper and the NVIDIA runtime
/// in one chain never apply the edits twice.
pub const ANNOTATION_MARKER: &str = "gpushare.io/injected";
pub const MARKER_VALUE: &str = "v1";

/// Inside the container: the lease directory's mount point and its socket.
pub const CONTAINER_RUN_DIR: &str = "/run/gpushare";
pub const CONTAINER_SOCKET: &str = "/run/gpushare/arbiter.sock";

/// An error and its causes on one line, each cause once: many errors' messages
/// already end with their source's (`"{path}: {source}"`), and it is not repeated.
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let line = e.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        cause = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Repeats {
        path: &'static str,
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("reading the spec")]
    struct Adds(#[source] Repeats);

    #[test]
    fn describe_names_each_cause_once() {
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let repeats = Repeats {
            path: "/b/config.json",
            source: io(),
        };
        assert_eq!(
            super::describe(&repeats),
            format!("/b/config.json: {}", io())
        );
        assert_eq!(
            super::describe(&Adds(repeats)),
            format!("reading the spec: /b/config.json: {}", io())
        );
    }
}
