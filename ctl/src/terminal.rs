//! Names shown on a terminal. A container's name is whatever its creator wrote (a
//! CRI pod annotation, a docker or podman name): printed raw, an ESC or CSI
//! sequence would move the cursor, rewrite the screen or retitle the window, and a
//! newline would forge a row of `list`, `status` or `top` of its own. JSON output
//! needs none of this: serde escapes control characters there.

/// The most characters of a name a row shows; a longer one is cut and ends in '…'.
pub const SHOWN_NAME_MAX: usize = 96;

/// Characters a terminal acts on or that reorder what follows: the C0 and C1
/// controls (ESC, CSI U+009B, newline, carriage return, bell, DEL) and the
/// bidirectional overrides and isolates, which can make a name read as another.
fn acts_on_a_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Pure: `name` made inert for a terminal. Each character a terminal would act on
/// is written as its Rust escape (`\u{1b}`, `\n`), so the name stays recognisable
/// and nothing is silently dropped; a name longer than [`SHOWN_NAME_MAX`] characters
/// is cut.
pub fn shown_name(name: &str) -> String {
    inert(name, SHOWN_NAME_MAX)
}

/// Pure: `text` made inert for a terminal as [`shown_name`] makes a name, but whole: an
/// explanation (why no GPU is shared, why the store fails) is cut by nobody.
pub fn shown_text(text: &str) -> String {
    inert(text, usize::MAX)
}

/// `text` with each character a terminal would act on escaped, cut after `max` characters.
fn inert(name: &str, max: usize) -> String {
    let mut out = String::with_capacity(name.len().min(SHOWN_NAME_MAX * 4));
    let mut count = 0;
    for c in name.chars() {
        let piece: String = if acts_on_a_terminal(c) {
            c.escape_default().collect()
        } else {
            c.to_string()
        };
        let width = piece.chars().count();
        if count + width > max {
            out.push('…');
            return out;
        }
        out.push_str(&piece);
        count += width;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_shown_inert_and_bounded() {
        let long = "a".repeat(SHOWN_NAME_MAX + 1);
        let cut = format!("{}…", "a".repeat(SHOWN_NAME_MAX));
        let exact = "b".repeat(SHOWN_NAME_MAX);
        let escape_at_the_end = format!("{}\x1b", "c".repeat(SHOWN_NAME_MAX - 2));
        let escape_cut = format!("{}…", "c".repeat(SHOWN_NAME_MAX - 2));
        for (name, want) in [
            ("team-a/trainer/main", "team-a/trainer/main"),
            ("my trainer", "my trainer"),
            ("tränér-名前", "tränér-名前"),
            ("", ""),
            ("a\x1b[2Jb", "a\\u{1b}[2Jb"),
            ("t\x1b]0;owned\x07", "t\\u{1b}]0;owned\\u{7}"),
            ("csi\u{9b}31m", "csi\\u{9b}31m"),
            ("two\nlines", "two\\nlines"),
            ("back\rover", "back\\rover"),
            ("tab\there", "tab\\there"),
            ("del\x7f", "del\\u{7f}"),
            ("nul\0", "nul\\u{0}"),
            ("gpu\u{202e}1-dog", "gpu\\u{202e}1-dog"),
            ("iso\u{2066}x\u{2069}", "iso\\u{2066}x\\u{2069}"),
            ("back\\slash", "back\\slash"),
            (long.as_str(), cut.as_str()),
            (exact.as_str(), exact.as_str()),
            (escape_at_the_end.as_str(), escape_cut.as_str()),
        ] {
            let shown = shown_name(name);
            assert_eq!(shown, want, "{name:?}");
            assert!(!shown.chars().any(acts_on_a_terminal), "{name:?}");
            assert!(shown.chars().count() <= SHOWN_NAME_MAX + 1, "{name:?}");
        }
        let reason = format!("{} \x1b[2J", "r".repeat(3 * SHOWN_NAME_MAX));
        assert_eq!(
            shown_text(&reason),
            format!("{} \\u{{1b}}[2J", "r".repeat(3 * SHOWN_NAME_MAX))
        );
    }
}
