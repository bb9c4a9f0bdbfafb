use super::*;
use gpushare_config::DeclaredDevice;
use gpushare_proto::ByteSize;

fn config(shared: &[&str]) -> ArbiterConfig {
    ArbiterConfig {
        devices: ["GPU-a", "GPU-b"]
            .iter()
            .map(|u| DeclaredDevice {
                uuid: u.to_string(),
                name: "x".into(),
                memory: ByteSize(1 << 30),
            })
            .collect(),
        shared_gpus: shared.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn all_devices_when_no_shared_list() {
    let gpus = from_declared(&config(&[])).unwrap();
    assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn shared_list_narrows_and_keeps_indices() {
    let gpus = from_declared(&config(&["GPU-b"])).unwrap();
    assert_eq!(gpus.len(), 1);
    assert_eq!((gpus[0].index, gpus[0].uuid.as_str()), (1, "GPU-b"));
    assert_eq!(
        from_declared(&config(&["GPU-z"])),
        Err(InventoryError::UnknownSharedGpu("GPU-z".into()))
    );
}

#[test]
fn unloadable_nvml_falls_back_to_declared_devices() {
    let mut c = config(&[]);
    c.nvml_library = "/nonexistent/libnvidia-ml.so.1".into();
    let backend = open_backend(&c);
    assert_eq!(backend.source(), "declared");
    assert_eq!(backend.gpus().len(), 2);
    assert_eq!(backend.cuda_driver_version(), None);
    assert_eq!(backend.sample("GPU-a"), Ok(None));
    let why = backend.fallback_reason().unwrap();
    assert!(
        why.starts_with("no usable NVIDIA driver: ") && why.contains("/nonexistent/"),
        "{why}"
    );
    c.nvml_library = String::new();
    assert_eq!(
        open_backend(&c).fallback_reason(),
        Some("arbiter.nvml_library is empty (no driver is asked)")
    );
    let err = NvmlBackend::load("/nonexistent/libnvidia-ml.so.1", 0.01)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
        "{err}"
    );
}

fn gpu(index: u32) -> Gpu {
    Gpu {
        index,
        uuid: format!("GPU-{index}"),
        name: "x".into(),
        memory_total: 1 << 30,
        memory_allocatable: 1 << 30,
    }
}

#[test]
fn allocatable_leaves_out_what_the_driver_reserves() {
    const MI: u64 = 1 << 20;
    // (NVML total, reserved as reported, fallback fraction, allocatable)
    let table: &[(u64, Option<u64>, f64, u64)] = &[
        // An H100 80GB: NVML v2 reports the reserve; the fallback is not used.
        (81559 * MI, Some(551 * MI), 0.01, 81008 * MI),
        (16384 * MI, Some(0), 0.01, 16384 * MI),
        // No v2 (an old driver): 1 % of the total, rounded up to a byte.
        (10_000, None, 0.01, 9_900),
        (10_001, None, 0.01, 9_900),
        (16384 * MI, None, 0.0, 16384 * MI),
        // Nonsense never wraps around.
        (100, Some(200), 0.01, 0),
        (100, None, 2.0, 0),
    ];
    for &(total, reserved, fallback, want) in table {
        assert_eq!(
            allocatable(total, reserved, fallback),
            want,
            "{total} {reserved:?} {fallback}"
        );
    }
}

#[test]
fn shareability_from_the_driver_facts() {
    use ComputeMode::*;
    let modes = |compute_mode, mig_enabled| GpuModes {
        compute_mode,
        mig_enabled,
    };
    let evidence = "process nvidia-cuda-mps-control, pid 7";
    let mps = Some(evidence);
    let mps_reason = Unshareable::Mps {
        evidence: evidence.into(),
    };
    for (facts, mps, expected) in [
        (modes(None, None), None, vec![]),
        (modes(Some(Default), Some(false)), None, vec![]),
        (
            modes(Some(ExclusiveProcess), None),
            None,
            vec![Unshareable::ComputeMode(ExclusiveProcess)],
        ),
        (
            modes(Some(Prohibited), Some(false)),
            None,
            vec![Unshareable::ComputeMode(Prohibited)],
        ),
        (
            modes(Some(ExclusiveThread), None),
            None,
            vec![Unshareable::ComputeMode(ExclusiveThread)],
        ),
        (
            modes(Some(Default), Some(true)),
            None,
            vec![Unshareable::Mig],
        ),
        (modes(None, None), mps, vec![mps_reason.clone()]),
        (
            modes(Some(ExclusiveProcess), Some(true)),
            mps,
            vec![
                Unshareable::ComputeMode(ExclusiveProcess),
                Unshareable::Mig,
                mps_reason.clone(),
            ],
        ),
    ] {
        assert_eq!(shareability(&facts, mps), expected, "{facts:?} {mps:?}");
    }
}

#[test]
fn reasons_name_the_gpu_and_what_to_change() {
    let set_aside = UnshareableGpu {
        gpu: gpu(1),
        reasons: vec![Unshareable::ComputeMode(ComputeMode::ExclusiveProcess)],
    };
    assert_eq!(
        set_aside.describe(),
        "GPU 1 (GPU-1) cannot be shared: it is in compute mode EXCLUSIVE_PROCESS; set it to \
         DEFAULT with `nvidia-smi -i GPU-1 -c DEFAULT`; then restart gpushare-arbiter"
    );
    let mig = UnshareableGpu {
        gpu: gpu(0),
        reasons: vec![
            Unshareable::Mig,
            Unshareable::Mps {
                evidence: "its control pipe /tmp/nvidia-mps/control exists".into(),
            },
        ],
    };
    let text = mig.status().reason;
    for piece in [
        "MIG mode is enabled",
        "nvidia-smi -i GPU-0 -mig 0",
        "; and an MPS control daemon is running (its control pipe /tmp/nvidia-mps/control exists)",
        "echo quit | nvidia-cuda-mps-control",
    ] {
        assert!(text.contains(piece), "{text} lacks {piece:?}");
    }
}

#[test]
fn requests_naming_or_needing_an_unshareable_gpu_are_refused() {
    let shareable = [gpu(0)];
    let unshareable = [UnshareableGpu {
        gpu: gpu(1),
        reasons: vec![Unshareable::Mig],
    }];
    let refusal = |selector: &str| {
        // The test UUIDs are not real GPU UUIDs, which parsing would refuse.
        let selector = match selector.strip_prefix("uuid:") {
            Some(uuid) => GpuSelector::Uuid(vec![uuid.to_owned()]),
            None => selector.parse().unwrap(),
        };
        refusal(&selector, &shareable, &unshareable).unwrap_or_default()
    };
    assert_eq!(refusal("count:1"), "", "GPU 0 can take it");
    assert_eq!(refusal("index:0"), "");
    assert_eq!(refusal("uuid:GPU-0"), "");
    assert_eq!(refusal("index:7"), "", "placement says it does not exist");
    for selector in ["index:1", "index:0,1", "uuid:GPU-1"] {
        let message = refusal(selector);
        assert!(
            message.starts_with(&format!(
                "gpu {selector}: GPU 1 (GPU-1) cannot be shared: MIG"
            )),
            "{selector}: {message}"
        );
    }
    let message = refusal("count:2");
    assert!(
        message.starts_with("gpu count:2: only 1 GPU(s) on this node can be shared; GPU 1 (GPU-1)"),
        "{message}"
    );
    assert_eq!(
        super::refusal(&"count:2".parse().unwrap(), &shareable, &[]),
        None,
        "nothing set aside: placement's own error"
    );
}

#[test]
fn mps_is_seen_in_proc_or_by_its_control_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let proc_root = dir.path().join("proc");
    let pipe_dir = dir.path().join("nvidia-mps");
    let process = |pid: u32, comm: &str, cmdline: &[u8]| {
        let p = proc_root.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
        std::fs::write(p.join("cmdline"), cmdline).unwrap();
    };
    process(1, "systemd", b"/sbin/init\0");
    std::fs::create_dir_all(proc_root.join("self")).unwrap();
    let probe = HostMps {
        proc_root: proc_root.clone(),
        pipe_dir: pipe_dir.clone(),
    };
    assert_eq!(probe.running(), None);
    // A plain file is not the pipe.
    std::fs::create_dir_all(&pipe_dir).unwrap();
    std::fs::write(pipe_dir.join("control"), "").unwrap();
    assert_eq!(probe.running(), None);
    std::fs::remove_file(pipe_dir.join("control")).unwrap();
    nix::unistd::mkfifo(
        &pipe_dir.join("control"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    assert_eq!(
        probe.running().as_deref(),
        Some(format!("its control pipe {}/control exists", pipe_dir.display()).as_str())
    );
    process(
        4242,
        "nvidia-cuda-mps",
        b"/usr/bin/nvidia-cuda-mps-control\0-d\0",
    );
    assert_eq!(
        probe.running().as_deref(),
        Some("process nvidia-cuda-mps-control, pid 4242"),
        "the process is the first sign"
    );
}

#[test]
fn a_survey_sets_aside_what_cannot_be_shared() {
    struct Modes(Vec<Gpu>);
    impl GpuBackend for Modes {
        fn source(&self) -> &'static str {
            "test"
        }
        fn gpus(&self) -> Vec<Gpu> {
            self.0.clone()
        }
        fn cuda_driver_version(&self) -> Option<u32> {
            None
        }
        fn sample(&self, _: &str) -> Result<Option<GpuSample>, InventoryError> {
            Ok(None)
        }
        fn processes(&self, _: &str) -> Result<Option<Vec<GpuProcess>>, InventoryError> {
            Ok(None)
        }
        fn modes(&self, uuid: &str) -> GpuModes {
            GpuModes {
                compute_mode: Some(if uuid == "GPU-1" {
                    ComputeMode::ExclusiveProcess
                } else {
                    ComputeMode::Default
                }),
                mig_enabled: Some(false),
            }
        }
    }
    struct Mps(Option<&'static str>);
    impl MpsProbe for Mps {
        fn running(&self) -> Option<String> {
            self.0.map(str::to_owned)
        }
    }
    let backend = Modes(vec![gpu(0), gpu(1), gpu(2)]);
    let survey = survey(&backend, &["GPU-1".into(), "GPU-2".into()], &Mps(None)).unwrap();
    assert_eq!(survey.shareable, vec![gpu(2)], "narrowed, then checked");
    assert_eq!(survey.unshareable.len(), 1);
    assert_eq!(survey.unshareable[0].gpu, gpu(1));
    let all = super::survey(&backend, &[], &Mps(Some("pid 9"))).unwrap();
    assert!(all.shareable.is_empty(), "MPS concerns every GPU");
    assert_eq!(all.unshareable.len(), 3);
    assert_eq!(
        super::survey(&backend, &["GPU-9".into()], &Mps(None)),
        Err(InventoryError::UnknownSharedGpu("GPU-9".into()))
    );
}

#[test]
fn utilization_is_the_mean_of_the_last_minute() {
    let t = Instant::now();
    let mut w = UtilizationWindow::new(UtilizationWindow::LAST_MINUTE);
    assert_eq!(w.mean(t), None);
    w.record(t, 1.0);
    for s in 1..=60 {
        w.record(t + Duration::from_secs(s), 0.0);
    }
    // At t+60 the first sample is exactly a minute old and still counts.
    let mean = w.mean(t + Duration::from_secs(60)).unwrap();
    assert!((mean - 1.0 / 61.0).abs() < 1e-9, "{mean}");
    w.record(t + Duration::from_secs(61), 0.0);
    assert_eq!(w.mean(t + Duration::from_secs(61)), Some(0.0));
    assert_eq!(
        w.mean(t + Duration::from_secs(200)),
        None,
        "stale samples do not count"
    );
    w.record(t + Duration::from_secs(300), 7.0);
    assert_eq!(w.mean(t + Duration::from_secs(300)), Some(1.0), "clamped");
}

#[test]
fn status_says_why_no_gpu_is_shared() {
    let shareable = Survey {
        shareable: vec![gpu(0)],
        unshareable: vec![],
    };
    let none = Survey {
        shareable: vec![],
        unshareable: vec![],
    };
    let all_set_aside = Survey {
        shareable: vec![],
        unshareable: vec![UnshareableGpu {
            gpu: gpu(0),
            reasons: vec![Unshareable::Mig],
        }],
    };
    let no_driver = "no usable NVIDIA driver: NVML: loading libnvidia-ml.so.1: not found";
    for (survey, source, fallback, declared, want) in [
        (&shareable, "nvml", None, 0, None),
        (&shareable, "declared", Some(no_driver), 1, None),
        (
            &none,
            "declared",
            Some(no_driver),
            0,
            Some(format!("{no_driver}, and arbiter.devices declares none")),
        ),
        (
            &none,
            "declared",
            Some("NVML (/x/libnvidia-ml.so.1) reports no GPU"),
            0,
            Some(
                "NVML (/x/libnvidia-ml.so.1) reports no GPU, and arbiter.devices declares none"
                    .into(),
            ),
        ),
        (
            &none,
            "declared",
            None,
            0,
            Some("arbiter.devices declares none".into()),
        ),
        (
            &none,
            "nvml",
            None,
            0,
            Some("the inventory (nvml) lists no GPU".into()),
        ),
    ] {
        assert_eq!(
            no_gpus_reason(survey, source, fallback, declared),
            want,
            "{source} {fallback:?}"
        );
    }
    let why = no_gpus_reason(&all_set_aside, "nvml", None, 0).unwrap();
    assert!(
        why.starts_with("every GPU of this node (1) is set aside as unshareable: GPU 0: MIG"),
        "{why}"
    );
}
