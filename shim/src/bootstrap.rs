//! The shim's own process life, as containerd drives it:
//! - `start` (cwd: the bundle): find or start the shim serving the container's
//!   group, print its address. A new group gets a runc shim first (in its own
//!   directory, on its own socket), then this shim's server, told where the runc
//!   shim listens.
//! - no subcommand: serve the task API (`service`) until `Shutdown`.
//! - `delete` (cwd: the bundle): containerd lost the shim (it exited or was
//!   killed): clean up what it left — the container, the lease, the sockets, and
//!   a runc shim that outlived it.

use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::api::{
    DeleteRequest, DeleteResponse, Empty, KillRequest, ShutdownRequest, WaitRequest, WaitResponse,
};
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::ttrpc::{context, Code};
use containerd_shim::{Config, Error, ExitSignal, Flags, Shim, StartOpts};
use gpushare_oci::spec::Spec;

use crate::forward::Forwarder;
use crate::gpushare;
use crate::inner::{self, Endpoint, RuncShim, ShimCall, TaskApi};
use crate::layout::{self, Bundle};

/// The runc shim's endpoint, from `start` to the server it spawns.
const INNER_ADDRESS_ENV: &str = "GPUSHARE_SHIM_RUNC_ADDRESS";
const INNER_API_ENV: &str = "GPUSHARE_SHIM_RUNC_TASK_API";

pub struct GpushareShim {
    namespace: String,
    id: String,
    address: String,
    publish_binary: String,
    bundle: String,
    socket: String,
    debug: bool,
    exit: Arc<ExitSignal>,
}

fn other(message: impl std::fmt::Display) -> Error {
    Error::Other(message.to_string())
}

fn io_error(context: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.to_string();
    move |err| Error::IoError { context, err }
}

/// Something answers on this socket.
fn is_serving(address: &str) -> bool {
    std::os::unix::net::UnixStream::connect(layout::socket_path(address)).is_ok()
}

/// Removes a socket nobody serves any more (a killed shim leaves it behind).
fn remove_dead_socket(address: &str) {
    let path = layout::socket_path(address);
    let is_socket = path
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_socket());
    if is_socket && !is_serving(address) {
        let _ = std::fs::remove_file(path);
    }
}

/// containerd's atomic write (temporary + rename), so it never reads half an address.
fn write_address(file: &Path, address: &str) -> Result<(), Error> {
    let tmp = file.with_file_name(".address.gpushare");
    std::fs::write(&tmp, address).map_err(io_error(format!("write {}", tmp.display())))?;
    std::fs::rename(&tmp, file).map_err(io_error(format!("write {}", file.display())))
}

fn read_spec(bundle: &Bundle) -> Result<Spec, Error> {
    let path = bundle.spec();
    let bytes = std::fs::read(&path).map_err(io_error(format!("read {}", path.display())))?;
    serde_json::from_slice(&bytes).map_err(Error::from)
}

fn now() -> Timestamp {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut t = Timestamp::new();
    t.seconds = since_epoch.as_secs() as i64;
    t.nanos = since_epoch.subsec_nanos() as i32;
    t
}

impl GpushareShim {
    fn call(&self) -> ShimCall {
        ShimCall {
            namespace: self.namespace.clone(),
            address: self.address.clone(),
            publish_binary: self.publish_binary.clone(),
            id: self.id.clone(),
            debug: self.debug,
        }
    }

    /// Starts this shim's server for a group and waits until it listens.
    fn spawn_server(&self, bundle: &Bundle, socket: &str, inner: &Endpoint) -> Result<u32, Error> {
        let exe = std::env::current_exe().map_err(io_error("locate this shim's binary"))?;
        let mut command = Command::new(exe);
        command
            .current_dir(&bundle.dir)
            .args(["-namespace", &self.namespace, "-id", &self.id])
            .args([
                "-address",
                &self.address,
                "-publish-binary",
                &self.publish_binary,
            ])
            .args(["-socket", socket])
            .env(INNER_ADDRESS_ENV, &inner.address)
            .env(INNER_API_ENV, inner.api.as_env())
            // Never containerd's pipes: containerd reads `start`'s output to the end.
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            // Like containerd's own shims: out of containerd's process group, so a
            // signal to containerd's group does not reach the shims.
            .process_group(0);
        if self.debug {
            command.arg("-debug");
        }
        let mut child = command
            .spawn()
            .map_err(io_error("spawn the gpushare shim server"))?;
        // The server closes its stdout once it listens (the crate's
        // signal_server_started): the end of the pipe means "ready".
        let mut ignored = Vec::new();
        if let Some(mut out) = child.stdout.take() {
            let _ = out.read_to_end(&mut ignored);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(other(format!(
                "the gpushare shim server exited at once ({status})"
            )));
        }
        if !is_serving(socket) {
            return Err(other(format!(
                "the gpushare shim server does not answer on {socket}"
            )));
        }
        Ok(child.id())
    }
}

/// Best effort: asks a runc shim to exit (it does once it serves no container).
async fn shut_down_inner(endpoint: &Endpoint, container_id: &str) {
    if let Ok(f) = Forwarder::connect(endpoint).await {
        let req = ShutdownRequest {
            id: container_id.to_owned(),
            ..Default::default()
        };
        let _ = f
            .call::<_, Empty>(&context::Context::default(), "Shutdown", &req)
            .await;
    }
}

/// Which task API an already running runc shim serves (after a crash, nothing
/// else says): a service it does not have is answered UNIMPLEMENTED.
async fn probe_api(address: &str) -> Option<Forwarder> {
    for api in [TaskApi::V2, TaskApi::V3] {
        let endpoint = Endpoint {
            address: address.to_owned(),
            api,
        };
        let forwarder = Forwarder::connect(&endpoint).await.ok()?;
        let probe: Result<containerd_shim::api::ConnectResponse, _> = forwarder
            .call(
                &context::with_timeout(2_000_000_000),
                "Connect",
                &containerd_shim::api::ConnectRequest::new(),
            )
            .await;
        match probe {
            Err(containerd_shim::protos::ttrpc::Error::RpcStatus(s))
                if s.code() == Code::UNIMPLEMENTED || s.code() == Code::NOT_FOUND =>
            {
                continue
            }
            _ => return Some(forwarder),
        }
    }
    None
}

/// A runc shim whose gpushare shim died: finish this container through it (kill,
/// reap, delete), then ask it to exit; it does once its last container is gone.
async fn finish_orphan(inner_address: &str, container_id: &str) -> Option<DeleteResponse> {
    let forwarder = probe_api(inner_address).await?;
    let ctx = context::Context::default();
    let id = container_id.to_owned();
    let kill = KillRequest {
        id: id.clone(),
        signal: libc::SIGKILL as u32,
        all: true,
        ..Default::default()
    };
    let _ = forwarder.call::<_, Empty>(&ctx, "Kill", &kill).await;
    let wait = WaitRequest {
        id: id.clone(),
        ..Default::default()
    };
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        forwarder.call::<_, WaitResponse>(&ctx, "Wait", &wait),
    )
    .await;
    let delete = DeleteRequest {
        id: id.clone(),
        ..Default::default()
    };
    let deleted = forwarder
        .call::<_, DeleteResponse>(&ctx, "Delete", &delete)
        .await
        .ok();
    let shutdown = ShutdownRequest {
        id,
        ..Default::default()
    };
    let _ = forwarder
        .call::<_, Empty>(&ctx, "Shutdown", &shutdown)
        .await;
    deleted
}

/// What `delete` does beyond the runc shim's own cleanup, given which shims of
/// the group still answer. containerd runs `delete` whenever it loses a shim
/// connection, including for one container of a pod whose shim lives on: then
/// nothing of the group may be touched.
#[derive(Debug, PartialEq, Eq)]
struct CleanupPlan {
    remove_outer_socket: bool,
    /// The gpushare shim died but its runc shim lives (and holds the container):
    /// finish the container through it and ask it to exit.
    finish_through_runc_shim: bool,
    remove_inner_socket: bool,
}

fn cleanup_plan(outer_alive: bool, inner_alive: bool) -> CleanupPlan {
    CleanupPlan {
        remove_outer_socket: !outer_alive,
        finish_through_runc_shim: !outer_alive && inner_alive,
        // Only a dead socket is removed (remove_dead_socket checks again after
        // the runc shim was asked to exit).
        remove_inner_socket: !outer_alive,
    }
}

#[async_trait]
impl Shim for GpushareShim {
    type T = crate::service::TaskForwarder;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        crate::gpushare::set_namespace(&args.namespace);
        GpushareShim {
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            address: args.address.clone(),
            publish_binary: args.publish_binary.clone(),
            bundle: args.bundle.clone(),
            socket: args.socket.clone(),
            debug: args.debug,
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        let bundle = Bundle::new(std::env::current_dir().map_err(io_error("working directory"))?);
        let spec = read_spec(&bundle)?;
        let group = layout::grouping(&spec, &opts.id);
        let socket = layout::outer_socket(&opts.address, &opts.namespace, &group);

        // Another container of the group (a pod): its shim already serves.
        if is_serving(&socket) {
            write_address(&bundle.address_file(), &socket)?;
            return Ok(socket);
        }
        remove_dead_socket(&socket);

        let mut options = Vec::new();
        std::io::stdin()
            .read_to_end(&mut options)
            .map_err(io_error("read runtime options"))?;
        let runc_options = inner::runc_options(&options);
        if runc_options.is_none() {
            options.clear();
        }

        let runc = RuncShim::locate(&opts.publish_binary).map_err(other)?;
        let endpoint = runc.start(&self.call(), &bundle, &options).map_err(other)?;
        // containerd ≥ 2.3's runc shim writes no address file of its own (containerd
        // keeps its bootstrap instead): keep the address it printed, where `delete`
        // looks for it, rather than recompute it from a naming scheme that changes.
        let inner_file = bundle.inner_address_file();
        if !inner_file.exists() {
            write_address(&inner_file, &endpoint.address)?;
        }
        let pid = match self.spawn_server(&bundle, &socket, &endpoint) {
            Ok(pid) => pid,
            Err(e) => {
                shut_down_inner(&endpoint, &opts.id).await;
                return Err(e);
            }
        };
        // As the runc shim does for its own server: the shim cgroup, if asked,
        // and an OOM score just above containerd's.
        if let Some(cgroup) = runc_options
            .as_ref()
            .map(|o| o.shim_cgroup.as_str())
            .filter(|c| !c.is_empty())
        {
            containerd_shim::cgroup::add_task_to_cgroup(cgroup, pid)?;
        }
        containerd_shim::cgroup::adjust_oom_score(pid)?;
        write_address(&bundle.address_file(), &socket)?;
        Ok(socket)
    }

    async fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        let bundle = Bundle::new(if self.bundle.is_empty() {
            std::env::current_dir().map_err(io_error("working directory"))?
        } else {
            PathBuf::from(&self.bundle)
        });
        let spec = read_spec(&bundle).ok();
        let group = spec
            .as_ref()
            .map(|s| layout::grouping(s, &self.id))
            .unwrap_or_else(|| self.id.clone());
        let outer = std::fs::read_to_string(bundle.address_file())
            .unwrap_or_else(|_| layout::outer_socket(&self.address, &self.namespace, &group));
        let inner = std::fs::read_to_string(bundle.inner_address_file())
            .unwrap_or_else(|_| layout::inner_socket(&self.address, &self.namespace, &group));

        let mut response = None;
        let plan = cleanup_plan(is_serving(&outer), is_serving(&inner));
        if plan.remove_outer_socket {
            remove_dead_socket(&outer);
        }
        if plan.finish_through_runc_shim {
            response = finish_orphan(&inner, &self.id).await;
        }
        if plan.remove_inner_socket {
            remove_dead_socket(&inner);
        }
        // The runc shim's own cleanup: `runc delete --force`, the rootfs mount.
        match RuncShim::locate(&self.publish_binary)
            .and_then(|r| r.delete(&self.call(), &bundle.dir))
        {
            Ok(r) => {
                response.get_or_insert(r);
            }
            Err(e) => eprintln!("gpushare: container {}: {e}", self.id),
        }
        // Only a container gpushare edited can hold a lease: others never talk to the arbiter.
        if spec.as_ref().is_some_and(gpushare_oci::mutate::is_marked) {
            let id = self.id.clone();
            let released =
                tokio::task::spawn_blocking(move || gpushare::release_container(&id)).await;
            if let Ok(Err(e)) = released {
                eprintln!("gpushare: container {}: {e}", self.id);
            }
        }
        Ok(response.unwrap_or_else(|| DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(now()),
            ..Default::default()
        }))
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
        // The crate removes the socket named in `address` in the working
        // directory, which is gone when the group's first bundle was deleted
        // first: remove it here, by the name it was started with.
        let path = layout::socket_path(&self.socket);
        if path
            .symlink_metadata()
            .is_ok_and(|m| m.file_type().is_socket())
        {
            let _ = std::fs::remove_file(path);
        }
    }

    async fn create_task_service(&self, _publisher: RemotePublisher) -> Self::T {
        // Events come from the runc shim straight to containerd; this shim has
        // none of its own to publish.
        let endpoint = std::env::var(INNER_ADDRESS_ENV).ok().and_then(|address| {
            let api = TaskApi::from_env(&std::env::var(INNER_API_ENV).ok()?)?;
            Some(Endpoint { address, api })
        });
        if endpoint.is_none() {
            log::error!("started without {INNER_ADDRESS_ENV}/{INNER_API_ENV}: containerd runs this shim with `start`");
        }
        crate::service::TaskForwarder::new(endpoint, self.exit.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_living_group_shim_is_left_alone() {
        let plan = cleanup_plan(true, true);
        assert_eq!(
            plan,
            CleanupPlan {
                remove_outer_socket: false,
                finish_through_runc_shim: false,
                remove_inner_socket: false
            }
        );
        assert_eq!(cleanup_plan(true, false), plan);
    }

    #[test]
    fn a_killed_shim_leaves_an_orphan_to_finish() {
        let plan = cleanup_plan(false, true);
        assert!(
            plan.remove_outer_socket && plan.finish_through_runc_shim && plan.remove_inner_socket
        );
        let both_dead = cleanup_plan(false, false);
        assert!(both_dead.remove_outer_socket && !both_dead.finish_through_runc_shim);
    }

    #[test]
    fn only_dead_sockets_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("live");
        let dead = dir.path().join("dead");
        let _listener = std::os::unix::net::UnixListener::bind(&live).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        for p in [&live, &dead, &file] {
            remove_dead_socket(&format!("unix://{}", p.display()));
        }
        assert!(live.exists(), "a serving socket stays");
        assert!(!dead.exists(), "a socket nobody serves goes");
        assert!(file.exists(), "never anything but a socket");
    }

    #[test]
    fn the_address_file_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("address");
        write_address(&file, "unix:///run/containerd/s/a").unwrap();
        write_address(&file, "unix:///run/containerd/s/b").unwrap();
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "unix:///run/containerd/s/b"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
    }
}
