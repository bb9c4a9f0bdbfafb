//! Blocking clients for the control socket and for a lease's socket: no async
//! runtime, so short-lived tools (hook, wrapper, CLI) and the interposer can all
//! use them.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::frame::{read_message, write_message, FrameError};
use crate::grant::{Grant, GrantId, GrantRequest};
use crate::lease::{Lease, LeaseId};
use crate::lease_socket::{LeaseRequest, LeaseResponse, Quota};
use crate::message::{ControlRequest, ControlResponse, ErrorKind, ReserveRequest, StatusReport};
use crate::PROTOCOL_VERSION;

/// Beyond the arbiter's admission bound, how long a reserve waits for the answer
/// (the arbiter answers at the bound; this covers persistence and scheduling).
const RESERVE_MARGIN: Duration = Duration::from_secs(5);

/// Each variant's message already says its cause, so none is also handed on as
/// `source()`: a chain printer (anyhow's `{:#}`) would print it twice
/// ("… (os error 2) …: No such file or directory (os error 2)").
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the gpushare arbiter: {}", unreachable(path, error))]
    Connect { path: PathBuf, error: io::Error },
    /// The socket is there but not this user's to use: the arbiter may well be
    /// running, so it is not blamed.
    #[error("permission denied on {path}: {}", who_may_connect(group.as_deref()))]
    PermissionDenied {
        path: PathBuf,
        /// The group the socket's mode lets in, if any.
        group: Option<String>,
    },
    #[error("talking to the gpushare arbiter: {0}")]
    Frame(FrameError),
    #[error(
        "the gpushare arbiter speaks protocol {theirs}, this client speaks {PROTOCOL_VERSION}"
    )]
    Version { theirs: u32 },
    #[error("{message}")]
    Refused { kind: ErrorKind, message: String },
    #[error("unexpected answer from the gpushare arbiter: {0:?}")]
    Unexpected(Box<ControlResponse>),
    #[error("unexpected answer on the lease socket: {0:?}")]
    UnexpectedOnLeaseSocket(Box<LeaseResponse>),
    #[error("this connection to the gpushare arbiter failed earlier ({0}); open a new one")]
    Broken(String),
}

impl From<FrameError> for ClientError {
    fn from(error: FrameError) -> Self {
        ClientError::Frame(error)
    }
}

/// Why a socket could not be reached, in words of our own where the error kind
/// tells: nothing listens on a missing socket, or on one a stopped arbiter left
/// behind. Not the system's "No such file or directory": podman reads that phrase
/// in a hook's message as its runtime's own binary missing and says "OCI runtime
/// attempted to invoke a command that was not found".
fn unreachable(path: &Path, error: &io::Error) -> String {
    let path = path.display();
    match error.kind() {
        io::ErrorKind::NotFound => {
            format!("its socket {path} does not exist (is gpushare-arbiter running?)")
        }
        io::ErrorKind::ConnectionRefused => {
            format!("nothing listens on {path} (is gpushare-arbiter running?)")
        }
        _ => format!("{path}: {error}"),
    }
}

fn who_may_connect(group: Option<&str>) -> String {
    match group {
        Some(group) => format!(
            "the gpushare arbiter's control socket is for root and members of group {group}; \
             run this as root or as a member of {group}"
        ),
        None => "the gpushare arbiter's control socket is for root only; run this as root (e.g. with sudo)"
            .to_owned(),
    }
}

/// The group a socket's mode lets read and write it: its owning group's name
/// (from /etc/group, else its number), or None when only its owner may.
fn socket_group(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    if meta.mode() & 0o060 != 0o060 {
        return None;
    }
    let gid = meta.gid();
    let groups = std::fs::read_to_string("/etc/group").unwrap_or_default();
    Some(group_name(&groups, gid).unwrap_or_else(|| format!("gid {gid}")))
}

/// The name of group `gid` in an /etc/group file's text.
fn group_name(etc_group: &str, gid: u32) -> Option<String> {
    etc_group.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let id = fields.nth(1)?.parse::<u32>().ok()?;
        (id == gid && !name.is_empty()).then(|| name.to_owned())
    })
}

/// One request-answer exchange on a connection that is given up after its first
/// failure. Why: after a timeout or a partial read the arbiter's late answer is
/// still on its way, and the next call on the same connection would read it as its
/// own — a reserve could take a release's acknowledgement, and a caller count a
/// lease as released (or reserved) that was not. (The "lost" acknowledged leases once
/// seen across an arbiter restart were exactly this and releases that timed out but
/// still happened.)
fn exchange<Q: serde::Serialize, A: serde::de::DeserializeOwned>(
    stream: &mut UnixStream,
    broken: &mut Option<String>,
    request: &Q,
) -> Result<A, ClientError> {
    if let Some(why) = broken {
        return Err(ClientError::Broken(why.clone()));
    }
    let answer = match write_message(stream, request) {
        Ok(()) => read_message(stream),
        // The arbiter answered and closed before reading this request (it refuses a
        // connection before its hello: a foreign peer, a flood): the answer is still
        // there to read, and says why better than the broken pipe.
        Err(FrameError::Io(e))
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) =>
        {
            read_message(stream).map_err(|_| FrameError::Io(e))
        }
        Err(e) => Err(e),
    };
    if let Err(e) = &answer {
        *broken = Some(e.to_string());
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    Ok(answer?)
}

fn open(path: &Path, timeout: Duration) -> Result<UnixStream, ClientError> {
    let connect_err = |error| ClientError::Connect {
        path: path.to_owned(),
        error,
    };
    let stream = UnixStream::connect(path).map_err(connect_err)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(connect_err)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(connect_err)?;
    Ok(stream)
}

/// A container as an entry point names it: its id, and where it knows them, the id
/// space it belongs to (`ReserveRequest::namespace`) and the lease gpushare's edit
/// gave it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerRef {
    pub container_id: String,
    pub namespace: Option<String>,
    pub lease: Option<LeaseId>,
}

impl ContainerRef {
    pub fn id(container_id: String) -> ContainerRef {
        ContainerRef {
            container_id,
            ..ContainerRef::default()
        }
    }
}

pub struct ControlClient {
    stream: UnixStream,
    /// Set by the first failed exchange: the connection is not used again.
    broken: Option<String>,
    timeout: Duration,
    /// How long the arbiter may keep a reserve in its admission queue.
    admission_wait: Duration,
}

impl ControlClient {
    /// `timeout` bounds every read and write, so a wedged arbiter cannot hang a
    /// container start (runc hooks have no timeout of their own). A reserve,
    /// which may wait in the admission queue, waits that long on top.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let stream = open(path, timeout).map_err(|e| match e {
            ClientError::Connect { path, error }
                if error.kind() == io::ErrorKind::PermissionDenied =>
            {
                ClientError::PermissionDenied {
                    group: socket_group(&path),
                    path,
                }
            }
            other => other,
        })?;
        let mut client = ControlClient {
            stream,
            broken: None,
            timeout,
            admission_wait: Duration::ZERO,
        };
        match client.call(&ControlRequest::Hello {
            protocol: PROTOCOL_VERSION,
        })? {
            ControlResponse::Hello {
                protocol,
                admission_wait_ms,
            } if protocol == PROTOCOL_VERSION => {
                client.admission_wait = Duration::from_millis(admission_wait_ms.unwrap_or(0));
                Ok(client)
            }
            ControlResponse::Hello { protocol, .. } => {
                Err(ClientError::Version { theirs: protocol })
            }
            other => Err(unexpected(other)),
        }
    }

    pub fn call(&mut self, request: &ControlRequest) -> Result<ControlResponse, ClientError> {
        match exchange(&mut self.stream, &mut self.broken, request)? {
            ControlResponse::Error { kind, message } => Err(ClientError::Refused { kind, message }),
            response => Ok(response),
        }
    }

    /// May block up to the arbiter's admission bound (plus the usual timeout)
    /// while the request waits in the queue.
    pub fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, ClientError> {
        let queued_timeout = self.timeout + self.admission_wait + RESERVE_MARGIN;
        self.stream
            .set_read_timeout(Some(queued_timeout))
            .map_err(|e| ClientError::Frame(FrameError::Io(e)))?;
        let answer = self.call(&ControlRequest::Reserve(request));
        // Restore the bound for later calls on this connection, whatever happened.
        let _ = self.stream.set_read_timeout(Some(self.timeout));
        match answer? {
            ControlResponse::Reserved { lease } => Ok(lease),
            other => Err(unexpected(other)),
        }
    }

    pub fn confirm(&mut self, container_id: String, pid: u32) -> Result<(), ClientError> {
        self.confirm_in(ContainerRef::id(container_id), pid)
    }

    /// Confirms the lease of `container` (an id, with its namespace or lease where
    /// the caller knows them).
    pub fn confirm_in(&mut self, container: ContainerRef, pid: u32) -> Result<(), ClientError> {
        let ContainerRef {
            container_id,
            namespace,
            lease,
        } = container;
        match self.call(&ControlRequest::Confirm {
            container_id,
            pid,
            namespace,
            lease,
        })? {
            ControlResponse::Confirmed => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Returns whether the lease still existed; releasing twice is not an error.
    pub fn release(&mut self, lease: LeaseId) -> Result<bool, ClientError> {
        match self.call(&ControlRequest::Release { lease })? {
            ControlResponse::Released { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }

    pub fn bind(
        &mut self,
        lease: LeaseId,
        container_id: String,
        pid: u32,
    ) -> Result<(), ClientError> {
        match self.call(&ControlRequest::Bind {
            lease,
            container_id,
            pid,
        })? {
            ControlResponse::Confirmed => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    pub fn release_container(&mut self, container_id: String) -> Result<bool, ClientError> {
        self.release_container_in(ContainerRef::id(container_id))
    }

    /// Releases the lease of `container`; whether there was one.
    pub fn release_container_in(&mut self, container: ContainerRef) -> Result<bool, ClientError> {
        let ContainerRef {
            container_id,
            namespace,
            lease,
        } = container;
        match self.call(&ControlRequest::ReleaseContainer {
            container_id,
            namespace,
            lease,
        })? {
            ControlResponse::Released { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }

    pub fn status(&mut self) -> Result<StatusReport, ClientError> {
        match self.call(&ControlRequest::Status)? {
            ControlResponse::Status(report) => Ok(*report),
            other => Err(unexpected(other)),
        }
    }

    /// Holds that ended within `since_ms` (None: every hold the arbiter kept).
    pub fn timeline(
        &mut self,
        since_ms: Option<u64>,
    ) -> Result<crate::message::TimelineReport, ClientError> {
        match self.call(&ControlRequest::Timeline { since_ms })? {
            ControlResponse::Timeline(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    pub fn list(&mut self) -> Result<Vec<Lease>, ClientError> {
        match self.call(&ControlRequest::List)? {
            ControlResponse::Leases { leases } => Ok(leases),
            other => Err(unexpected(other)),
        }
    }

    /// `gpu` is a UUID or an index; returns the GPU's UUID.
    pub fn drain(&mut self, gpu: String, drain: bool) -> Result<String, ClientError> {
        match self.call(&ControlRequest::Drain { gpu, drain })? {
            ControlResponse::Drained { gpu, .. } => Ok(gpu),
            other => Err(unexpected(other)),
        }
    }

    /// The device plugin's `Allocate`: a grant, placed or waiting.
    pub fn grant(&mut self, request: GrantRequest) -> Result<Grant, ClientError> {
        match self.call(&ControlRequest::Grant(request))? {
            ControlResponse::Granted { grant } => Ok(grant),
            other => Err(unexpected(other)),
        }
    }

    pub fn grants(&mut self) -> Result<Vec<Grant>, ClientError> {
        match self.call(&ControlRequest::Grants)? {
            ControlResponse::Grants { grants } => Ok(grants),
            other => Err(unexpected(other)),
        }
    }

    /// Whether the grant existed.
    pub fn release_grant(&mut self, id: GrantId) -> Result<bool, ClientError> {
        match self.call(&ControlRequest::ReleaseGrant { id })? {
            ControlResponse::GrantReleased { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }
}

/// The answer to a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChargeOutcome {
    pub granted: bool,
    pub memory_used: u64,
    pub memory_quota: u64,
}

/// A process's connection to its lease's socket (`/run/gpushare/arbiter.sock`
/// inside the container). One per process: the arbiter keeps the ledger per
/// connection and credits it back when the connection closes.
pub struct LeaseClient {
    stream: UnixStream,
    /// Set by the first failed exchange: the connection is not used again.
    broken: Option<String>,
}

impl LeaseClient {
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let mut client = LeaseClient {
            stream: open(path, timeout)?,
            broken: None,
        };
        match client.call(&LeaseRequest::Hello {
            protocol: PROTOCOL_VERSION,
        })? {
            LeaseResponse::Hello { protocol } if protocol == PROTOCOL_VERSION => Ok(client),
            LeaseResponse::Hello { protocol } => Err(ClientError::Version { theirs: protocol }),
            other => Err(unexpected_on_lease(other)),
        }
    }

    pub fn call(&mut self, request: &LeaseRequest) -> Result<LeaseResponse, ClientError> {
        match exchange(&mut self.stream, &mut self.broken, request)? {
            LeaseResponse::Error { kind, message } => Err(ClientError::Refused { kind, message }),
            response => Ok(response),
        }
    }

    /// Registers this process; returns the pid the arbiter saw and the quota.
    pub fn attach(&mut self, memory_held: u64) -> Result<(u32, Quota), ClientError> {
        match self.call(&LeaseRequest::Attach { memory_held })? {
            LeaseResponse::Attached { pid, quota } => Ok((pid, quota)),
            other => Err(unexpected_on_lease(other)),
        }
    }

    pub fn query(&mut self) -> Result<Quota, ClientError> {
        match self.call(&LeaseRequest::Query)? {
            LeaseResponse::Quota(quota) => Ok(quota),
            other => Err(unexpected_on_lease(other)),
        }
    }

    pub fn charge(&mut self, bytes: u64) -> Result<ChargeOutcome, ClientError> {
        match self.call(&LeaseRequest::Charge { bytes })? {
            LeaseResponse::Charged {
                granted,
                memory_used,
                memory_quota,
                ..
            } => Ok(ChargeOutcome {
                granted,
                memory_used,
                memory_quota,
            }),
            other => Err(unexpected_on_lease(other)),
        }
    }

    /// Returns the lease's memory in use after the credit.
    pub fn credit(&mut self, bytes: u64) -> Result<u64, ClientError> {
        match self.call(&LeaseRequest::Credit { bytes })? {
            LeaseResponse::Credited { memory_used } => Ok(memory_used),
            other => Err(unexpected_on_lease(other)),
        }
    }
}

fn unexpected(response: ControlResponse) -> ClientError {
    ClientError::Unexpected(Box::new(response))
}

fn unexpected_on_lease(response: LeaseResponse) -> ClientError {
    ClientError::UnexpectedOnLeaseSocket(Box::new(response))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::write_message;
    use std::os::unix::net::UnixListener;

    /// An arbiter that answers hello at once and every later request `late` after it.
    fn slow_arbiter(late: Duration) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "gpushare-client-test-{}-{:?}.sock",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _: ControlRequest = read_message(&mut s).unwrap();
            let hello = ControlResponse::Hello {
                protocol: PROTOCOL_VERSION,
                admission_wait_ms: Some(0),
            };
            write_message(&mut s, &hello).unwrap();
            while let Ok(request) = read_message::<ControlRequest>(&mut s) {
                std::thread::sleep(late);
                let answer = match request {
                    ControlRequest::Release { .. } => ControlResponse::Released { existed: true },
                    _ => ControlResponse::Leases { leases: vec![] },
                };
                if write_message(&mut s, &answer).is_err() {
                    return;
                }
            }
        });
        path
    }

    /// The arbiter refuses some connections before reading anything (a peer from
    /// outside the lease's container) and closes them: the request then meets a
    /// broken pipe, and the refusal already sent must still be what the caller sees.
    #[test]
    fn an_answer_sent_before_the_request_was_read_is_still_read() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        let refusal = LeaseResponse::Error {
            kind: ErrorKind::PermissionDenied,
            message: "not inside the lease's container".into(),
        };
        write_message(&mut theirs, &refusal).unwrap();
        drop(theirs);
        let mut broken = None;
        let answer: Result<LeaseResponse, _> =
            exchange(&mut ours, &mut broken, &LeaseRequest::Query);
        assert_eq!(answer.unwrap(), refusal);
    }

    #[test]
    fn an_unreachable_arbiter_is_blamed_only_where_it_is_the_cause() {
        let path = PathBuf::from("/run/gpushare/control.sock");
        let connect = |kind: io::ErrorKind| {
            ClientError::Connect {
                path: path.clone(),
                error: io::Error::from(kind),
            }
            .to_string()
        };
        let cases = [
            (
                io::ErrorKind::NotFound,
                "its socket /run/gpushare/control.sock does not exist (is gpushare-arbiter running?)",
            ),
            (
                io::ErrorKind::ConnectionRefused,
                "nothing listens on /run/gpushare/control.sock (is gpushare-arbiter running?)",
            ),
            (
                io::ErrorKind::InvalidInput,
                "/run/gpushare/control.sock: invalid input parameter",
            ),
        ];
        for (kind, why) in cases {
            assert_eq!(
                connect(kind),
                format!("cannot reach the gpushare arbiter: {why}")
            );
            assert!(!connect(kind).to_lowercase().contains("no such file"));
        }
        let denied = |group: Option<&str>| {
            ClientError::PermissionDenied {
                path: path.clone(),
                group: group.map(str::to_owned),
            }
            .to_string()
        };
        assert_eq!(
            denied(None),
            "permission denied on /run/gpushare/control.sock: the gpushare arbiter's control socket \
             is for root only; run this as root (e.g. with sudo)"
        );
        let message = denied(Some("gpushare"));
        assert!(
            message.contains("for root and members of group gpushare"),
            "{message}"
        );
        assert!(!message.contains("running"), "{message}");
    }

    /// A chain printer (anyhow's `{:#}`, gpusharectl's) prints each cause once.
    #[test]
    fn no_message_is_repeated_by_a_chain_printer() {
        let errors = [
            ClientError::Connect {
                path: "/x.sock".into(),
                error: io::Error::from(io::ErrorKind::NotFound),
            },
            ClientError::Frame(FrameError::Io(io::Error::from(io::ErrorKind::TimedOut))),
            ClientError::Frame(FrameError::Closed),
        ];
        for error in errors {
            let message = error.to_string();
            assert!(std::error::Error::source(&error).is_none(), "{message}");
            assert_eq!(message.matches("(os error").count().max(1), 1, "{message}");
        }
    }

    #[test]
    fn group_names_come_from_etc_group() {
        let etc_group = "root:x:0:\ndocker:x:999:alice\nbroken\n:x:5:\ngpushare:x:1001:\n";
        let cases = [
            (0, Some("root")),
            (999, Some("docker")),
            (1001, Some("gpushare")),
            (5, None),
            (7, None),
        ];
        for (gid, name) in cases {
            assert_eq!(group_name(etc_group, gid).as_deref(), name, "gid {gid}");
        }
    }

    #[test]
    fn a_connection_that_timed_out_is_not_used_again() {
        let path = slow_arbiter(Duration::from_millis(300));
        let mut client = ControlClient::connect(&path, Duration::from_millis(100)).unwrap();
        let timed_out = client.release(LeaseId("a".into()));
        assert!(
            matches!(timed_out, Err(ClientError::Frame(_))),
            "{timed_out:?}"
        );
        std::thread::sleep(Duration::from_millis(400));
        // The late `Released` must not be read as this call's answer.
        match client.list() {
            Err(ClientError::Broken(why)) => assert!(!why.is_empty()),
            other => panic!("a broken connection was used again: {other:?}"),
        }
        let _ = std::fs::remove_file(path);
    }
}
