//! The telemetry's readings: a sample reaches every window, held time keeps the
//! window's span, and a lease's readings go with it.

use super::*;
use gpushare_proto::Priority;

const WINDOW: Duration = Duration::from_secs(5);

fn lease(id: &str) -> LeaseId {
    LeaseId(id.to_owned())
}

fn sample(utilization: f64, memory_used: u64) -> GpuSample {
    GpuSample {
        utilization,
        memory_used,
    }
}

fn holding(id: &str, held_ns: u64) -> Holding {
    Holding {
        gpu: "GPU-0".to_owned(),
        lease: lease(id),
        pid: Some(1),
        priority: Priority::Low,
        held_ns,
        overran_ns: 0,
    }
}

#[test]
fn nothing_is_known_before_the_first_sample() {
    let t = Telemetry::new(2, WINDOW);
    let now = Instant::now();
    for gpu in 0..2 {
        assert_eq!(t.utilization_last_minute(gpu, now), None);
        assert_eq!(t.utilization_last_10s(gpu, now), None);
        assert_eq!(t.recent_utilization(gpu, now), None);
        assert_eq!(t.memory_used(gpu), None);
    }
    assert_eq!(t.last_sample_age(now), None);
}

#[test]
fn a_sample_updates_every_window_of_its_gpu_only() {
    let mut t = Telemetry::new(2, WINDOW);
    let at = Instant::now();
    t.record_sample(1, at, &sample(0.4, 7));
    let now = at + Duration::from_secs(1);
    assert_eq!(t.utilization_last_minute(1, now), Some(0.4));
    assert_eq!(t.utilization_last_10s(1, now), Some(0.4));
    assert_eq!(t.recent_utilization(1, now), Some(0.4));
    assert_eq!(t.memory_used(1), Some(7));
    assert_eq!(t.last_sample_age(now), Some(Duration::from_secs(1)));
    assert_eq!(t.utilization_last_minute(0, now), None, "GPU 0 not sampled");
    assert_eq!(t.memory_used(0), None);
}

#[test]
fn each_window_forgets_samples_older_than_its_span() {
    let mut t = Telemetry::new(1, WINDOW);
    let at = Instant::now();
    t.record_sample(0, at, &sample(1.0, 0));
    // 20 s later: past the 5 s and 10 s windows, within the minute.
    let later = at + Duration::from_secs(20);
    t.record_sample(0, later, &sample(0.0, 0));
    assert_eq!(t.utilization_last_minute(0, later), Some(0.5));
    assert_eq!(t.utilization_last_10s(0, later), Some(0.0));
    assert_eq!(t.recent_utilization(0, later), Some(0.0));
}

#[test]
fn a_new_recent_window_starts_empty_and_leaves_the_others() {
    let mut t = Telemetry::new(1, WINDOW);
    let at = Instant::now();
    t.record_sample(0, at, &sample(0.6, 0));
    t.set_recent_window(Duration::from_secs(30));
    assert_eq!(t.recent_utilization(0, at), None);
    assert_eq!(t.utilization_last_minute(0, at), Some(0.6));
    // The new span applies: a sample 20 s old still counts.
    t.record_sample(0, at, &sample(0.2, 0));
    let later = at + Duration::from_secs(20);
    assert_eq!(t.recent_utilization(0, later), Some(0.2));
}

#[test]
fn held_time_is_summed_per_lease_and_spans_the_window() {
    let mut t = Telemetry::new(1, WINDOW);
    let at = Instant::now();
    assert_eq!(t.held_span(&lease("a")), None);
    // Two clients of lease a: their held time adds up.
    for s in 0..=8u64 {
        let now = at + Duration::from_secs(s);
        t.record_holdings(
            now,
            vec![holding("a", s * 100), holding("a", s * 10)],
            WINDOW,
        );
    }
    // Readings at 3..8 s kept: one at or beyond the window's start (8 - 5 = 3 s).
    assert_eq!(
        t.held_span(&lease("a")),
        Some(HeldSpan {
            watched: Duration::from_secs(5),
            first_ns: 330,
            last_ns: 880,
        })
    );
}

#[test]
fn a_lease_without_token_clients_loses_its_held_time() {
    let mut t = Telemetry::new(1, WINDOW);
    let at = Instant::now();
    t.record_holdings(at, vec![holding("a", 1), holding("b", 2)], WINDOW);
    t.record_holdings(at, vec![holding("b", 3)], WINDOW);
    assert_eq!(t.held_span(&lease("a")), None);
    assert!(t.held_span(&lease("b")).is_some());
}

#[test]
fn a_measurement_is_fresh_for_its_span_and_goes_with_the_lease() {
    let mut t = Telemetry::new(1, WINDOW);
    let at = Instant::now();
    let fresh = Duration::from_secs(2);
    assert!(!t.measured_within(&lease("a"), at, fresh));
    t.mark_measured(&lease("a"), at);
    t.mark_measured(&lease("b"), at);
    assert!(t.measured_within(&lease("a"), at + Duration::from_secs(1), fresh));
    assert!(!t.measured_within(&lease("a"), at + fresh, fresh));

    t.forget_measurement(&lease("a"));
    assert!(!t.measured_within(&lease("a"), at, fresh));

    t.record_holdings(at, vec![holding("b", 1)], WINDOW);
    t.forget(&lease("b"));
    assert!(!t.measured_within(&lease("b"), at, fresh));
    assert_eq!(t.held_span(&lease("b")), None);
}
