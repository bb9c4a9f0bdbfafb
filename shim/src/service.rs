//! The task API containerd calls. Everything goes to the runc shim unchanged,
//! except:
//! - `Create`: the request is read from the bundle's spec, a lease reserved and
//!   the spec edited first; a failed create undoes both;
//! - `Exec`: the exec process gets the container's injected environment (engines
//!   build it from their own records, not from the edited spec);
//! - `Delete` of a container, and the exit of its init process, release its lease;
//! - `Shutdown`: this shim exits once it serves no container;
//! - `Connect`: reports this shim's pid, the process containerd talks to.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use containerd_shim::api::{
    CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
    DeleteRequest, DeleteResponse, Empty, ExecProcessRequest, KillRequest, PauseRequest,
    PidsRequest, PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest, StartRequest,
    StartResponse, StateRequest, StateResponse, StatsRequest, StatsResponse, UpdateTaskRequest,
    WaitRequest, WaitResponse,
};
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::ttrpc::{self, context, r#async::TtrpcContext, Code};
use containerd_shim::{api::CheckpointTaskRequest, ExitSignal, Task};
use gpushare_oci::admission::ErrorClass;
use gpushare_proto::LeaseId;
use tokio::sync::OnceCell;

use crate::failed_create::{self, Decision, Kept, RuncShimProbe};
use crate::forward::{context_of, is_not_found, CallError, Forwarder};
use crate::gpushare::{self, GpushareError};
use crate::inner::{self, Endpoint};

/// What this shim remembers of a container it created.
struct ContainerRecord {
    bundle: PathBuf,
    /// The lease still held for it (cleared when its init process exits).
    lease: Option<LeaseId>,
    /// It was granted a lease at some point: Delete must release.
    leased: bool,
}

/// Whether an init process's exit should release `lease`: only if the record
/// still holds this very lease (the container may have been deleted and created
/// again under the same id, with a newer lease). Clears it when so.
fn take_lease_if_held(record: Option<&mut ContainerRecord>, lease: &LeaseId) -> bool {
    match record {
        Some(record) if record.lease.as_ref() == Some(lease) => {
            record.lease = None;
            true
        }
        _ => false,
    }
}

/// After a forwarded Delete: is the container itself gone (not one of its exec
/// processes)? `outcome` is Ok, or Err(whether the error was NOT_FOUND): a
/// container the runc shim does not know is gone too.
fn is_container_gone(exec_id: &str, outcome: Result<(), bool>) -> bool {
    exec_id.is_empty() && outcome.map_or_else(|not_found| not_found, |()| true)
}

type Containers = Arc<Mutex<HashMap<String, ContainerRecord>>>;

pub struct TaskForwarder {
    /// None when the shim was started without its runc shim's endpoint: every
    /// call then fails, naming why.
    endpoint: Option<Endpoint>,
    forwarder: OnceCell<Forwarder>,
    containers: Containers,
    /// Creates under way, by container id: Delete waits for one to be settled
    /// (recorded or undone) before it acts, since containerd sends Delete as
    /// soon as a Create has failed, even one whose deadline passed while this
    /// shim was still deciding.
    creating: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    exit: Arc<ExitSignal>,
}

/// Every status this shim makes goes through `without_format_verbs`.
fn status(code: Code, message: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(
        code,
        without_format_verbs(&message.to_string()),
    ))
}

fn gpushare_status(error: GpushareError) -> ttrpc::Error {
    let code = match error.class() {
        ErrorClass::InvalidRequest => Code::INVALID_ARGUMENT,
        ErrorClass::Unavailable => Code::UNAVAILABLE,
        ErrorClass::Failed => Code::FAILED_PRECONDITION,
    };
    status(code, format!("gpushare: {error}"))
}

/// containerd turns a shim's classified status back into its error class with the
/// message as a Go *format string* (errdefs.FromGRPC: `errors.Wrapf(class, msg)`
/// in 1.6), once on ctr's path and once more on the CRI plugin's. Measured with
/// Debian's 1.6.20 (tests/e2e/tests/error_messages.rs): "(0.4, 40%)" reached ctr
/// as "(0.4, 40%!)(MISSING)" and kubelet as "(0.4, 40%!!(MISSING))(MISSING)".
/// gpushare-runc's message, which runc's shim reports, arrives untouched. No
/// escaping is right for both paths; a message without '%' survives any number.
fn without_format_verbs(message: &str) -> String {
    message.replace('%', " percent")
}

/// Runs blocking gpushare work (files, the arbiter's socket) off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> ttrpc::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| status(Code::INTERNAL, format!("gpushare: {e}")))
}

impl TaskForwarder {
    pub fn new(endpoint: Option<Endpoint>, exit: Arc<ExitSignal>) -> Self {
        TaskForwarder {
            endpoint,
            forwarder: OnceCell::new(),
            containers: Arc::default(),
            creating: Arc::default(),
            exit,
        }
    }

    async fn inner(&self) -> ttrpc::Result<&Forwarder> {
        let endpoint = self.endpoint.as_ref().ok_or_else(|| {
            status(
                Code::UNAVAILABLE,
                "gpushare: this shim was started without its runc shim (no endpoint in its environment)",
            )
        })?;
        self.forwarder
            .get_or_try_init(|| Forwarder::connect(endpoint))
            .await
            .map_err(|e| status(Code::UNAVAILABLE, format!("gpushare: {e}")))
    }

    async fn forward<Req, Resp>(
        &self,
        ctx: &TtrpcContext,
        method: &str,
        req: &Req,
    ) -> ttrpc::Result<Resp>
    where
        Req: containerd_shim::protos::protobuf::Message,
        Resp: containerd_shim::protos::protobuf::Message,
    {
        self.inner()
            .await?
            .call(&context_of(ctx), method, req)
            .await
    }

    async fn bundle_of(&self, ctx: &TtrpcContext, container_id: &str) -> ttrpc::Result<PathBuf> {
        if let Some(record) = self.containers.lock().unwrap().get(container_id) {
            return Ok(record.bundle.clone());
        }
        let state: StateResponse = self
            .forward(
                ctx,
                "State",
                &StateRequest {
                    id: container_id.to_owned(),
                    ..Default::default()
                },
            )
            .await?;
        Ok(PathBuf::from(state.bundle))
    }
}

/// Whether the runc shim still accepts connections (a fresh one: the shared
/// connection may be the one that broke).
async fn runc_shim_listens(endpoint: Option<&Endpoint>) -> bool {
    let Some(endpoint) = endpoint else {
        return false;
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), Forwarder::connect(endpoint)).await,
        Ok(Ok(_))
    )
}

/// Releases the container's lease when its init process exits, without
/// waiting for containerd's Delete (which may come much later, or for a
/// `ctr run` without `--rm`, never).
fn release_on_exit(
    containers: Containers,
    forwarder: Forwarder,
    container_id: String,
    lease: LeaseId,
) {
    tokio::spawn(async move {
        let wait = WaitRequest {
            id: container_id.clone(),
            ..Default::default()
        };
        let exited: ttrpc::Result<WaitResponse> = forwarder
            .call(&context::Context::default(), "Wait", &wait)
            .await;
        if let Err(e) = exited {
            // The runc shim went away: Delete or the `delete` cleanup releases.
            log::debug!("container {container_id}: no exit to wait for: {e}");
            return;
        }
        // Only this very lease: the container may have been deleted and
        // created again (same id, a newer lease) meanwhile.
        let still_held =
            take_lease_if_held(containers.lock().unwrap().get_mut(&container_id), &lease);
        if still_held {
            let id = container_id.clone();
            let released = blocking(move || gpushare::release_lease(&id, &lease)).await;
            match released {
                Ok(Ok(_)) => log::info!("container {container_id}: exited, lease released"),
                Ok(Err(e)) => {
                    log::warn!("container {container_id}: exited, cannot release: {e}")
                }
                Err(e) => log::warn!("container {container_id}: {e}"),
            }
        }
    });
}

/// One Create, carried out apart from the handler that received it.
struct Create {
    forwarder: Forwarder,
    endpoint: Endpoint,
    containers: Containers,
    /// containerd's metadata and timeout.
    ctx: context::Context,
    /// When containerd gives up on this Create.
    deadline: Option<Instant>,
    req: CreateTaskRequest,
}

impl Create {
    async fn run(self) -> ttrpc::Result<CreateTaskResponse> {
        let (id, bundle) = (self.req.id.clone(), PathBuf::from(&self.req.bundle));
        let prepared = blocking({
            let (id, bundle) = (id.clone(), bundle.clone());
            move || gpushare::prepare_create(&id, &bundle)
        })
        .await?
        .map_err(gpushare_status)?;
        let lease = prepared.as_ref().and_then(|p| p.lease().cloned());

        // The runc shim gets what is left of containerd's time, not all of it
        // again; none left (the reserve waited it out): containerd has given
        // up, so nothing is sent.
        let mut forward_ctx = self.ctx.clone();
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                if let Some(prepared) = prepared {
                    let undo_id = id.clone();
                    blocking(move || gpushare::undo_create(&undo_id, prepared)).await?;
                }
                return Err(status(
                    Code::DEADLINE_EXCEEDED,
                    format!("gpushare: container {id}: the deadline passed before it was handed to the runc shim; nothing created"),
                ));
            }
            forward_ctx.timeout_nano = left.as_nanos().min(i64::MAX as u128) as i64;
        }

        let created: Result<CreateTaskResponse, CallError> = self
            .forwarder
            .call_raw(&forward_ctx, "Create", &self.req)
            .await;
        let error = match created {
            Ok(response) => {
                self.record(id, bundle, lease);
                return Ok(response);
            }
            Err(error) => error,
        };
        let Some(prepared) = prepared else {
            // No lease, no edit: nothing to undo or keep.
            return Err(self.forwarder.to_status("Create", error));
        };
        let probe = RuncShimProbe {
            endpoint: self.endpoint.clone(),
            ctx: self.ctx.clone(),
        };
        match failed_create::settle(&id, &error, &probe).await {
            Decision::Undo => {
                log::info!("container {id}: the forwarded Create failed ({error}): undone");
                let undo_id = id.clone();
                blocking(move || gpushare::undo_create(&undo_id, prepared)).await?;
            }
            // (`settle` never leaves it at ProbeState; were it to, nothing is
            // known, and the lease is kept.)
            kept @ (Decision::Keep(_) | Decision::ProbeState) => {
                let why = match &kept {
                    Decision::Keep(Kept::Exists) => {
                        "the runc shim knows it: it was created".to_owned()
                    }
                    Decision::Keep(Kept::Unknown(reason)) => format!(
                        "whether it was created is unknown ({reason}); kept until its Delete or exit, \
                         or the arbiter's reconciliation"
                    ),
                    _ => "whether it was created is unknown (undecided)".to_owned(),
                };
                log::warn!(
                    "container {id}: the forwarded Create failed ({error}), lease and spec kept: {why}"
                );
                self.record(id, bundle, lease);
            }
        }
        Err(self.forwarder.to_status("Create", error))
    }

    /// The container exists (or may): it is recorded with its lease, which its
    /// exit or its Delete releases.
    fn record(&self, id: String, bundle: PathBuf, lease: Option<LeaseId>) {
        self.containers.lock().unwrap().insert(
            id.clone(),
            ContainerRecord {
                bundle,
                lease: lease.clone(),
                leased: lease.is_some(),
            },
        );
        if let Some(lease) = lease {
            log::info!("container {id}: created with lease {}", lease.0);
            release_on_exit(self.containers.clone(), self.forwarder.clone(), id, lease);
        }
    }
}

#[async_trait]
impl Task for TaskForwarder {
    async fn create(
        &self,
        ctx: &TtrpcContext,
        mut req: CreateTaskRequest,
    ) -> ttrpc::Result<CreateTaskResponse> {
        let forwarder = self.inner().await?.clone();
        let endpoint = self
            .endpoint
            .clone()
            .expect("inner() succeeded: there is an endpoint");
        // containerd's CRI plugin sends `runtimeoptions.v1` for a runtime type
        // other than runc's; the runc shim cannot decode them and would fail.
        if req
            .options
            .as_ref()
            .is_some_and(|o| !inner::is_runc_options(&o.type_url))
        {
            log::info!(
                "container {}: runtime options of type {} are not runc's: not passed on",
                req.id,
                req.options.type_url
            );
            req.options = MessageField::none();
        }
        let create = Create {
            forwarder,
            endpoint,
            containers: self.containers.clone(),
            ctx: context_of(ctx),
            deadline: (ctx.timeout_nano > 0)
                .then(|| Instant::now() + Duration::from_nanos(ctx.timeout_nano as u64)),
            req,
        };
        let id = create.req.id.clone();
        // Held until the outcome is recorded or undone; taken before anything
        // is done, so a Delete cannot slip in between.
        let pending = Arc::new(tokio::sync::Mutex::new(()));
        let guard = pending
            .clone()
            .try_lock_owned()
            .expect("a new mutex is free");
        self.creating
            .lock()
            .unwrap()
            .insert(id.clone(), pending.clone());
        let creating = self.creating.clone();
        // Its own task: the ttrpc server drops this handler when containerd's
        // deadline passes, and what was reserved and forwarded by then must
        // still be recorded or undone.
        let work = tokio::spawn(async move {
            let outcome = create.run().await;
            let mut creating = creating.lock().unwrap();
            if creating.get(&id).is_some_and(|p| Arc::ptr_eq(p, &pending)) {
                creating.remove(&id);
            }
            drop(guard);
            outcome
        });
        work.await
            .map_err(|e| status(Code::INTERNAL, format!("gpushare: {e}")))?
    }

    async fn exec(&self, ctx: &TtrpcContext, mut req: ExecProcessRequest) -> ttrpc::Result<Empty> {
        if let Some(spec) = req.spec.as_mut() {
            let bundle = self.bundle_of(ctx, &req.id).await?;
            let mut process = std::mem::take(&mut spec.value);
            let edited = blocking(move || {
                gpushare::edit_exec_process(&bundle, &mut process).map(|_| process)
            })
            .await?
            .map_err(gpushare_status)?;
            spec.value = edited;
        }
        self.forward(ctx, "Exec", &req).await
    }

    async fn delete(
        &self,
        ctx: &TtrpcContext,
        req: DeleteRequest,
    ) -> ttrpc::Result<DeleteResponse> {
        // A Create of this container still being settled (containerd deletes
        // right after a failed Create): its outcome decides what there is to release.
        let pending = self.creating.lock().unwrap().get(&req.id).cloned();
        if let Some(pending) = pending {
            let _settled = pending.lock().await;
        }
        let deleted: ttrpc::Result<DeleteResponse> = self.forward(ctx, "Delete", &req).await;
        // The container itself (not one of its exec processes) is gone, or was never there.
        let container_gone = is_container_gone(
            &req.exec_id,
            deleted.as_ref().map(|_| ()).map_err(is_not_found),
        );
        if container_gone {
            let record = self.containers.lock().unwrap().remove(&req.id);
            if record.is_some_and(|r| r.leased) {
                let id = req.id.clone();
                match blocking(move || gpushare::release_container(&id)).await? {
                    Ok(_) => log::info!("container {}: deleted, lease released", req.id),
                    Err(e) => log::warn!("container {}: deleted, cannot release: {e}", req.id),
                }
            }
        }
        deleted
    }

    async fn shutdown(&self, ctx: &TtrpcContext, req: ShutdownRequest) -> ttrpc::Result<Empty> {
        // The runc shim makes the same decision for itself (it stays while it
        // has containers); its answer changes nothing here.
        if let Err(e) = self.forward::<_, Empty>(ctx, "Shutdown", &req).await {
            log::debug!("runc shim shutdown: {e}");
        }
        // A Create still being settled decides whether a container remains:
        // the decision to exit waits for it, apart from this call (whose
        // deadline may pass first).
        let pending: Vec<_> = self.creating.lock().unwrap().values().cloned().collect();
        let (containers, endpoint, exit) = (
            self.containers.clone(),
            self.endpoint.clone(),
            self.exit.clone(),
        );
        tokio::spawn(async move {
            for create in pending {
                let _settled = create.lock().await;
            }
            let remaining = containers.lock().unwrap().len();
            if remaining == 0 {
                exit.signal();
            } else if !runc_shim_listens(endpoint.as_ref()).await {
                // Nothing can be served without it (a container kept after a
                // Create whose outcome was unknown, or one whose runc shim died):
                // containerd's cleanup (this binary's `delete`) releases what is left.
                log::warn!(
                    "the runc shim is gone: exiting with {remaining} container(s) left to containerd's cleanup"
                );
                exit.signal();
            }
        });
        Ok(Empty::new())
    }

    async fn connect(
        &self,
        ctx: &TtrpcContext,
        req: ConnectRequest,
    ) -> ttrpc::Result<ConnectResponse> {
        let mut response: ConnectResponse = self.forward(ctx, "Connect", &req).await?;
        response.shim_pid = std::process::id();
        Ok(response)
    }

    async fn state(&self, ctx: &TtrpcContext, req: StateRequest) -> ttrpc::Result<StateResponse> {
        self.forward(ctx, "State", &req).await
    }
    async fn start(&self, ctx: &TtrpcContext, req: StartRequest) -> ttrpc::Result<StartResponse> {
        self.forward(ctx, "Start", &req).await
    }
    async fn pids(&self, ctx: &TtrpcContext, req: PidsRequest) -> ttrpc::Result<PidsResponse> {
        self.forward(ctx, "Pids", &req).await
    }
    async fn pause(&self, ctx: &TtrpcContext, req: PauseRequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "Pause", &req).await
    }
    async fn resume(&self, ctx: &TtrpcContext, req: ResumeRequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "Resume", &req).await
    }
    async fn checkpoint(
        &self,
        ctx: &TtrpcContext,
        req: CheckpointTaskRequest,
    ) -> ttrpc::Result<Empty> {
        self.forward(ctx, "Checkpoint", &req).await
    }
    async fn kill(&self, ctx: &TtrpcContext, req: KillRequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "Kill", &req).await
    }
    async fn resize_pty(&self, ctx: &TtrpcContext, req: ResizePtyRequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "ResizePty", &req).await
    }
    async fn close_io(&self, ctx: &TtrpcContext, req: CloseIORequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "CloseIO", &req).await
    }
    async fn update(&self, ctx: &TtrpcContext, req: UpdateTaskRequest) -> ttrpc::Result<Empty> {
        self.forward(ctx, "Update", &req).await
    }
    async fn wait(&self, ctx: &TtrpcContext, req: WaitRequest) -> ttrpc::Result<WaitResponse> {
        self.forward(ctx, "Wait", &req).await
    }
    async fn stats(&self, ctx: &TtrpcContext, req: StatsRequest) -> ttrpc::Result<StatsResponse> {
        self.forward(ctx, "Stats", &req).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(lease: Option<&str>) -> ContainerRecord {
        ContainerRecord {
            bundle: PathBuf::from("/b"),
            lease: lease.map(|l| LeaseId(l.into())),
            leased: lease.is_some(),
        }
    }

    #[test]
    fn messages_reach_containerd_without_go_format_verbs() {
        // "0% busy" reached kubelet as "0%!!(MISSING)b(MISSING)usy".
        let ttrpc::Error::RpcStatus(s) = status(
            Code::UNAVAILABLE,
            "GPU 0: 0% busy over the last minute (up to 80%)",
        ) else {
            panic!("not a status")
        };
        assert_eq!(
            s.message,
            "GPU 0: 0 percent busy over the last minute (up to 80 percent)"
        );
    }

    #[test]
    fn an_exit_releases_only_the_lease_still_held() {
        let lease = LeaseId("l1".into());
        let mut held = record(Some("l1"));
        assert!(take_lease_if_held(Some(&mut held), &lease));
        assert!(
            held.lease.is_none() && held.leased,
            "cleared, but Delete still releases"
        );
        // Twice: the second exit notice finds nothing to release.
        assert!(!take_lease_if_held(Some(&mut held), &lease));
        // Deleted and created again with a newer lease: the old exit must not touch it.
        let mut newer = record(Some("l2"));
        assert!(!take_lease_if_held(Some(&mut newer), &lease));
        assert_eq!(newer.lease, Some(LeaseId("l2".into())));
        assert!(!take_lease_if_held(None, &lease));
    }

    #[test]
    fn delete_of_the_container_not_of_an_exec_releases() {
        assert!(is_container_gone("", Ok(())));
        assert!(
            is_container_gone("", Err(true)),
            "unknown to the runc shim: gone"
        );
        assert!(
            !is_container_gone("", Err(false)),
            "delete failed: still there"
        );
        assert!(
            !is_container_gone("exec1", Ok(())),
            "only an exec process went"
        );
    }

    #[test]
    fn a_request_error_is_invalid_argument_and_keeps_the_parsers_words() {
        let parse = gpushare_oci::request::RequestError::UnknownKey {
            key: "gpushare.io/colour".into(),
        };
        let message = parse.to_string();
        match gpushare_status(GpushareError::Admission(parse.into())) {
            ttrpc::Error::RpcStatus(s) => {
                assert_eq!(s.code(), Code::INVALID_ARGUMENT);
                assert!(s.message.contains(&message), "{}", s.message);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_class_of_error_has_its_code() {
        use gpushare_oci::admission::AdmissionError;
        let unreachable = || gpushare_proto::ClientError::Connect {
            path: "/run/gpushare/control.sock".into(),
            error: std::io::ErrorKind::NotFound.into(),
        };
        let cases = [
            (
                GpushareError::Admission(AdmissionError::ForgedMarker {
                    container_id: "c1".into(),
                }),
                Code::INVALID_ARGUMENT,
            ),
            (
                GpushareError::Admission(AdmissionError::Arbiter {
                    container_id: "c1".into(),
                    source: unreachable(),
                }),
                Code::UNAVAILABLE,
            ),
            (
                GpushareError::Arbiter {
                    container_id: "c1".into(),
                    source: unreachable(),
                },
                Code::UNAVAILABLE,
            ),
            (
                GpushareError::Spec(gpushare_oci::spec::SpecError {
                    field: "process.env",
                    expected: "a JSON array",
                }),
                Code::FAILED_PRECONDITION,
            ),
        ];
        for (error, code) in cases {
            let message = error.to_string();
            match gpushare_status(error) {
                ttrpc::Error::RpcStatus(s) => {
                    assert_eq!(s.code(), code, "{message}");
                    assert_eq!(s.message, format!("gpushare: {message}"));
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
