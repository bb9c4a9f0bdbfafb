//! libgpushare.so inside a real container started through gpushare-runc and runc:
//! the wrapper (not the test) injects the library, the lease's socket and
//! `NVIDIA_VISIBLE_DEVICES`; the container holds the simulated driver (what the
//! NVIDIA toolkit would inject on a real node) and `gpushare-cuda-probe`, which
//! resolves the driver like the CUDA runtime (`dlopen` + `cuGetProcAddress_v2`).

use std::path::{Path, PathBuf};
use std::process::Command;

use gpushare_e2e::*;
use serde_json::json;

const MI: u64 = 1 << 20;

/// The library under test: the glibc-baseline build `make test` names, else the
/// one next to the other binaries.
fn library() -> PathBuf {
    std::env::var_os("GPUSHARE_PRELOAD_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin("libgpushare.so"))
}

/// Copies `file`'s shared-library dependencies (and the loader) into `root`.
fn copy_dependencies(file: &Path, root: &Path) {
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ldd '{}' | grep -o '/[^ ]*' | while read -r l; do cp -L --parents \"$l\" '{}/'; done",
            file.display(),
            root.display()
        ))
        .status()
        .unwrap();
    assert!(
        status.success(),
        "copying the dependencies of {}",
        file.display()
    );
}

/// A busybox root filesystem with the probe and the simulated driver libraries.
fn cuda_rootfs(root: &Path) {
    busybox_rootfs(root);
    let lib = root.join("opt/simgpu/lib");
    std::fs::create_dir_all(&lib).unwrap();
    simgpu::install(&lib).unwrap_or_else(|e| panic!("{e}"));
    let probe = bin("gpushare-cuda-probe");
    std::fs::copy(&probe, root.join("bin/gpushare-cuda-probe")).expect("gpushare-cuda-probe built");
    for f in [
        probe,
        lib.join("libcuda.so.1"),
        lib.join("libnvidia-ml.so.1"),
        library(),
    ] {
        copy_dependencies(&f, root);
    }
}

/// The container's script: every allocation path alone, the answers, the
/// resolution checks, then two processes sharing the quota. Each output line is
/// prefixed with its part's tag.
fn script() -> String {
    let paths = [
        "alloc 40Mi",
        "managed 40Mi",
        "pitch 40000 1000",
        "array 4096 2560",
        "array3d 1024 1024 10",
        "mipmap 4096 2048 2",
        "async 40Mi",
        "pool-async 40Mi",
        "vmm 40Mi",
    ];
    let mut s = String::from("set -e\nP=/bin/gpushare-cuda-probe\n");
    for (i, p) in paths.iter().enumerate() {
        s += &format!(
            "$P meminfo {p} meminfo {p} free-all sync trim meminfo | sed 's/^/path{i} /'\n"
        );
    }
    s += "$P --ptds ptsz-check async 40Mi async 40Mi free-all | sed 's/^/ptds /'\n";
    s += "$P totalmem nvml-meminfo procaddr cuMemAlloc 3020 0 procaddr cuLaunchKernel 12040 2 \
          dlsym cuGetProcAddress_v2 launch 3 launch-ex coop graph | sed 's/^/info /'\n";
    s += "$P alloc 40Mi touch /tmp/a wait /tmp/b free-all touch /tmp/c > /tmp/a.out &\n";
    s += "$P wait /tmp/a alloc 40Mi alloc 20Mi meminfo touch /tmp/b wait /tmp/c alloc 40Mi meminfo > /tmp/b.out\n";
    s += "wait\nsed 's/^/A /' /tmp/a.out\nsed 's/^/B /' /tmp/b.out\n";
    s += "$P alloc 8Mi chaos | sed 's/^/chaos /'\n";
    s += "echo done\n";
    s
}

struct Output {
    lines: Vec<String>,
}

impl Output {
    fn line(&self, tag: &str, step: &str, n: usize) -> &str {
        let prefix = format!("{tag} {step} ");
        self.lines
            .iter()
            .filter(|l| l.starts_with(&prefix))
            .nth(n)
            .unwrap_or_else(|| panic!("no {tag} {step} #{n}:\n{}", self.lines.join("\n")))
    }
    fn result(&self, tag: &str, step: &str, n: usize) -> String {
        self.line(tag, step, n)
            .split(' ')
            .nth(2)
            .unwrap()
            .to_owned()
    }
    fn value(&self, tag: &str, step: &str, n: usize, key: &str) -> String {
        let line = self.line(tag, step, n);
        line.split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {line}"))
            .to_owned()
    }
    fn number(&self, tag: &str, step: &str, n: usize, key: &str) -> u64 {
        self.value(tag, step, n, key).parse().unwrap()
    }
}

#[test]
fn quota_inside_a_container_started_through_gpushare_runc() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    // The wrapper injects the library named in the configuration: the one under test.
    let config = arbiter.config_variant("config-preload.toml", |c| c.runtime.library = library());
    let simgpu = dir.path().join("simgpu");
    std::fs::create_dir_all(&simgpu).unwrap();

    let bundle = dir.path().join("bundle");
    cuda_rootfs(&bundle.join("rootfs"));
    let mut spec = runc_default_spec(&bundle);
    spec["process"]["args"] = json!(["/bin/sh", "-c", script()]);
    spec["process"]["env"] = json!([
        "PATH=/bin",
        "LD_LIBRARY_PATH=/opt/simgpu/lib",
        "SIMGPU_DIR=/run/simgpu",
        "GPUSHARE_LOG=info",
    ]);
    spec["root"]["readonly"] = json!(false);
    spec["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/run/simgpu", "type": "bind", "source": simgpu, "options": ["rbind", "rw"]
    }));
    spec["annotations"] = json!({"gpushare.io/memory": "64Mi", "gpushare.io/gpu": "index:0"});
    std::fs::write(bundle.join("config.json"), spec.to_string()).unwrap();

    let ran = run_runtime(
        &bin("gpushare-runc"),
        &config,
        &dir.path().join("runc-state"),
        &["run", "--bundle", bundle.to_str().unwrap(), "preload-e2e"],
    );
    let status = ran.status;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&ran.stdout).into_owned(),
        String::from_utf8_lossy(&ran.stderr).into_owned(),
    );
    assert!(
        status.success(),
        "container failed: {status}\n{stdout}\n{stderr}"
    );
    let o = Output {
        lines: stdout.lines().map(str::to_owned).collect(),
    };
    assert!(o.lines.iter().any(|l| l == "done"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("attached to lease"),
        "the injected library reached its lease: {stderr}"
    );

    let taken = [
        40 * MI,
        40 * MI,
        40448 * 1000,
        40 * MI,
        40 * MI,
        40 * MI,
        40 * MI,
        40 * MI,
        40 * MI,
    ];
    let steps = [
        "alloc",
        "managed",
        "pitch",
        "array",
        "array3d",
        "mipmap",
        "async",
        "pool-async",
        "vmm",
    ];
    for (i, (step, bytes)) in steps.iter().zip(taken).enumerate() {
        let tag = format!("path{i}");
        assert_eq!(
            o.number(&tag, "meminfo", 0, "total"),
            64 * MI,
            "{step}: the GPU is the quota"
        );
        assert_eq!(o.number(&tag, "meminfo", 0, "free"), 64 * MI, "{step}");
        assert_eq!(o.result(&tag, step, 0), "CUDA_SUCCESS", "{step}");
        assert_eq!(
            o.number(&tag, "meminfo", 1, "free"),
            64 * MI - bytes,
            "{step}"
        );
        assert_eq!(
            o.result(&tag, step, 1),
            "CUDA_ERROR_OUT_OF_MEMORY",
            "{step}"
        );
        assert_eq!(
            o.number(&tag, "meminfo", 2, "free"),
            64 * MI,
            "{step}: credited"
        );
    }
    assert_eq!(
        o.value("ptds", "ptsz-check", 0, "per_thread"),
        "CUDA_ERROR_NOT_READY"
    );
    assert_eq!(o.result("ptds", "async", 0), "CUDA_SUCCESS");
    assert_eq!(
        o.result("ptds", "async", 1),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "_ptsz path charged"
    );
    assert_eq!(o.number("info", "totalmem", 0, "total"), 64 * MI);
    assert_eq!(o.number("info", "nvml-meminfo", 0, "total"), 64 * MI);
    assert_eq!(
        o.value("info", "procaddr", 0, "via"),
        "libgpushare.so:cuMemAlloc_v2"
    );
    assert_eq!(
        o.value("info", "procaddr", 1, "via"),
        "libgpushare.so:cuLaunchKernel_ptsz"
    );
    assert_eq!(
        o.value("info", "dlsym", 0, "via"),
        "libgpushare.so:cuGetProcAddress_v2"
    );
    for step in ["launch", "launch-ex", "coop", "graph"] {
        assert_eq!(o.result("info", step, 0), "CUDA_SUCCESS", "{step}");
    }
    // Two processes of the container share its quota.
    assert_eq!(o.result("A", "alloc", 0), "CUDA_SUCCESS");
    assert_eq!(o.result("B", "alloc", 0), "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(o.result("B", "alloc", 1), "CUDA_SUCCESS");
    assert_eq!(o.number("B", "meminfo", 0, "free"), 4 * MI);
    assert_eq!(o.result("B", "alloc", 2), "CUDA_SUCCESS", "after A freed");
    assert_eq!(o.value("chaos", "chaos", 0, "children_ok"), "20");
    let _ = Command::new(bin("gpushare-runc"))
        .env("GPUSHARE_CONFIG", &config)
        .arg("--root")
        .arg(dir.path().join("runc-state"))
        .args(["delete", "-f", "preload-e2e"])
        .output();
}
