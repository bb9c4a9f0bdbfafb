//! The simulated device's timeline, one for every process on the machine.
//!
//! A real GPU keeps its own time (`%globaltimer`, the instants of its events): no process can
//! move it. The model keeps its time on `CLOCK_MONOTONIC` in its shared state, and that clock
//! is the one a time namespace (`CLONE_NEWTIME`, Linux 5.6) shifts: a process started under
//! `unshare --time --monotonic=-600` reads it ten minutes behind everybody else. Were the model
//! to take that reading as "now", such a process would stamp its work ten minutes in the past
//! and wait ten minutes for work the device finished long ago. So the device's time is the
//! clock of the initial time namespace: each process reads its namespace's monotonic offset
//! once (the kernel freezes a namespace's offsets once a process has entered it) and takes it
//! off every reading; an instant handed back to the process (an absolute sleep, an event's
//! timestamp) gets it back.

use std::sync::OnceLock;

const NS_PER_S: i64 = 1_000_000_000;

/// Nanoseconds on the device's timeline: the `CLOCK_MONOTONIC` of the initial time namespace,
/// the same in every process and every PID or time namespace.
pub fn now_ns() -> u64 {
    device_from_local(local_monotonic_ns(), own_monotonic_offset_ns())
}

/// Device instant `device_ns` as this process's own `CLOCK_MONOTONIC` shows it (for an
/// absolute `clock_nanosleep`, or a timestamp the program compares with its own clock).
pub fn to_local_ns(device_ns: u64) -> u64 {
    local_from_device(device_ns, own_monotonic_offset_ns())
}

/// How far this process's `CLOCK_MONOTONIC` is ahead of the device's, in ns (negative: behind).
pub fn own_monotonic_offset_ns() -> i64 {
    static OFFSET: OnceLock<i64> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let file = "/proc/self/timens_offsets";
        match std::fs::read_to_string(file) {
            Ok(text) => monotonic_offset_ns(&text).unwrap_or_else(|| {
                panic!("{file} has no readable \"monotonic <s> <ns>\" line: {text:?}")
            }),
            // A kernel without time namespaces: every process reads the device's clock.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => panic!("reading {file}: {e}"),
        }
    })
}

/// The `monotonic` offset of a `timens_offsets` text, in ns: its line is
/// `monotonic <seconds> <nanoseconds>` (seconds may be negative, nanoseconds are in 0..1e9).
pub fn monotonic_offset_ns(text: &str) -> Option<i64> {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| l.split_whitespace().next() == Some("monotonic"))?;
    let values: Vec<i64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    match values[..] {
        [seconds, nanos] if (0..NS_PER_S).contains(&nanos) => {
            seconds.checked_mul(NS_PER_S)?.checked_add(nanos)
        }
        _ => None,
    }
}

fn local_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we hand it.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * NS_PER_S as u64 + ts.tv_nsec as u64
}

/// A local reading on the device's timeline (never below zero: the initial namespace's
/// monotonic clock is never negative).
fn device_from_local(local_ns: u64, offset_ns: i64) -> u64 {
    (i128::from(local_ns) - i128::from(offset_ns)).clamp(0, i128::from(u64::MAX)) as u64
}

fn local_from_device(device_ns: u64, offset_ns: i64) -> u64 {
    (i128::from(device_ns) + i128::from(offset_ns)).clamp(0, i128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_line_gives_the_offset() {
        let cases: &[(&str, Option<i64>)] = &[
            ("monotonic 0 0\nboottime 0 0\n", Some(0)),
            (
                "monotonic        -600         0\nboottime 0 0\n",
                Some(-600 * NS_PER_S),
            ),
            // The kernel normalises: -1.5 s is -2 s + 0.5 s.
            (
                "boottime 7 0\nmonotonic -2 500000000\n",
                Some(-1_500_000_000),
            ),
            ("monotonic 3600 1\n", Some(3600 * NS_PER_S + 1)),
            ("boottime 5 0\n", None),
            ("monotonic 5\n", None),
            ("monotonic 5 0 0\n", None),
            ("monotonic x 0\n", None),
            ("monotonic 1 1000000000\n", None),
            ("monotonic 9223372037 0\n", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(monotonic_offset_ns(text), *want, "{text:?}");
        }
    }

    #[test]
    fn local_and_device_instants_convert_both_ways() {
        let behind = -600 * NS_PER_S;
        let host = 10_000 * NS_PER_S as u64;
        let local = host - 600 * NS_PER_S as u64;
        assert_eq!(device_from_local(local, behind), host);
        assert_eq!(local_from_device(host, behind), local);
        assert_eq!(device_from_local(host, 0), host);
        // Instants the other side cannot show stay at the ends of the range.
        assert_eq!(device_from_local(5, 10), 0);
        assert_eq!(local_from_device(5, -10), 0);
        assert_eq!(local_from_device(u64::MAX - 1, 10), u64::MAX);
    }

    #[test]
    fn this_process_reads_its_offset_and_the_device_clock_advances() {
        let offset = own_monotonic_offset_ns();
        let a = now_ns();
        let b = now_ns();
        assert!(b >= a);
        assert_eq!(device_from_local(to_local_ns(a), offset), a);
    }
}
