//! Polling for something another process does.

use std::time::{Duration, Instant};

/// How often [`wait_until`] looks again: short next to every timeout the suites use, long
/// enough not to steal a 2-core machine's CPU from the processes being waited for.
const POLL: Duration = Duration::from_millis(20);

/// Polls `done` until it holds; fails the test, naming `what`, after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(POLL);
    }
}
