//! `make gpu-check`'s program: it skips cleanly where there is no NVIDIA driver (every
//! CI and development machine), and its checks themselves run and pass on the simulated
//! GPU (GPUSHARE_GPU_CHECK_ON_SIMGPU), so what a GPU machine runs has been run before.

use std::process::Command;

use gpushare_bench::setup::Binaries;
use gpushare_testkit::simgpu::SimMachine;

fn program(binaries: &Binaries) -> Command {
    let mut cmd = Command::new(binaries.program("gpushare-gpu-check"));
    cmd.env("GPUSHARE_BIN_DIR", &binaries.dir)
        .env("GPUSHARE_PRELOAD_LIB", &binaries.preload)
        .env_remove("GPUSHARE_GPU_CHECK_ON_SIMGPU");
    cmd
}

#[test]
fn without_a_driver_it_says_so_and_exits_0() {
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        eprintln!("this machine has an NVIDIA driver: make gpu-check runs for real here");
        return;
    }
    let binaries = Binaries::locate().expect("built binaries (see GPUSHARE_BIN_DIR)");
    let dir = tempfile::tempdir().unwrap();
    let out = program(&binaries)
        .arg(dir.path().join("gpu-check.md"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("no NVIDIA driver"), "{stdout}");
    assert!(
        !dir.path().join("gpu-check.md").exists(),
        "no results without a GPU"
    );
}

#[test]
fn every_check_passes_on_the_simulated_gpu() {
    let binaries = Binaries::locate().expect("built binaries (see GPUSHARE_BIN_DIR)");
    let dir = tempfile::Builder::new()
        .prefix("gsg-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::create_dir_all(dir.path().join("simgpu")).unwrap();
    let machine = SimMachine::new(dir.path().join("simgpu"), 1, "16Gi");
    let results = dir.path().join("gpu-check.md");
    let mut gpu_check = program(&binaries);
    let out = machine
        .apply(&mut gpu_check)
        .arg(&results)
        .env("GPUSHARE_GPU_CHECK_ON_SIMGPU", "1")
        .output()
        .unwrap();
    let report = std::fs::read_to_string(&results).unwrap_or_default();
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report.contains("SIMULATED GPU"), "{report}");
    for check in [
        "probe alone",
        "memory quota",
        "capture across a high",
        "capture across a low",
        "2 s kernels",
        "priority pair",
    ] {
        let line = report
            .lines()
            .find(|l| l.contains(check))
            .unwrap_or_else(|| panic!("no {check} row:\n{report}"));
        assert!(line.contains("| PASS |"), "{line}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(results.with_extension("json")).unwrap()).unwrap();
    assert_eq!(json["checks"].as_array().map(Vec::len), Some(6), "{json}");
}
