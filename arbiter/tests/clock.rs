//! The wall clock jumps under a running arbiter (a recovery fault): NTP
//! correcting a clock that was days off, or an operator setting it. The arbiter runs
//! under libfaketime with only CLOCK_REALTIME shifted, through a file it re-reads on
//! every call, as a real jump would leave the monotonic clocks alone. Leases,
//! reconciliation, the ledger and the token must not notice.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{LeaseClient, LeaseState, Priority, TokenRequest};

const T: Duration = Duration::from_secs(10);
const DAY_MS: i64 = 24 * 3600 * 1000;

/// libfaketime's multithreaded library, from Debian's `faketime` package (`make deps`).
fn libfaketime() -> PathBuf {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect("libfaketimeMT.so.1 is missing: install Debian's faketime package (make deps)")
}

/// Sets the arbiter's wall clock to `offset` from the real one ("+0", "-2d", "+30d").
fn jump(file: &Path, offset: &str) {
    std::fs::write(file, format!("{offset}\n")).unwrap();
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[test]
fn wall_clock_jumps_change_nothing_the_arbiter_decides() {
    let dir = tempfile::tempdir().unwrap();
    let offset = dir.path().join("faketime");
    jump(&offset, "+0");
    let library = libfaketime();
    // Reservations not confirmed within 3 s are taken back; passes every 200 ms.
    let d = daemon(1, "16Gi")
        .configure(|c| {
            c.arbiter.reserved_timeout_ms = 3_000;
            c.arbiter.watchdog_interval_ms = 200;
        })
        .env("LD_PRELOAD", &library)
        .env("FAKETIME_TIMESTAMP_FILE", &offset)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .start();
    let mut c = d.client();
    let confirmed = c.reserve(request("live", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "live");
    let socket = d.lease_socket(&confirmed.id.0);
    let mut ledger = LeaseClient::connect(&socket, T).unwrap();
    ledger.attach(0).unwrap();
    assert!(ledger.charge(1 << 20).unwrap().granted);
    let holder = TokenConnection::open(&socket, T).unwrap();

    // Forward a month: a lease reserved a moment ago is not "a month old".
    let pending = c
        .reserve(request("starting", "1Gi", Priority::Low))
        .unwrap();
    jump(&offset, "+30d");
    let witness = c.reserve(request("witness", "1Gi", Priority::Low)).unwrap();
    let shifted = witness.created_unix_ms as i64 - now_ms();
    assert!(
        (29 * DAY_MS..31 * DAY_MS).contains(&shifted),
        "the arbiter's wall clock did not move ({shifted} ms): libfaketime is not in effect"
    );
    std::thread::sleep(Duration::from_secs(1));
    let ids: Vec<_> = c.list().unwrap().into_iter().map(|l| l.id).collect();
    assert!(
        ids.contains(&pending.id),
        "a reservation made 1 s ago was released as never confirmed after a forward jump"
    );

    // Back two days: an abandoned reservation still expires on time.
    jump(&offset, "-2d");
    wait_until(
        "the unconfirmed reservation to be taken back after 3 s of real time",
        Duration::from_secs(10),
        || !c.list().unwrap().into_iter().any(|l| l.id == pending.id),
    );
    // The confirmed lease, its ledger and its token carry on as before.
    let leases = c.list().unwrap();
    let live = leases.iter().find(|l| l.id == confirmed.id).unwrap();
    assert_eq!(live.state, LeaseState::Confirmed);
    assert!(ledger.charge(1 << 20).unwrap().granted);
    let quota = ledger.query().unwrap();
    assert_eq!(quota.memory_used, 2 << 20);
    holder.send(TokenRequest::Want).unwrap();
    let start = std::time::Instant::now();
    while holder
        .page()
        .deadline_ns
        .load(std::sync::atomic::Ordering::Acquire)
        == gpushare_proto::token::NOT_HELD
    {
        assert!(
            start.elapsed() < T,
            "the token was not granted after the jumps"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A restart reads the leases back whatever their recorded wall-clock times.
    jump(&offset, "+0");
    let mut d = d;
    d.kill();
    d.restart();
    let after = d.client().list().unwrap();
    assert!(after.iter().any(|l| l.id == confirmed.id), "{after:?}");
}
