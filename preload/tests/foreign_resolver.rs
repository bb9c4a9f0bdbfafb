//! An answer to `cuGetProcAddress` from outside the driver — a tracer or another
//! interposer that the program loads in front of the driver — is wrapped like the
//! driver's own export: the function it hands out is charged, so the quota holds.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Builds the C interposer in `preload/tests/shims/foreign_resolver.c` into `dir`.
fn build_foreign_interposer(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/shims/foreign_resolver.c");
    let library = dir.join("libforeign_resolver.so");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&library)
        .arg(&source)
        .arg("-ldl")
        .output()
        .expect("a C compiler (`cc`) to build the second interposer");
    assert!(
        out.status.success(),
        "cc {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    library
}

/// The process resolves through the fronting library's `cuGetProcAddress_v2`, which
/// answers `cuMemAlloc` with its own forwarding function: the second 600 MiB under a
/// 1 GiB quota is refused by libgpushare, so that function was wrapped, not passed on.
#[test]
fn an_allocation_answered_by_another_interposer_is_charged() {
    let mut m = Machine::start();
    let lease = m.lease("1Gi");
    let dir = tempfile::tempdir().unwrap();
    let foreign = build_foreign_interposer(dir.path());
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "--driver-library",
            foreign.to_str().unwrap(),
            "procaddr",
            "cuMemAlloc",
            "12040",
            "0",
            "alloc",
            "600Mi",
            "alloc",
            "600Mi",
        ],
    ));
    let via = s.value("procaddr", 0, "via");
    assert!(
        via.starts_with("libgpushare"),
        "cuMemAlloc resolved to {via}, not libgpushare's wrapper: {}",
        s.stderr
    );
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(
        s.result("alloc", 1),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "the fronting library's allocation went around the quota: {:?}\n{}",
        s.lines,
        s.stderr
    );
}
