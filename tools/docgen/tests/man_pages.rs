//! The pages gpushare-docgen writes, read as an operator reads them: `man -l` (man-db)
//! at 80 columns. Each command page has a one-line NAME and the sections FILES,
//! ENVIRONMENT, SIGNALS, EXIT STATUS, EXAMPLES and SEE ALSO; gpushare.toml(5) lists
//! every key of the typed configuration.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpushare_config::{Config, RuntimeProfile};

use gpushare_docgen::page::SECTIONS;

/// Runs gpushare-docgen into a temporary directory; the pages it wrote.
fn written_pages() -> (tempfile::TempDir, Vec<PathBuf>) {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_gpushare-docgen"))
        .arg("--man-dir")
        .arg(out.path().join("man"))
        .arg("--completions-dir")
        .arg(out.path().join("completions"))
        .status()
        .unwrap();
    assert!(status.success());
    let mut pages: Vec<PathBuf> = std::fs::read_dir(out.path().join("man"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    pages.sort();
    (out, pages)
}

/// The page as `man -l` shows it at 80 columns: plain text, no hyphenation (a key
/// broken across lines would not be found).
fn man(page: &Path) -> String {
    let output = Command::new("man")
        .args(["-l", "--no-hyphenation", "--no-justification"])
        .arg(page)
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .env_remove("MAN_KEEP_FORMATTING")
        .output()
        .unwrap_or_else(|e| {
            panic!("man cannot be run ({e}): install the man-db package (apt-get install man-db)")
        });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.trim().is_empty(),
        "man -l {}: {stderr}",
        page.display()
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The section headings (lines that start in column 0, other than the header and
/// footer lines), each with its lines.
fn sections(text: &str) -> Vec<(String, Vec<String>)> {
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    // The first line is the header, the last non-empty one the footer.
    let last = lines
        .iter()
        .rposition(|l| !l.trim().is_empty())
        .unwrap_or(0);
    for line in &lines[1..last] {
        if !line.is_empty() && !line.starts_with(' ') {
            sections.push((line.to_string(), Vec::new()));
        } else if let Some((_, body)) = sections.last_mut() {
            if !line.trim().is_empty() {
                body.push(line.trim().to_owned());
            }
        }
    }
    sections
}

#[test]
fn every_command_page_has_a_one_line_name_and_the_operators_sections() {
    let (_dir, pages) = written_pages();
    let commands: Vec<&PathBuf> = pages
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "1"))
        .collect();
    assert!(commands.len() >= 20, "{commands:?}");
    for page in commands {
        let text = man(page);
        let sections = sections(&text);
        let headings: Vec<&str> = sections.iter().map(|(h, _)| h.as_str()).collect();
        let name = page.file_stem().unwrap().to_string_lossy();
        let (_, name_lines) = sections
            .iter()
            .find(|(heading, _)| heading == "NAME")
            .unwrap_or_else(|| panic!("{name}: no NAME in {headings:?}"));
        assert_eq!(name_lines.len(), 1, "{name}: NAME is {name_lines:?}");
        assert!(
            name_lines[0].starts_with(&format!("{name} - ")),
            "{name}: {name_lines:?}"
        );
        for wanted in ["SYNOPSIS", "DESCRIPTION"].iter().chain(&SECTIONS) {
            assert!(
                headings.contains(wanted),
                "{name}: no {wanted} in {headings:?}\n{text}"
            );
        }
        for (heading, body) in &sections {
            assert!(!body.is_empty(), "{name}: {heading} is empty\n{text}");
        }
        let see_also = &sections.iter().find(|(h, _)| h == "SEE ALSO").unwrap().1;
        assert!(
            see_also.join(" ").contains("gpushare.toml(5)"),
            "{name}: {see_also:?}"
        );
    }
}

/// Every key the configuration has: each setting of the default configuration, and
/// those unset by default, set here. A key added to the configuration as an option
/// must be added here, or the page's list and this one differ.
fn every_key() -> Vec<String> {
    let mut config = Config::default();
    config.arbiter.control_socket = Some("/run/x.sock".into());
    config.arbiter.metrics_address = Some("127.0.0.1:9447".into());
    config.requests.high_priority_tenants = Some(vec!["a".into()]);
    config.requests.env_memory_ceiling = Some("1Gi".parse().unwrap());
    config
        .runtime
        .profiles
        .insert("p".into(), RuntimeProfile::default());
    let mut keys: Vec<String> = gpushare_config::keys::settings(&config)
        .into_keys()
        .collect();
    // The keys inside a table of a list or of a named table.
    for inner in [
        "arbiter.devices[].uuid",
        "arbiter.devices[].name",
        "arbiter.devices[].memory",
        "arbiter.reservations[].tenant",
        "arbiter.reservations[].gpus",
        "runtime.profiles.NAME.priority",
        "runtime.profiles.NAME.memory",
        "runtime.profiles.NAME.tenant",
        "runtime.profiles.NAME.compute_request",
    ] {
        keys.push(inner.to_owned());
    }
    keys.sort();
    keys
}

#[test]
fn the_configuration_page_lists_every_key_of_the_typed_configuration() {
    let (_dir, pages) = written_pages();
    let page = pages
        .iter()
        .find(|p| p.file_name().is_some_and(|n| n == "gpushare.toml.5"))
        .expect("gpushare.toml.5 written");
    let text = man(page);
    let sections = sections(&text);
    let headings: Vec<&str> = sections.iter().map(|(h, _)| h.as_str()).collect();
    for wanted in [
        "NAME",
        "DESCRIPTION",
        "FILES",
        "ENVIRONMENT",
        "SIGNALS",
        "EXAMPLES",
        "SEE ALSO",
    ] {
        assert!(headings.contains(&wanted), "no {wanted} in {headings:?}");
    }
    let name = &sections.iter().find(|(h, _)| h == "NAME").unwrap().1;
    assert_eq!(name.len(), 1, "{name:?}");
    // A key's entry, under its table's heading ([arbiter]), is its name alone on a
    // line, then its type and default.
    let mut listed: Vec<String> = sections
        .iter()
        .filter(|(heading, _)| heading.starts_with('['))
        .flat_map(|(_, lines)| lines.windows(2))
        .filter(|pair| pair[1].contains("default") || pair[1].contains("required in its table"))
        .map(|pair| pair[0].clone())
        .filter(|line| !line.contains(' ') && line.contains('.'))
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        every_key(),
        "the page's keys (left) and the configuration's"
    );
    let sigh = "Needs a restart of gpushare-arbiter";
    assert!(text.contains(sigh) && text.contains("A reload applies it"));
}
