//! Every built gpushare binary answers `--help` and `--version` with gpushare's
//! version, without reading stdin (the hook's and the shim's stdin is their input),
//! and gpushare-docgen writes a man page and completions that parse.
//!
//! The binaries are found as every suite finds them (`GPUSHARE_BIN_DIR`, else this
//! build's profile directory): `make build` first.

use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_testkit::binaries;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const BINARIES: &[&str] = &binaries::SHIPPED_PROGRAMS;
/// The binaries whose command line is clap's: man page and completions.
const CLAP_BINARIES: &[&str] = &[
    "gpushare-arbiter",
    "gpusharectl",
    "gpushare-hook",
    "gpushare-kube",
];
/// Described for a man page only: their command line is runc's, or Go-style.
const MAN_ONLY: &[&str] = &["gpushare-runc", "containerd-shim-gpushare-v2"];

struct Answer {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs `program arg` with a stdin that stays open and empty: a program that
/// reads it hangs, and fails here after 30 s instead of hanging the suite.
fn ask(program: &Path, arg: &str) -> Answer {
    let capture = || tempfile::tempfile().expect("a temporary file");
    let (mut out, mut err) = (capture(), capture());
    let mut child = Command::new(program)
        .arg(arg)
        .stdin(Stdio::piped())
        .stdout(out.try_clone().unwrap())
        .stderr(err.try_clone().unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    let _stdin_held_open = child.stdin.take();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!(
                "{} {arg} did not exit within 30 s (reading stdin?)",
                program.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |file: &mut File| {
        let mut text = String::new();
        file.rewind().unwrap();
        file.read_to_string(&mut text).unwrap();
        text
    };
    Answer {
        success: status.success(),
        stdout: read(&mut out),
        stderr: read(&mut err),
    }
}

fn every_binary() -> Vec<(String, PathBuf)> {
    binaries::require(BINARIES);
    let mut all: Vec<(String, PathBuf)> = BINARIES
        .iter()
        .map(|name| (name.to_string(), binaries::program(name)))
        .collect();
    all.push((
        "gpushare-docgen".into(),
        PathBuf::from(env!("CARGO_BIN_EXE_gpushare-docgen")),
    ));
    all
}

#[test]
fn every_binary_answers_help_and_version_with_gpushare_version() {
    for (name, path) in every_binary() {
        for arg in ["--help", "--version"] {
            let answer = ask(&path, arg);
            assert!(
                answer.success,
                "{name} {arg} failed: {}{}",
                answer.stdout, answer.stderr
            );
            // clap's `<name> <version>` line; the shim's -v keeps containerd's layout.
            let line = if name.starts_with("containerd-shim") && arg == "--version" {
                format!("{name}:\n  Version:  {VERSION}\n")
            } else {
                format!("{name} {VERSION}")
            };
            assert!(
                answer.stdout.contains(&line),
                "{name} {arg} does not say {line:?}:\n{}",
                answer.stdout
            );
        }
    }
}

#[test]
fn the_runc_wrapper_shows_its_own_version_then_runcs() {
    let wrapper = binaries::program("gpushare-runc");
    binaries::require(&["gpushare-runc"]);
    let runc = Command::new("runc")
        .arg("--version")
        .output()
        .expect("runc is installed");
    let runc = String::from_utf8_lossy(&runc.stdout).into_owned();
    assert!(runc.starts_with("runc version"), "{runc}");
    let answer = ask(&wrapper, "--version");
    assert!(answer.success, "{}", answer.stderr);
    // docker info reads the runtime's version and commit from these lines.
    assert_eq!(answer.stdout, format!("gpushare-runc {VERSION}\n{runc}"));
    let help = ask(&wrapper, "--help");
    assert!(help.success, "{}", help.stderr);
    let runc_help = Command::new("runc").arg("--help").output().unwrap();
    let runc_help = String::from_utf8_lossy(&runc_help.stdout).into_owned();
    let ours = help
        .stdout
        .strip_suffix(&runc_help)
        .unwrap_or_else(|| panic!("runc's own help comes last:\n{}", help.stdout));
    assert!(
        ours.starts_with(&format!("gpushare-runc {VERSION}\n")),
        "{ours}"
    );
    assert!(ours.contains("--gpushare-config"), "{ours}");
}

#[test]
fn docgen_writes_man_pages_and_completions_that_parse() {
    let out = tempfile::tempdir().unwrap();
    let (man, completions) = (out.path().join("man"), out.path().join("completions"));
    let status = Command::new(env!("CARGO_BIN_EXE_gpushare-docgen"))
        .arg("--man-dir")
        .arg(&man)
        .arg("--completions-dir")
        .arg(&completions)
        .status()
        .unwrap();
    assert!(status.success());
    let pages: Vec<PathBuf> = std::fs::read_dir(&man)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    for name in CLAP_BINARIES.iter().chain(MAN_ONLY) {
        assert!(man.join(format!("{name}.1")).exists(), "{name}.1");
    }
    assert!(
        man.join("gpushare.toml.5").exists(),
        "the configuration's page"
    );
    // Every page, subcommands' and the configuration's too, renders without a warning.
    for page in &pages {
        let name = page.file_stem().unwrap().to_string_lossy();
        let name = name.split('-').next().unwrap_or_default();
        let rendered = Command::new("groff")
            // Plain text, not overstruck bold and underlines, to search in; -k: the
            // input's encoding from its coding line, as man runs preconv.
            .args(["-k", "-man", "-Tutf8", "-P-cbou", "-ww"])
            .arg(page)
            .output()
            .expect("groff is installed");
        let text = String::from_utf8_lossy(&rendered.stdout);
        assert!(
            rendered.status.success() && rendered.stderr.is_empty(),
            "{}: {}",
            page.display(),
            String::from_utf8_lossy(&rendered.stderr)
        );
        assert!(
            text.contains("NAME") && text.contains(name),
            "{}:\n{text}",
            page.display()
        );
    }
    assert!(
        man.join("gpusharectl-list.1").exists(),
        "subcommands' pages"
    );
    for name in CLAP_BINARIES {
        for file in [
            format!("{name}.bash"),
            format!("_{name}"),
            format!("{name}.fish"),
        ] {
            let path = completions.join(&file);
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(text.contains(name), "{}", path.display());
        }
        let bash = Command::new("bash")
            .arg("-n")
            .arg(completions.join(format!("{name}.bash")))
            .output()
            .unwrap();
        assert!(
            bash.status.success(),
            "{name}.bash: {}",
            String::from_utf8_lossy(&bash.stderr)
        );
    }
    for name in MAN_ONLY {
        assert!(
            !completions.join(format!("{name}.bash")).exists(),
            "{name}'s command line is not clap's: no completions"
        );
    }
}
