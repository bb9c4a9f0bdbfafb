//! Grants through the real daemon: a grant, a lease reserved against it, and
//! both after SIGKILL and restart; a waiting grant placed once a release makes
//! room; a reserve against a grant that is gone refused over the wire.

mod common;

use common::*;
use gpushare_proto::grant::{GrantAmount, GrantId, GrantRequest, PodBinding};
use gpushare_proto::{ClientError, ErrorKind, Priority, ReserveRequest};

const GIB: u64 = 1 << 30;

fn memory_grant(gib: u64, device: &str) -> GrantRequest {
    GrantRequest {
        amount: GrantAmount::Memory { bytes: gib * GIB },
        device_ids: vec![device.to_owned()],
    }
}

/// What the runtime sends for a Kubernetes container with these grants.
fn against(container: &str, grants: &[&GrantId]) -> ReserveRequest {
    let mut r = request(container, "1Gi", Priority::Low);
    r.memory = None;
    r.pod = Some(PodBinding {
        namespace: Some("team-a".into()),
        name: Some("trainer".into()),
        container: Some("main".into()),
        grants: grants.iter().map(|g| (*g).clone()).collect(),
    });
    r
}

fn leased_gib(report: &gpushare_proto::StatusReport) -> Vec<u64> {
    report.gpus.iter().map(|g| g.memory_leased / GIB).collect()
}

#[test]
fn a_grant_its_placement_and_its_lease_survive_sigkill() {
    let mut d = daemon(2, "8Gi").start();
    let mut c = d.client();
    // Something started outside Kubernetes on one GPU: the grant takes the other.
    let outside = c.reserve(request("outside", "2Gi", Priority::Low)).unwrap();
    let g = c.grant(memory_grant(3, "memory-0")).unwrap();
    let gpu = g.gpu.clone().expect("room on the emptier GPU");
    assert_ne!(gpu, outside.gpus[0], "worst fit: the emptier GPU");

    let mut container = container_process();
    let lease = c.reserve(against("ctr-1", &[&g.id])).unwrap();
    assert_eq!(
        (lease.gpus.clone(), lease.memory_bytes),
        (vec![gpu.clone()], 3 * GIB)
    );
    c.confirm("ctr-1".into(), container.id()).unwrap();
    let before = c.status().unwrap();
    drop(c);

    d.kill();
    d.restart();
    let mut c = d.client();
    let grants = c.grants().unwrap();
    assert_eq!(grants.len(), 1, "{grants:?}");
    assert_eq!(grants[0].id, g.id);
    assert_eq!(grants[0].gpu.as_deref(), Some(gpu.as_str()));
    assert_eq!(
        grants[0].lease.as_ref(),
        Some(&lease.id),
        "the binding is derived again"
    );
    let after = c.status().unwrap();
    assert_eq!(
        leased_gib(&after),
        leased_gib(&before),
        "the grant's room counted once"
    );
    let reloaded = after.leases.iter().find(|l| l.id == lease.id).unwrap();
    assert_eq!(reloaded.pod, against("ctr-1", &[&g.id]).pod);

    // A second container cannot use the grant while the first lives.
    let err = c.reserve(against("ctr-2", &[&g.id])).unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused { kind: ErrorKind::InvalidRequest, message } if message.contains(&lease.id.0)),
        "{err}"
    );
    let text = String::from_utf8(d.ctl(&["status", "--verbose"]).stdout).unwrap();
    assert!(text.contains("  grants (1)"), "{text}");
    assert!(text.contains("pod=team-a/trainer/main"), "{text}");
    let _ = container.kill();
    let _ = container.wait();
}

#[test]
fn a_waiting_grant_is_placed_after_a_release_and_a_gone_grant_is_refused() {
    let d = daemon(1, "8Gi").start();
    let mut c = d.client();
    let outside = c.reserve(request("outside", "6Gi", Priority::Low)).unwrap();
    let g = c.grant(memory_grant(4, "memory-0")).unwrap();
    assert_eq!(g.gpu, None, "Allocate never fails for fragmentation");
    assert!(c.release(outside.id).unwrap());
    let placed = c.grants().unwrap();
    assert_eq!(placed[0].gpu.as_deref(), Some(only_gpu(&mut c).as_str()));

    assert!(c.release_grant(g.id.clone()).unwrap());
    assert!(!c.release_grant(g.id.clone()).unwrap(), "idempotent");
    let err = c.reserve(against("ctr-1", &[&g.id])).unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused { kind: ErrorKind::NotFound, message } if message.contains("allocation is gone")),
        "{err}"
    );
}

/// The one GPU's UUID, as the daemon reports it.
fn only_gpu(c: &mut gpushare_proto::ControlClient) -> String {
    c.status().unwrap().gpus[0].uuid.clone()
}
