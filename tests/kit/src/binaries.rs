//! Where the programs under test were built. Every suite and benchmark finds them the same
//! way, so one set of environment variables points all of them at another build:
//!
//! - `GPUSHARE_BIN_DIR`: the directory holding the binaries (default: the cargo profile
//!   directory, `target/<profile>`, of the running test or benchmark);
//! - `GPUSHARE_PRELOAD_LIB`: the interposer (default: `libgpushare.so` in that directory;
//!   `make test` points it at the glibc-baseline build);
//! - `GPUSHARE_TEST_ARBITER`: the arbiter every private arbiter runs (default:
//!   `gpushare-arbiter` there), e.g. an older build, to show a test fails without its fix.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The programs gpushare ships (make install, the .deb, the node image).
pub const SHIPPED_PROGRAMS: [&str; 6] = [
    "gpushare-arbiter",
    "gpusharectl",
    "gpushare-runc",
    "gpushare-hook",
    "containerd-shim-gpushare-v2",
    "gpushare-kube",
];

/// `GPUSHARE_BIN_DIR`, else the cargo profile directory the running program was built into
/// (a test or bench binary lives one level down, in `deps/`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("GPUSHARE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("the path of the running program");
    let dir = exe.parent().expect("a program lives in a directory");
    if dir.ends_with("deps") || dir.ends_with("examples") {
        dir.parent().expect("deps/ has a parent").to_owned()
    } else {
        dir.to_owned()
    }
}

/// A built program (or library) in [`bin_dir`].
pub fn program(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// `release` when [`bin_dir`] is a release build, else `debug`: which simgpu libraries
/// tests/simgpu/install.sh takes.
pub fn profile() -> &'static str {
    if bin_dir().ends_with("release") {
        "release"
    } else {
        "debug"
    }
}

/// The interposer under test: `GPUSHARE_PRELOAD_LIB`, else `libgpushare.so` in [`bin_dir`].
pub fn preload_library() -> PathBuf {
    std::env::var_os("GPUSHARE_PRELOAD_LIB")
        .map_or_else(|| program("libgpushare.so"), PathBuf::from)
}

/// The arbiter private arbiters run: `GPUSHARE_TEST_ARBITER`, else `built` (a suite's
/// `CARGO_BIN_EXE_…`), else `gpushare-arbiter` in [`bin_dir`].
pub fn arbiter(built: Option<&Path>) -> PathBuf {
    std::env::var_os("GPUSHARE_TEST_ARBITER")
        .map(PathBuf::from)
        .or_else(|| built.map(Path::to_owned))
        .unwrap_or_else(|| program("gpushare-arbiter"))
}

/// Fails the test, saying how to build them, unless every one of `names` is in [`bin_dir`].
pub fn require(names: &[&str]) {
    for name in names {
        let path = program(name);
        assert!(
            path.exists(),
            "{} missing: build first (`make build`, or `cargo build --workspace`), or point GPUSHARE_BIN_DIR at a build",
            path.display()
        );
    }
}

/// `gpusharectl`: a crate of its own, which the daemon's suites do not depend on, so
/// built into this test's profile once per test process (see [`cargo_build`]).
pub fn gpusharectl() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| cargo_build(&["gpushare-ctl"]));
    program("gpusharectl")
}

/// Builds `packages` into this test's own profile, for suites whose package does not
/// depend on what they run (the interposer's tests run the arbiter and the simulated
/// driver). Does nothing when `GPUSHARE_BIN_DIR` names another build.
pub fn cargo_build(packages: &[&str]) {
    if std::env::var_os("GPUSHARE_BIN_DIR").is_some() {
        return;
    }
    let profile_dir = bin_dir();
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build.args(["build", "-q"]);
    for package in packages {
        build.args(["-p", package]);
    }
    build
        .arg("--target-dir")
        .arg(profile_dir.parent().expect("target/<profile> has a parent"));
    if profile() == "release" {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo");
    assert!(status.success(), "cargo build {packages:?} failed");
}
