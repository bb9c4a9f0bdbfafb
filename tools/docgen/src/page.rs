//! A command's man page: clap_mangen renders the title, SYNOPSIS, DESCRIPTION,
//! OPTIONS and COMMANDS from the clap definition; this module adds a one-line NAME,
//! NOTES (the after-help text) and the sections of its [`Manual`].

use std::io::Write;

use clap_mangen::roff::{bold, roman, Roff};
use clap_mangen::Man;

use crate::manual::{self, Example, Manual, Section};

/// The section headings every command page has after OPTIONS, in order.
pub const SECTIONS: [&str; 6] = [
    "FILES",
    "ENVIRONMENT",
    "SIGNALS",
    "EXIT STATUS",
    "EXAMPLES",
    "SEE ALSO",
];

/// The page of `command` (built, so a subcommand's display name is
/// `gpusharectl-setup`), which `path` runs (`["gpusharectl", "setup"]`).
pub fn command_page(command: &clap::Command, manual: &Manual, path: &[&str]) -> Vec<u8> {
    let man = Man::new(command.clone());
    let name = man.get_filename();
    let name = name.strip_suffix(".1").unwrap_or(&name);
    let mut page = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = man.render_title(&mut page);
    let mut roff = Roff::new();
    name_section(&mut roff, name, command.get_about().map(|a| a.to_string()));
    page.extend(roff.render().bytes());
    let _ = man.render_synopsis_section(&mut page);
    let _ = man.render_description_section(&mut page);
    if command
        .get_arguments()
        .any(|arg| !arg.is_hide_set() && arg.get_id() != "help" && arg.get_id() != "version")
    {
        let _ = man.render_options_section(&mut page);
    }
    if command.get_subcommands().any(|c| !c.is_hide_set()) {
        let _ = man.render_subcommands_section(&mut page);
    }
    let mut roff = Roff::new();
    if let Some(notes) = command.get_after_long_help().or(command.get_after_help()) {
        roff.control("SH", ["NOTES"]);
        paragraphs(&mut roff, &notes.to_string());
    }
    section(&mut roff, "FILES", &manual.files);
    section(&mut roff, "ENVIRONMENT", &manual.environment);
    section(&mut roff, "SIGNALS", &manual.signals);
    section(&mut roff, "EXIT STATUS", &manual.exit_status);
    roff.control("SH", ["EXAMPLES"]);
    let examples = manual::examples_running(manual, path);
    if examples.is_empty() {
        roff.text([roman(format!("{name} has no examples of its own."))]);
    }
    for example in examples {
        example_lines(&mut roff, example);
    }
    let program = path.first().copied().unwrap_or(name);
    let mut see_also: Vec<String> = Vec::new();
    if path.len() > 1 {
        see_also.push(format!("{}(1)", path[..path.len() - 1].join("-")));
    }
    see_also.extend(
        manual
            .see_also
            .iter()
            .filter(|page| !page.starts_with(&format!("{program}(")))
            .map(|page| page.to_string()),
    );
    see_also_section(&mut roff, &see_also);
    page.extend(roff.render().bytes());
    if command
        .get_version()
        .or(command.get_long_version())
        .is_some()
    {
        let _ = man.render_version_section(&mut page);
    }
    page
}

/// NAME: the page's name and the one-line summary, which whatis(1) and apropos(1) index.
pub fn name_section(roff: &mut Roff, name: &str, summary: Option<String>) {
    roff.control("SH", ["NAME"]);
    let line = match summary {
        // roff writes the dash as `\-`, the separator mandb looks for.
        Some(summary) => format!("{name} - {summary}"),
        None => name.to_owned(),
    };
    roff.text([roman(line)]);
}

/// Text whose blank lines separate paragraphs.
pub fn paragraphs(roff: &mut Roff, text: &str) {
    for (i, paragraph) in text.split("\n\n").enumerate() {
        if i > 0 {
            roff.control("PP", []);
        }
        roff.text([roman(
            paragraph.split_whitespace().collect::<Vec<_>>().join(" "),
        )]);
    }
}

pub fn section(roff: &mut Roff, title: &str, content: &Section) {
    roff.control("SH", [title]);
    match content {
        Section::Nothing(sentence) => {
            roff.text([roman(*sentence)]);
        }
        Section::Entries(entries) => {
            for entry in *entries {
                roff.control("TP", []);
                roff.text([bold(entry.term)]);
                roff.text([roman(entry.text)]);
            }
        }
    }
}

pub fn example_lines(roff: &mut Roff, example: &Example) {
    roff.control("PP", []);
    roff.text([roman(example.text)]);
    roff.control("RS", ["4"]);
    roff.control("nf", []);
    roff.text([bold(example.command)]);
    roff.control("fi", []);
    roff.control("RE", []);
}

/// SEE ALSO: each page as `name(section)`, the name in bold.
pub fn see_also_section(roff: &mut Roff, pages: &[String]) {
    roff.control("SH", ["SEE ALSO"]);
    let mut line = Vec::new();
    for (i, page) in pages.iter().enumerate() {
        let (name, section) = page.split_once('(').unwrap_or((page, ""));
        line.push(bold(name));
        let separator = if i + 1 < pages.len() { ", " } else { "" };
        line.push(roman(format!("({section}{separator}")));
    }
    roff.text(line);
}

/// The first line of every page: the text is UTF-8 (an ellipsis, µs), which man's
/// preconv then reads as such whatever the reader's locale.
const CODING: &str = ".\\\" -*- coding: UTF-8 -*-\n";

/// Writes `page` to `dir/file`.
pub fn write_page(dir: &std::path::Path, file: &str, page: &[u8]) -> std::io::Result<()> {
    let mut out = std::fs::File::create(dir.join(file))?;
    out.write_all(CODING.as_bytes())?;
    out.write_all(page)?;
    out.flush()
}
