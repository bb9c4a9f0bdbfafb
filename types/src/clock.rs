//! The token clock: every deadline on a token page, every grant and every launch
//! timestamp is CLOCK_MONOTONIC nanoseconds. It is the one clock the arbiter, the
//! interposer in each container and the simulated driver share: it does not jump with
//! wall-clock changes, and PID namespaces do not change it (containers share the host's
//! boot clock unless a time namespace is set up, which no supported runtime does).

/// CLOCK_MONOTONIC in nanoseconds. Read through the vDSO: no system call, so the
/// interposer's launch path may call it.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is handed, which lives on this
    // stack frame; CLOCK_MONOTONIC exists on every Linux kernel, so it cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_back_and_counts_nanoseconds() {
        let before = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after = monotonic_ns();
        assert!(after - before >= 2_000_000, "{before} -> {after}");
    }
}
