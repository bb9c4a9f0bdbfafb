use super::*;
use gpushare_proto::{Fraction, LeaseState, Priority};

pub(crate) fn record(id: &str) -> LeaseRecord {
    LeaseRecord {
        lease: Lease {
            id: LeaseId(id.into()),
            container_id: format!("c-{id}"),
            namespace: None,
            sandbox_id: None,
            gpus: vec!["GPU-0".into()],
            priority: Priority::Low,
            memory_bytes: 1 << 30,
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            tenant: None,
            state: LeaseState::Reserved,
            pid: None,
            created_unix_ms: 0,
            pod: None,
        },
        cgroup: None,
        pid_start_time: None,
    }
}

fn put(id: &str) -> Record {
    Record::Put {
        lease: Box::new(record(id)),
    }
}

fn open(dir: &Path, compact_after: usize) -> (LeaseStore, Table) {
    LeaseStore::open(dir, StoreOptions { compact_after }).unwrap()
}

#[test]
fn changes_survive_reopen_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (store, table) = open(dir.path(), 4096);
    assert!(table.leases.is_empty());
    let mut last = None;
    for r in [
        put("a"),
        put("b"),
        Record::Delete {
            id: LeaseId("a".into()),
        },
        Record::Drain {
            gpu: "GPU-0".into(),
            drained: true,
        },
    ] {
        last = Some(store.append(r).unwrap());
    }
    store.wait_blocking(last.unwrap()).unwrap();
    drop(store);
    let (_store, table) = open(dir.path(), 4096);
    assert_eq!(
        table
            .leases
            .keys()
            .map(|k| k.0.as_str())
            .collect::<Vec<_>>(),
        ["b"]
    );
    assert!(table.drained.contains("GPU-0"));
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The store names every container, its pod and its grants: only root reads it,
/// whatever the umask, and files an older version left readable are closed at open.
#[test]
fn the_log_and_the_snapshot_are_readable_by_their_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 4096);
    let t = store.append(put("a")).unwrap();
    store.wait_blocking(t).unwrap();
    store.compact().unwrap();
    let t = store.append(put("b")).unwrap();
    store.wait_blocking(t).unwrap();
    drop(store);
    for name in [LOG, SNAPSHOT] {
        assert_eq!(mode(&dir.path().join(name)), 0o600, "{name} as written");
        fs::set_permissions(dir.path().join(name), fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (_store, table) = open(dir.path(), 4096);
    assert_eq!(table.leases.len(), 2);
    for name in [LOG, SNAPSHOT] {
        assert_eq!(mode(&dir.path().join(name)), 0o600, "{name} after open");
    }
}

#[test]
fn compacting_at_a_stop_folds_the_whole_log_into_the_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 4096);
    let _ = store.append(put("kept")).unwrap();
    let t = store.append(put("gone")).unwrap();
    store.wait_blocking(t).unwrap();
    let t = store
        .append(Record::Delete {
            id: LeaseId("gone".into()),
        })
        .unwrap();
    store.wait_blocking(t).unwrap();
    assert!(fs::metadata(dir.path().join(LOG)).unwrap().len() > 0);
    store.compact().unwrap();
    assert_eq!(fs::metadata(dir.path().join(LOG)).unwrap().len(), 0);
    drop(store);
    let (_s, table) = open(dir.path(), 4096);
    let ids: Vec<&str> = table.leases.keys().map(|id| id.0.as_str()).collect();
    assert_eq!(ids, ["kept"]);
}

#[test]
fn a_store_that_cannot_be_written_is_not_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 4096);
    store.fail_writes(true);
    let t = store.append(put("lost")).unwrap();
    assert!(store.wait_blocking(t).is_err());
    assert!(matches!(store.compact(), Err(StoreError::Failed(_))));
}

#[test]
fn compaction_keeps_the_state_and_empties_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 10);
    for i in 0..50 {
        let t = store.append(put(&format!("l{i}"))).unwrap();
        if i % 2 == 0 {
            store.wait_blocking(t).unwrap();
            let t = store
                .append(Record::Delete {
                    id: LeaseId(format!("l{i}")),
                })
                .unwrap();
            store.wait_blocking(t).unwrap();
        }
    }
    drop(store);
    let log_lines = fs::read(dir.path().join(LOG))
        .unwrap()
        .iter()
        .filter(|&&b| b == b'\n')
        .count();
    assert!(
        log_lines < 75,
        "75 records were appended; the log was compacted to {log_lines}"
    );
    assert!(dir.path().join(SNAPSHOT).exists());
    let (_s, table) = open(dir.path(), 10);
    assert_eq!(table.leases.len(), 25);
    assert!(table.leases.contains_key(&LeaseId("l49".into())));
    assert!(!table.leases.contains_key(&LeaseId("l48".into())));
}

#[test]
fn replaying_an_old_log_over_a_newer_snapshot_is_harmless() {
    // A crash between the snapshot's rename and the log's truncation.
    let dir = tempfile::tempdir().unwrap();
    let mut table = Table::default();
    let history = [
        put("a"),
        put("b"),
        Record::Delete {
            id: LeaseId("a".into()),
        },
    ];
    let mut log = Vec::new();
    for r in &history {
        table.apply(r);
        log.extend(serde_json::to_vec(r).unwrap());
        log.push(b'\n');
    }
    write_snapshot(dir.path(), &table).unwrap();
    fs::write(dir.path().join(LOG), &log).unwrap();
    let (_s, loaded) = open(dir.path(), 4096);
    assert_eq!(loaded, table);
}

#[test]
fn torn_tail_is_dropped_and_truncated_but_mid_log_garbage_is_corruption() {
    let good = |id: &str| {
        let mut l = serde_json::to_vec(&put(id)).unwrap();
        l.push(b'\n');
        l
    };
    let mut bytes = good("a");
    let valid = bytes.len() as u64;
    bytes.extend_from_slice(&good("b")[..20]);
    let (records, len) = parse_log(&bytes).unwrap();
    assert_eq!((records.len(), len), (1, valid));

    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join(LOG), &bytes).unwrap();
    let (store, table) = open(dir.path(), 4096);
    assert_eq!(table.leases.len(), 1);
    let t = store.append(put("c")).unwrap();
    store.wait_blocking(t).unwrap();
    drop(store);
    let (_s, table) = open(dir.path(), 4096);
    assert_eq!(
        table.leases.len(),
        2,
        "the new record follows the valid prefix"
    );

    let mut corrupt = good("a");
    corrupt.extend_from_slice(b"{garbage\n");
    corrupt.extend_from_slice(&good("b"));
    assert_eq!(parse_log(&corrupt).unwrap_err().0, 2);
}

#[test]
fn a_whole_line_with_a_refused_lease_id_is_corruption_even_last() {
    let mut bytes = serde_json::to_vec(&put("a")).unwrap();
    bytes.push(b'\n');
    bytes.extend_from_slice(br#"{"op":"delete","id":"../../x"}"#);
    bytes.push(b'\n');
    let (line, why) = parse_log(&bytes).unwrap_err();
    assert_eq!(line, 2);
    assert!(
        why.contains("\"../../x\"") && why.contains("a-z, 0-9 and '-'"),
        "{why}"
    );
    // Torn (no newline) it would be dropped; whole, it was written that way.
    bytes.pop();
    assert_eq!(parse_log(&bytes).unwrap().0.len(), 1);
    // A whole line with an op no arbiter writes is refused too.
    let mut unknown = serde_json::to_vec(&put("a")).unwrap();
    unknown.extend_from_slice(b"\n{\"op\":\"explode\"}\n");
    assert_eq!(parse_log(&unknown).unwrap_err().0, 2);
}

#[test]
fn a_snapshot_with_a_refused_lease_id_does_not_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut table = Table::default();
    table.apply(&put("../../x"));
    write_snapshot(dir.path(), &table).unwrap();
    let err = LeaseStore::open(dir.path(), StoreOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("leases.json") && err.contains("\"../../x\"") && err.contains("a-z, 0-9"),
        "{err}"
    );
}

#[test]
fn a_failed_write_refuses_changes_until_recovered_and_its_tickets_stay_failed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 4096);
    let a = store.append(put("a")).unwrap();
    store.wait_blocking(a).unwrap();
    store.fail_writes(true);
    let b = store.append(put("b")).unwrap();
    let err = store.wait_blocking(b).unwrap_err().to_string();
    assert!(
        err.contains("No space left") && !err.contains("restart"),
        "{err}"
    );
    assert!(store.has_failed(b) && !store.has_failed(a) && store.is_durable(a));
    assert!(store.failure().is_some());
    assert!(
        matches!(store.append(put("c")), Err(StoreError::Failed(_))),
        "refused at once while failing"
    );
    // Still full: the recovery fails and changes nothing.
    let mut table = Table::default();
    table.apply(&put("a"));
    table.apply(&put("kept-in-memory"));
    assert!(store.recover(&table).is_err());
    assert!(store.failure().is_some());
    store.fail_writes(false);
    store.recover(&table).unwrap();
    assert!(store.failure().is_none());
    assert!(
        store.wait_blocking(b).is_err(),
        "a ticket a recovery superseded never reads as durable"
    );
    let d = store.append(put("d")).unwrap();
    store.wait_blocking(d).unwrap();
    drop(store);
    let (_s, loaded) = open(dir.path(), 4096);
    let ids: Vec<&str> = loaded.leases.keys().map(|k| k.0.as_str()).collect();
    assert_eq!(ids, ["a", "d", "kept-in-memory"]);
}

fn grant(id: &str, gpu: Option<&str>) -> Grant {
    Grant {
        id: GrantId(id.into()),
        amount: gpushare_proto::grant::GrantAmount::Memory { bytes: 1 << 30 },
        device_ids: vec![format!("memory-{id}")],
        gpu: gpu.map(str::to_owned),
        lease: None,
        created_unix_ms: 1,
    }
}

fn put_grant(id: &str, gpu: Option<&str>) -> Record {
    Record::PutGrant {
        grant: Box::new(grant(id, gpu)),
    }
}

#[test]
fn grant_records_replay_and_fold_into_the_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 4096);
    let mut last = None;
    for r in [
        put_grant("g-a", None),
        put_grant("g-b", Some("GPU-0")),
        put("l"),
        // A waiting grant placed later: the newer record wins.
        put_grant("g-a", Some("GPU-1")),
        Record::DeleteGrant {
            id: GrantId("g-b".into()),
        },
    ] {
        last = Some(store.append(r).unwrap());
    }
    store.wait_blocking(last.unwrap()).unwrap();
    drop(store);
    let (store, replayed) = open(dir.path(), 4096);
    let want = BTreeMap::from([(GrantId("g-a".into()), grant("g-a", Some("GPU-1")))]);
    assert_eq!(replayed.grants, want);
    assert_eq!(replayed.leases.len(), 1);
    store.compact().unwrap();
    drop(store);
    assert_eq!(fs::metadata(dir.path().join(LOG)).unwrap().len(), 0);
    let (_s, from_snapshot) = open(dir.path(), 4096);
    assert_eq!(from_snapshot, replayed);
}

#[test]
fn a_torn_grant_record_is_dropped_and_a_bad_grant_id_is_corruption() {
    let line = |r: &Record| {
        let mut l = serde_json::to_vec(r).unwrap();
        l.push(b'\n');
        l
    };
    let mut bytes = line(&put_grant("g-a", None));
    let valid = bytes.len() as u64;
    bytes.extend_from_slice(&line(&put_grant("g-b", None))[..25]);
    let (records, len) = parse_log(&bytes).unwrap();
    assert_eq!((records, len), (vec![put_grant("g-a", None)], valid));

    for bad in [
        put_grant("../g", None),
        Record::DeleteGrant {
            id: GrantId("G-UPPER".into()),
        },
    ] {
        let (n, why) = parse_log(&line(&bad)).unwrap_err();
        assert_eq!(n, 1);
        assert!(why.contains("not a plain name"), "{why}");
    }
    let dir = tempfile::tempdir().unwrap();
    let table = Table {
        grants: BTreeMap::from([(GrantId("../g".into()), grant("../g", None))]),
        ..Default::default()
    };
    write_snapshot(dir.path(), &table).unwrap();
    let err = LeaseStore::open(dir.path(), StoreOptions::default())
        .err()
        .unwrap();
    assert!(matches!(err, StoreError::BadSnapshotGrant { .. }), "{err}");
}

#[test]
fn a_snapshot_from_before_grants_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let old = serde_json::json!({"version": 1, "leases": [record("old")], "drained": []});
    fs::write(dir.path().join(SNAPSHOT), old.to_string()).unwrap();
    let (_s, table) = open(dir.path(), 4096);
    assert!(table.leases.contains_key(&LeaseId("old".into())));
    assert!(table.grants.is_empty());
}

#[test]
fn the_first_arbiters_snapshot_format_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = serde_json::to_vec_pretty(&vec![record("old").lease]).unwrap();
    fs::write(dir.path().join(SNAPSHOT), legacy).unwrap();
    let (_s, table) = open(dir.path(), 4096);
    assert!(table.leases.contains_key(&LeaseId("old".into())));
}

#[test]
fn concurrent_appends_share_fsyncs_and_all_become_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(dir.path(), 100_000);
    let store = Arc::new(store);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let ticket = store.append(put(&format!("t{t}-{i}"))).unwrap();
                    store.wait_blocking(ticket).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(Arc::try_unwrap(store).ok().unwrap());
    let (_s, table) = open(dir.path(), 100_000);
    assert_eq!(table.leases.len(), 400);
}
