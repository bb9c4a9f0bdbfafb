//! One library for every gpushare entry point (gpushare-runc, gpushare-hook, the
//! containerd shim): read a container's request from its OCI spec, and apply the
//! lease to the spec. Both are pure functions over the spec; files and sockets
//! stay in the binaries.

pub mod bundle;
pub mod cuda_compat;
pub mod kubernetes;
pub mod mutate;
pub mod request;
pub mod runc_args;

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
