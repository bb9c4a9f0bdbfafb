//! A token client's `CLOCK_MONOTONIC`, seen from the arbiter's.
//!
//! The page's instants (`deadline_ns`, `fit_by_ns`) are compared by the client with
//! its own `CLOCK_MONOTONIC`. A time namespace (`CLONE_NEWTIME`, Linux 5.6) shifts
//! exactly that clock by a per-namespace offset, and any process may create one
//! inside a user namespace of its own wherever unprivileged user namespaces are
//! allowed; a low-priority job whose clock runs ten minutes behind would read every
//! window as ten minutes long. The kernel freezes a namespace's offsets once a
//! process has entered it, so the arbiter reads a connection's offset once, when the
//! client connects (from `/proc/<pid>/timens_offsets`), and writes every instant onto
//! that client's page in the client's own clock. What the client does with its
//! clock afterwards is caught by what the arbiter measures itself: a revoked holder
//! still working past its window is an overrun (`timeslice`).

use std::io;
use std::path::Path;

use gpushare_proto::token::{FIT_UNBOUNDED, HELD_UNTIL_RELEASED, NOT_HELD};

/// How far a client's `CLOCK_MONOTONIC` is ahead of the arbiter's, in nanoseconds
/// (negative: behind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClockOffset(pub i64);

impl ClockOffset {
    /// `instant` on the arbiter's clock, as the client's clock shows it. The
    /// sentinels (not held, held until released, unbounded) mean the same on any
    /// clock and pass unchanged; an instant never becomes one of them.
    pub fn to_client(self, instant: u64) -> u64 {
        if self.0 == 0 || matches!(instant, NOT_HELD | HELD_UNTIL_RELEASED) {
            return instant;
        }
        debug_assert_eq!(FIT_UNBOUNDED, HELD_UNTIL_RELEASED);
        let shifted = i128::from(instant) + i128::from(self.0);
        shifted.clamp(1, i128::from(u64::MAX - 1)) as u64
    }
}

/// The monotonic offset in a `timens_offsets` file ("monotonic <s> <ns>" and
/// "boottime <s> <ns>" lines, the kernel's normalised timespec: seconds may be
/// negative, nanoseconds are within a second), or None when it has no such line.
pub fn parse_monotonic_offset(text: &str) -> Option<i64> {
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        if fields.next()? != "monotonic" {
            return None;
        }
        let seconds: i64 = fields.next()?.parse().ok()?;
        let nanos: i64 = fields.next()?.parse().ok()?;
        seconds.checked_mul(1_000_000_000)?.checked_add(nanos)
    })
}

/// The offset of process `pid`'s clock from this process's: zero when both are in
/// the same time namespace (or the kernel has none). An error when they differ and
/// either offset cannot be read: the connection is then refused, as its instants
/// could not be written in its clock.
pub fn offset_of(pid: u32) -> io::Result<ClockOffset> {
    offset_between(
        Path::new("/proc/self"),
        &Path::new("/proc").join(pid.to_string()),
    )
}

fn offset_between(own: &Path, peer: &Path) -> io::Result<ClockOffset> {
    use std::os::unix::fs::MetadataExt;
    let namespace = |proc: &Path| std::fs::metadata(proc.join("ns/time"));
    match (namespace(own), namespace(peer)) {
        (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()) => return Ok(ClockOffset(0)),
        // A kernel without time namespaces: one clock for all.
        (Err(e), _) if e.kind() == io::ErrorKind::NotFound => return Ok(ClockOffset(0)),
        (_, Err(e)) => return Err(e),
        _ => {}
    }
    let read = |proc: &Path| -> io::Result<i64> {
        let file = proc.join("timens_offsets");
        let text = std::fs::read_to_string(&file)?;
        parse_monotonic_offset(&text).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: no monotonic offset in {text:?}", file.display()),
            )
        })
    };
    Ok(ClockOffset(read(peer)?.saturating_sub(read(own)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_parse_as_the_kernel_prints_them() {
        let table: &[(&str, Option<i64>)] = &[
            ("monotonic           0         0\nboottime  0 0\n", Some(0)),
            (
                "monotonic        -600         0\nboottime 0 0\n",
                Some(-600_000_000_000),
            ),
            // -0.5 s, normalised: -1 s + 0.5 s.
            ("monotonic -1 500000000\n", Some(-500_000_000)),
            (
                "boottime 5 0\nmonotonic 86400 1\n",
                Some(86_400_000_000_001),
            ),
            ("boottime 5 0\n", None),
            ("monotonic lots 0\n", None),
            ("monotonic 9223372036854775807 0\n", None),
            ("", None),
        ];
        for &(text, want) in table {
            assert_eq!(parse_monotonic_offset(text), want, "{text:?}");
        }
    }

    #[test]
    fn instants_move_into_the_clients_clock_and_sentinels_stay() {
        let behind = ClockOffset(-600_000_000_000);
        let table: &[(ClockOffset, u64, u64)] = &[
            (ClockOffset(0), 5, 5),
            (behind, 700_000_000_000, 100_000_000_000),
            (ClockOffset(1_000), 700, 1_700),
            (behind, NOT_HELD, NOT_HELD),
            (behind, HELD_UNTIL_RELEASED, HELD_UNTIL_RELEASED),
            (ClockOffset(7), FIT_UNBOUNDED, FIT_UNBOUNDED),
            // Never a sentinel by accident: an instant stays an instant.
            (behind, 5, 1),
            (ClockOffset(i64::MAX), u64::MAX - 5, u64::MAX - 1),
        ];
        for &(offset, instant, want) in table {
            assert_eq!(offset.to_client(instant), want, "{offset:?} {instant}");
        }
    }

    #[test]
    fn the_same_namespace_needs_no_offset() {
        let me = Path::new("/proc/self");
        assert_eq!(offset_between(me, me).unwrap(), ClockOffset(0));
        assert!(offset_between(me, Path::new("/proc/no-such-process")).is_err());
    }
}
