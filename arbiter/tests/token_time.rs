//! Per-lease token time end to end: two token clients (simgpu-workload under the
//! interposer) share one simulated GPU through a private arbiter; `gpusharectl top
//! --once`, the per-lease metrics and the timeline must agree with the token
//! service's accounting (the status report) within 2 %. Also `/healthz` and
//! `gpushare_build_info` on the metrics listener.
//!
//! Needs the built programs (`make build`; GPUSHARE_BIN_DIR, GPUSHARE_PRELOAD_LIB).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use gpushare_proto::Priority;

/// One HTTP/1.0 GET: (status line, body).
fn get(port: u16, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// The value of the series `name` whose labels contain `lease="…"`.
fn series(exposition: &str, name: &str, lease: &str) -> f64 {
    let needle = format!("lease=\"{lease}\"");
    exposition
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(&needle))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} for {lease} in\n{exposition}"))
}

fn within_2_percent(what: &str, got: f64, truth: f64) {
    assert!(
        (got - truth).abs() <= 0.02 * truth,
        "{what}: {got} vs the token service's {truth} (more than 2 % apart)"
    );
}

#[test]
fn top_metrics_and_timeline_agree_with_the_token_accounting() {
    binaries::gpusharectl();
    binaries::require(&["gpushare-arbiter", "gpusharectl", "simgpu-workload"]);
    let port = free_port();
    let arbiter = Arbiter::builder()
        .declared_gpus(1, "16Gi")
        .configure(|c| c.arbiter.metrics_address = Some(format!("127.0.0.1:{port}")))
        .start();
    let simgpu_dir = arbiter.dir().join("simgpu");
    std::fs::create_dir_all(&simgpu_dir).unwrap();
    let mut control = arbiter.client();
    let mut containers = Inits(Vec::new());
    let mut leases = Vec::new();
    for (i, container_id) in ["trainer-a", "trainer-b"].iter().enumerate() {
        let lease = control
            .reserve(reserve_request(container_id, Priority::Low, "1Gi", 0))
            .unwrap();
        let init = container_process();
        control
            .confirm(container_id.to_string(), init.id())
            .unwrap();
        containers.0.push(init);
        leases.push((lease.id.0, i));
    }
    // Two busy jobs, back to back kernels of 2 ms for 6 s: each wants the whole GPU.
    let jobs = leases
        .iter()
        .map(|(lease, _)| token_workload(&arbiter, lease, &simgpu_dir, "6s"))
        .collect();
    wait_for_workloads(jobs);
    // The clients are gone; their time stays with their leases.
    let report = control.status().unwrap();
    let top = arbiter.ctl(&["top", "--once"]);
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    let top = String::from_utf8(top.stdout).unwrap();
    assert!(
        !top.contains('\x1b'),
        "top --once writes no control codes:\n{top}"
    );
    let (_, metrics) = get(port, "/metrics");
    let timeline = control.timeline(None).unwrap();
    let mut total_ms = 0.0;
    for (lease, _) in &leases {
        let usage = report.usage.iter().find(|u| &u.lease.0 == lease).unwrap();
        let truth_ms = usage.token_time_ms as f64;
        assert!(
            truth_ms > 500.0,
            "{lease} held the token only {truth_ms} ms of its 6 s run:\n{top}"
        );
        total_ms += truth_ms;
        within_2_percent(
            "metrics",
            series(&metrics, "gpushare_lease_token_time_seconds_total", lease) * 1000.0,
            truth_ms,
        );
        // top shows "x.yz s" in the row of the container (named by its id).
        let row = top
            .lines()
            .find(|l| l.trim_start().starts_with(&usage.container))
            .unwrap_or_else(|| panic!("no row for {} in\n{top}", usage.container));
        let shown: f64 = row
            .split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .find(|w| w[1] == "s")
            .and_then(|w| w[0].parse().ok())
            .unwrap_or_else(|| panic!("no GPU time in {row:?}"));
        within_2_percent("top", shown * 1000.0, truth_ms);
        let timed = timeline
            .leases
            .iter()
            .find(|t| &t.lease.0 == lease)
            .unwrap()
            .token_time_ms as f64;
        within_2_percent("timeline", timed, truth_ms);
        // The holds drawn add up to the same time.
        let held: u64 = timeline.gpus[0]
            .holds
            .iter()
            .filter(|h| &h.lease.0 == lease)
            .map(|h| h.end_unix_ms - h.start_unix_ms)
            .sum();
        within_2_percent("timeline holds", held as f64, truth_ms);
        eprintln!(
            "{lease}: token service {truth_ms} ms, top {shown} s, timeline {timed} ms, holds {held} ms"
        );
    }
    // One GPU's token: the two leases' time cannot add up to more than the run.
    assert!(
        total_ms <= 6_000.0 * 1.05 + 1_000.0,
        "{total_ms} ms on one GPU"
    );
    // The health endpoint and the build's identity.
    let (status, body) = get(port, "/healthz");
    assert_eq!(
        (status.as_str(), body.as_str()),
        ("HTTP/1.0 200 OK", "ok\n")
    );
    let build_info = metrics
        .lines()
        .find(|l| l.starts_with("gpushare_build_info{"))
        .unwrap_or_else(|| panic!("no build_info in\n{metrics}"));
    assert!(
        build_info.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION")))
            && build_info.ends_with("} 1"),
        "{build_info}"
    );
    let (status, _) = get(port, "/nothing");
    assert_eq!(status, "HTTP/1.0 404 Not Found");
    // The timeline through gpusharectl, as scripts and the demo read it, and after a
    // lease ended: its holds and its time stay.
    let (ended, _) = &leases[0];
    assert!(control
        .release(gpushare_proto::LeaseId(ended.clone()))
        .unwrap());
    let json = arbiter.ctl(&["timeline", "--json"]);
    assert!(
        json.status.success(),
        "{}",
        String::from_utf8_lossy(&json.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let holds = json["gpus"][0]["holds"].as_array().unwrap();
    assert!(
        holds.iter().any(|h| h["lease"] == ended.as_str()),
        "the ended lease's holds are gone: {json}"
    );
    for key in [
        "lease",
        "container",
        "priority",
        "start_unix_ms",
        "end_unix_ms",
    ] {
        assert!(holds[0].get(key).is_some(), "a hold without {key}: {json}");
    }
    let kept = json["leases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["lease"] == ended.as_str())
        .unwrap_or_else(|| panic!("the ended lease's time is gone: {json}"));
    let before = timeline
        .leases
        .iter()
        .find(|t| &t.lease.0 == ended)
        .unwrap()
        .token_time_ms;
    assert_eq!(kept["token_time_ms"].as_u64(), Some(before));
    assert_eq!(kept["container"], "trainer-a");
    let svg = arbiter.dir().join("timeline.svg");
    let text = arbiter.ctl(&["timeline", "--svg", svg.to_str().unwrap()]);
    assert!(
        text.status.success(),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    let text = String::from_utf8(text.stdout).unwrap();
    let strip = text
        .lines()
        .find(|l| l.contains('|'))
        .unwrap_or_else(|| panic!("no strip in\n{text}"));
    assert!(
        strip.contains('A') && strip.contains('B'),
        "both containers held the GPU: {text}"
    );
    // Letters follow the lease ids' order, which is not the containers'.
    for name in ["trainer-a (low", "trainer-b (low"] {
        assert!(text.contains(name), "{name} in\n{text}");
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("trainer-b"),
        "{}",
        &chart[..200.min(chart.len())]
    );
    drop(containers);
}
