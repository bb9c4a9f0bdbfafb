//! What every text view (`status`, `list`, `top`, `timeline`) shares: the width an
//! operator's terminal is assumed to have, the one way containers are named, and the
//! units token time and shares are written in. Pure functions.

use gpushare_proto::{Lease, LeaseUsage};

use crate::terminal::shown_name;

/// The widest line a text view writes: a terminal beside another window, or a log
/// viewer, shows this much without wrapping.
pub const WIDTH: usize = 120;

/// The name a person knows the lease's container by, the same in every command: the
/// arbiter's name for it (`LeaseUsage::container`: the pod's, else its engine's), else
/// (an older arbiter, or a list without usage) [`Lease::display_name`]. Made inert
/// for a terminal: the name is whatever the container's creator wrote.
pub fn container_of(lease: &Lease, usage: Option<&LeaseUsage>) -> String {
    let name = usage
        .map(|u| u.container.clone())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| lease.display_name());
    shown_name(&name)
}

/// `text` cut to at most `width` characters, ending in '…' when cut, so that a long
/// name keeps its column and the line its width.
pub fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Every line of `text` at most [`WIDTH`] characters: a longer one is broken at its last
/// space that fits (else cut at the width), its continuation indented four beyond the
/// line's own indent. Explanations (a GPU's unshareable reason, a store error) are as
/// long as they need to be; this keeps them readable.
pub fn wrap(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let (body, newline) = match line.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (line, ""),
        };
        let indent = body.chars().take_while(|c| *c == ' ').count() + 4;
        let mut rest: Vec<char> = body.chars().collect();
        let mut first = true;
        loop {
            let room = if first { WIDTH } else { WIDTH - indent };
            if !first {
                out.extend(std::iter::repeat_n(' ', indent));
            }
            if rest.len() <= room {
                out.extend(rest.iter());
                break;
            }
            // The last space that leaves something on this line; none: a hard cut.
            let at = rest[..=room]
                .iter()
                .rposition(|c| *c == ' ')
                .filter(|&i| rest[..i].iter().any(|c| *c != ' '))
                .unwrap_or(room);
            out.push_str(rest[..at].iter().collect::<String>().trim_end());
            out.push('\n');
            let skip = rest[at..].iter().take_while(|c| **c == ' ').count();
            rest.drain(..at + skip);
            first = false;
            if rest.is_empty() {
                // Only spaces were left: the line ended at the break.
                out.pop();
                break;
            }
        }
        out.push_str(newline);
    }
    out
}

/// "61 %", or "-" when unknown.
pub fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:.0} %", x * 100.0))
}

/// Token time (or any duration of ms) as read at a glance: "1.23 s" below ten seconds
/// (a short job's split must read within 1 %), "12.3 s" below ten minutes, "12.3 min"
/// below ten hours, else "12.3 h".
pub fn duration(ms: u64) -> String {
    let s = ms as f64 / 1000.0;
    if s < 10.0 {
        format!("{s:.2} s")
    } else if s < 600.0 {
        format!("{s:.1} s")
    } else if s < 36_000.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_break_at_a_space_within_the_width_and_keep_their_indent() {
        let word = |n: usize| "w".repeat(n);
        let long_words = format!("  {} {} {}", word(60), word(50), word(30));
        let one_word = format!("{}\n", word(130));
        for (text, want) in [
            ("short\n".to_owned(), "short\n".to_owned()),
            (
                long_words.clone(),
                format!("  {} {}\n      {}", word(60), word(50), word(30)),
            ),
            (
                one_word.clone(),
                format!("{}\n    {}\n", word(120), word(10)),
            ),
            (format!("{} \n", word(120)), format!("{}\n", word(120))),
            ("a\n\nb".to_owned(), "a\n\nb".to_owned()),
        ] {
            let got = wrap(&text);
            assert_eq!(got, want, "{text:?}");
            assert!(got.lines().all(|l| l.chars().count() <= WIDTH), "{got}");
        }
    }

    #[test]
    fn names_keep_their_column() {
        for (text, width, want) in [
            ("trainer", 10, "trainer"),
            ("team-a/trainer/main", 10, "team-a/tr…"),
            ("tränér-名前", 6, "träné…"),
            ("abc", 3, "abc"),
        ] {
            assert_eq!(fit(text, width), want);
        }
    }

    #[test]
    fn durations_read_in_the_unit_that_fits() {
        for (ms, want) in [
            (0, "0.00 s"),
            (1_949, "1.95 s"),
            (9_994, "9.99 s"),
            (12_345, "12.3 s"),
            (599_949, "599.9 s"),
            (600_000, "10.0 min"),
            (36_000_000, "10.0 h"),
        ] {
            assert_eq!(duration(ms), want);
        }
    }
}
