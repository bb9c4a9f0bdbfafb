//! The operator's view end to end: a private arbiter with two GPUs and two named
//! containers, one on each, whose token clients (simgpu-workload under the interposer)
//! really ran; then `status`, `list`, `top --once` and `timeline` through the real
//! gpusharectl. Each answers who is on which GPU getting what, names the containers
//! the same way, and fits 120 columns. And `status` (and `top`) on a node with no GPU
//! says why.
//!
//! Needs the built programs (`make build`; GPUSHARE_BIN_DIR, GPUSHARE_PRELOAD_LIB).

mod common;

use common::*;
use gpushare_proto::grant::{GrantAmount, GrantRequest, PodBinding};
use gpushare_proto::{GpuSelector, Priority};

/// The widest line gpusharectl's text views may write.
const WIDTH: usize = 120;

/// The pod container on GPU 0 and the plain (ctr-style) container on GPU 1.
const POD_NAME: &str = "team-a/trainer/main";
const PLAIN_NAME: &str = "trainer-b";

/// `gpusharectl args…` against `d`, which must succeed: its stdout.
fn ctl_text(d: &Arbiter, args: &[&str]) -> String {
    let out = d.ctl(args);
    assert!(
        out.status.success(),
        "gpusharectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn assert_fits(command: &str, text: &str) {
    for line in text.lines() {
        assert!(
            line.chars().count() <= WIDTH,
            "{command}: a line of {} columns:\n{line}\nin\n{text}",
            line.chars().count()
        );
    }
    assert!(
        !text.contains('\x1b'),
        "{command}: control codes in\n{text}"
    );
}

/// The lines of `text` from the one starting with `start` up to (not including) the
/// next line that is not indented.
fn block<'t>(text: &'t str, start: &str) -> Vec<&'t str> {
    let mut lines = text.lines().skip_while(|l| !l.starts_with(start));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("no line starting {start:?} in\n{text}"));
    std::iter::once(first)
        .chain(lines.take_while(|l| l.starts_with(' ')))
        .collect()
}

/// The row of `name` in `lines`, its words.
fn row<'t>(lines: &[&'t str], name: &str) -> Vec<&'t str> {
    lines
        .iter()
        .find(|l| l.trim_start().starts_with(name))
        .unwrap_or_else(|| panic!("no row for {name} in\n{}", lines.join("\n")))
        .split_whitespace()
        .collect()
}

/// "1.23 s" or "12.3 s" in `words` after the memory column: the token time, in ms.
fn token_time_ms(words: &[&str]) -> f64 {
    words
        .windows(2)
        .find(|w| w[1] == "s")
        .and_then(|w| w[0].parse::<f64>().ok())
        .map(|s| s * 1000.0)
        .unwrap_or_else(|| panic!("no token time in {words:?}"))
}

#[test]
fn status_list_top_and_timeline_answer_who_is_on_which_gpu_getting_what() {
    binaries::require(&["gpusharectl", "simgpu-workload"]);
    let d = daemon(2, "16Gi").start();
    let simgpu_dir = d.dir().join("simgpu");
    std::fs::create_dir_all(&simgpu_dir).unwrap();
    let mut control = d.client();
    let mut inits = Inits(Vec::new());
    // (container id, its pod, priority, memory, GPU)
    let wanted = [
        (
            "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
            Some(PodBinding {
                namespace: Some("team-a".into()),
                name: Some("trainer".into()),
                container: Some("main".into()),
                grants: vec![],
            }),
            Priority::High,
            "2Gi",
            0,
        ),
        (PLAIN_NAME, None, Priority::Low, "1Gi", 1),
    ];
    let mut leases = Vec::new();
    for (container_id, pod, priority, memory, gpu) in wanted {
        let mut request = request(container_id, memory, priority);
        request.pod = pod;
        request.gpu = GpuSelector::Index(vec![gpu]);
        let lease = control.reserve(request).unwrap();
        let init = container_process();
        control.confirm(container_id.into(), init.id()).unwrap();
        inits.0.push(init);
        leases.push(lease.id.0);
    }
    // A token client per container, back to back kernels of 2 ms for 2 s: each holds
    // its GPU's token while it runs.
    let jobs = leases
        .iter()
        .map(|lease| token_workload(&d, lease, &simgpu_dir, "2s"))
        .collect();
    wait_for_workloads(jobs);
    // Something true to report under PROBLEMS: GPU 1 taken out of placement; and under
    // WAITING: a device plugin's grant of more memory than GPU 0 has left.
    ctl_text(&d, &["drain", "1"]);
    let waiting = control
        .grant(GrantRequest {
            amount: GrantAmount::Memory { bytes: 15 << 30 },
            device_ids: vec!["memory-0".into()],
        })
        .unwrap();
    assert_eq!(waiting.gpu, None, "15Gi fits no open GPU");
    // status: each GPU, its container under it with priority, memory and token time.
    // The arbiter's own count read before and after: a client's last hold may still be
    // closing as its process exits, and what status shows lies between the two.
    let before = control.status().unwrap();
    let status = ctl_text(&d, &["status"]);
    let after = control.status().unwrap();
    assert_fits("status", &status);
    let gpu0 = block(&status, "GPU 0 ");
    let gpu1 = block(&status, "GPU 1 ");
    assert!(
        !gpu0.join("\n").contains(PLAIN_NAME) && !gpu1.join("\n").contains(POD_NAME),
        "each container under its own GPU only:\n{status}"
    );
    for (lines, name, lease, priority, quota) in [
        (&gpu0, POD_NAME, &leases[0], "high", "2Gi"),
        (&gpu1, PLAIN_NAME, &leases[1], "low", "1Gi"),
    ] {
        let words = row(lines, name);
        assert_eq!(&words[1..3], [lease.as_str(), priority], "{status}");
        let slash = words.iter().position(|w| *w == "/").unwrap();
        assert_eq!(words[slash + 1], quota, "memory used/quota: {status}");
        let shown = token_time_ms(&words[slash..]);
        let held = |report: &gpushare_proto::StatusReport| {
            report
                .usage
                .iter()
                .find(|u| &u.lease.0 == lease)
                .unwrap()
                .token_time_ms as f64
        };
        let (low, high) = (held(&before), held(&after));
        assert!(low > 200.0, "{name} held its token {low} ms of 2 s");
        // Shown to 10 ms ("1.93 s"): rounded by at most 5 ms.
        assert!(
            low - 5.0 <= shown && shown <= high + 5.0,
            "{name}: status shows {shown} ms of token time, the arbiter counted {low} to {high}:\n{status}"
        );
    }
    assert!(gpu1[0].contains("DRAINED"), "{status}");
    assert_eq!(
        block(&status, "WAITING"),
        [
            "WAITING (1)".to_owned(),
            format!(
                "  grant {} wants memory 15Gi: no GPU has room for it now",
                waiting.id.0
            )
        ],
        "{status}"
    );
    let problems = block(&status, "PROBLEMS");
    assert_eq!(
        problems,
        [
            "PROBLEMS (1)",
            "  GPU 1 is drained: no new leases are placed on it (`gpusharectl undrain 1`)"
        ],
        "{status}"
    );
    for internal in ["admission", "placement", "inventory", "demand"] {
        assert!(
            !status.contains(internal),
            "{internal} without --verbose:\n{status}"
        );
    }
    let verbose = ctl_text(&d, &["status", "--verbose"]);
    assert_fits("status --verbose", &verbose);
    // The same answers first (the shares move on between the two calls), then the internals.
    assert_eq!(
        verbose.lines().take_while(|l| *l != "DETAILS").count(),
        status.lines().count(),
        "{verbose}"
    );
    assert!(
        verbose.contains("\nDETAILS\n  inventory declared"),
        "{verbose}"
    );

    // list: the same names, the lease ids beside, the GPUs by index.
    let list = ctl_text(&d, &["list"]);
    assert_fits("list", &list);
    let lines: Vec<&str> = list.lines().collect();
    assert!(lines[0].starts_with("CONTAINER"), "{list}");
    for (name, lease, gpu, priority) in [
        (POD_NAME, &leases[0], "0", "high"),
        (PLAIN_NAME, &leases[1], "1", "low"),
    ] {
        assert_eq!(
            &row(&lines, name)[..4],
            [name, lease.as_str(), gpu, priority],
            "{list}"
        );
    }

    // top: the same names under their GPUs, token time named for what it is.
    let top = ctl_text(&d, &["top", "--once"]);
    assert_fits("top", &top);
    assert!(
        top.contains("TOKEN TIME") && !top.contains("GPU TIME"),
        "{top}"
    );
    for (gpu, name) in [("GPU 0 ", POD_NAME), ("GPU 1 ", PLAIN_NAME)] {
        let lines = block(&top, gpu);
        let words = row(&lines, name);
        assert!(token_time_ms(&words) > 0.0, "{top}");
    }

    // timeline: a strip per GPU, each drawn with its own container's letter.
    let timeline = ctl_text(&d, &["timeline"]);
    assert_fits("timeline", &timeline);
    for (gpu, name) in [(0, POD_NAME), (1, PLAIN_NAME)] {
        let legend = timeline
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("{name} in\n{timeline}"));
        assert!(legend.contains("token time"), "{timeline}");
        let letter = legend.trim_start().chars().next().unwrap();
        let strip = timeline
            .lines()
            .find(|l| l.starts_with(&simgpu::gpu_uuid(gpu)))
            .unwrap_or_else(|| panic!("no strip for GPU {gpu} in\n{timeline}"));
        assert!(
            strip.split('|').nth(1).unwrap().contains(letter),
            "GPU {gpu}'s strip lacks {name}'s letter {letter}:\n{timeline}"
        );
    }
    assert!(!timeline.contains("GPU time"), "{timeline}");
    eprintln!("{status}\n{verbose}\n{list}\n{top}\n{timeline}");
    drop(inits);
}

#[test]
fn status_on_a_node_with_no_gpu_says_why() {
    for (nvml_library, why) in [
        (
            "",
            "arbiter.nvml_library is empty (no driver is asked), and arbiter.devices declares none",
        ),
        (
            "/nonexistent/libnvidia-ml.so.1",
            "no usable NVIDIA driver: NVML: loading /nonexistent/libnvidia-ml.so.1",
        ),
    ] {
        let d = daemon(0, "16Gi")
            .configure(|c| c.arbiter.nvml_library = nvml_library.into())
            .start();
        let status = ctl_text(&d, &["status"]);
        assert_fits("status", &status);
        let first = status.lines().next().unwrap();
        assert!(
            first.starts_with("NO GPU is shared on this node: ") && first.contains(why),
            "{nvml_library:?}: {status}"
        );
        eprintln!("{status}");
        let top = ctl_text(&d, &["top", "--once"]);
        assert!(top.contains("NO GPU is shared on this node: "), "{top}");
        let json = d.status_json();
        assert!(
            json["no_gpus_reason"].as_str().unwrap().contains(why),
            "{json}"
        );
    }
}
