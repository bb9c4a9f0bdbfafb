//! One test kit for every suite and benchmark: a private arbiter, simgpu, and the shared helpers.
//!
//! - [`arbiter`]: a private `gpushare-arbiter` whose configuration is the typed
//!   [`gpushare_config::Config`], written as TOML by the config crate itself;
//! - [`config_edit`]: `key = value` settings applied to a typed configuration table;
//! - [`binaries`]: where the built programs are (`GPUSHARE_BIN_DIR`, `GPUSHARE_PRELOAD_LIB`,
//!   `GPUSHARE_TEST_ARBITER`);
//! - [`simgpu`]: the simulated driver libraries, installed once per process, and a simulated
//!   machine's environment;
//! - [`layout`]: where a lease's directory and socket are under a run directory;
//! - [`rootfs`]: a busybox root filesystem for containers;
//! - [`stats`], [`wait`], [`results`], [`clock`]: the small helpers every harness needs.

pub mod arbiter;
pub mod binaries;
pub mod clock;
pub mod config_edit;
pub mod fake_arbiter;
pub mod layout;
pub mod results;
pub mod rootfs;
pub mod simgpu;
pub mod stats;
pub mod wait;

pub use arbiter::{free_port, reserve_request, stand_in_init, Arbiter, ArbiterBuilder, StartError};
/// The typed configuration builders edit, so a suite needs no dependency of its own on it.
pub use gpushare_config::{self as config, Config};
pub use wait::wait_until;
