//! `check-config` (`gpushare-arbiter check-config`, `gpusharectl check-config`):
//! reads a file exactly as every component does ([`Config::parse`]) and says so,
//! or lists every problem, one a line, as `FILE:LINE: key = value: what is wrong;
//! the fix`, before the file is saved where the components read it. A file that reads
//! well is also checked against this machine: the library, hook and runtime it names
//! (or their defaults) must be there ([`crate::installation`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::installation::{self, ThisMachine};
use crate::{keys, problems, Config, ConfigError, Problem, DEFAULT_PATH, PATH_ENV};

/// The file reads as a configuration.
pub const EXIT_OK: u8 = 0;
/// The file has problems: the components would refuse it.
pub const EXIT_INVALID: u8 = 1;
/// The file cannot be read at all.
pub const EXIT_UNREADABLE: u8 = 2;

/// What `check-config` prints, and its exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub text: String,
    pub exit_code: u8,
}

/// Which file the components would read: the one named, else `$GPUSHARE_CONFIG`,
/// else the default path, whose absence means all defaults (`true`).
pub fn target(named: Option<&Path>, env: Option<OsString>) -> (PathBuf, bool) {
    match (named, env) {
        (Some(path), _) => (path.to_owned(), false),
        (None, Some(path)) => (PathBuf::from(path), false),
        (None, None) => (PathBuf::from(DEFAULT_PATH), true),
    }
}

/// Checks the file the components would read (`named`, else as they find it).
/// `check-config [FILE]`, the same in gpushare-arbiter and gpusharectl.
#[derive(clap::Args, Debug)]
pub struct CheckConfig {
    /// The file (default: the one the components read: --config, else
    /// $GPUSHARE_CONFIG, else /etc/gpushare/config.toml).
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
}

impl CheckConfig {
    /// Checks the file (`config`: the binary's --config; see [`check_file`]) and prints
    /// the report on stdout; the exit status is the report's.
    pub fn run(&self, config: Option<&Path>) -> std::process::ExitCode {
        use std::io::Write;
        let report = check_file(self.file.as_deref().or(config));
        // A reader gone (`| head`) changes nothing about the verdict.
        let _ = std::io::stdout().lock().write_all(report.text.as_bytes());
        std::process::ExitCode::from(report.exit_code)
    }
}

pub fn check_file(named: Option<&Path>) -> Report {
    let (path, absent_is_defaults) = target(named, std::env::var_os(PATH_ENV));
    let read = std::fs::read_to_string(&path);
    let config = match &read {
        Ok(text) => Config::parse(text, &path).ok(),
        Err(e) if absent_is_defaults && e.kind() == std::io::ErrorKind::NotFound => {
            Some(Config::default())
        }
        Err(_) => None,
    };
    let report = report(&path, absent_is_defaults, read);
    match config {
        Some(config) => {
            on_this_machine(&path, report, installation::problems(&config, &ThisMachine))
        }
        None => report,
    }
}

/// The report of a file that reads well (`report`), failed where this machine lacks
/// what it names (`missing`).
pub fn on_this_machine(path: &Path, report: Report, missing: Vec<Problem>) -> Report {
    if missing.is_empty() || report.exit_code != EXIT_OK {
        return report;
    }
    let file = path.display();
    // Its warnings stay; its verdict does not.
    let mut text: String = report
        .text
        .lines()
        .filter(|l| l.contains("warning: "))
        .map(|l| format!("{l}\n"))
        .collect();
    for problem in &missing {
        text.push_str(&format!("{file}: {}\n", problem.describe()));
    }
    let count = match missing.len() {
        1 => "1 path".to_owned(),
        n => format!("{n} paths"),
    };
    text.push_str(&format!(
        "{file}: reads as a configuration, but {count} it names (or its defaults name) \
         missing on this machine; with it every container that asks for gpushare fails to \
         start (others run untouched)\n"
    ));
    Report {
        text,
        exit_code: EXIT_INVALID,
    }
}

/// The report on `path`, whose reading gave `read`.
pub fn report(path: &Path, absent_is_defaults: bool, read: std::io::Result<String>) -> Report {
    let file = path.display();
    let text = match read {
        Ok(text) => text,
        Err(e) if absent_is_defaults && e.kind() == std::io::ErrorKind::NotFound => {
            return Report {
                text: format!("{file}: absent; every component uses the defaults\n"),
                exit_code: EXIT_OK,
            }
        }
        Err(e) => {
            return Report {
                text: format!("{file}: cannot read: {e}\n"),
                exit_code: EXIT_UNREADABLE,
            }
        }
    };
    match Config::parse(&text, path) {
        Ok(config) => {
            let set = keys::changed(&Config::default(), &config);
            let summary = match set.len() {
                0 => "every key at its default".to_owned(),
                1 => format!("1 key differs from the defaults: {}", set[0]),
                n if n <= 6 => format!("{n} keys differ from the defaults: {}", set.join(", ")),
                n => format!("{n} keys differ from the defaults"),
            };
            // Accepted, so the verdict stays ok; said before it, so it is seen.
            let mut out = String::new();
            for doubt in problems::doubts(&text) {
                out.push_str(&located(&file, doubt.line));
                out.push_str("warning: ");
                out.push_str(&doubt.describe());
                out.push('\n');
            }
            out.push_str(&format!("{file}: ok ({summary})\n"));
            Report {
                text: out,
                exit_code: EXIT_OK,
            }
        }
        Err(ConfigError::Invalid { problems, .. }) => {
            let mut out = String::new();
            for problem in &problems {
                out.push_str(&located(&file, problem.line));
                out.push_str(&problem.describe());
                out.push('\n');
            }
            let count = match problems.len() {
                1 => "1 problem".to_owned(),
                n => format!("{n} problems"),
            };
            out.push_str(&format!(
                "{file}: {count}; with this file every container that asks for gpushare fails to start \
                 (others run untouched) and the arbiter neither starts nor reloads it\n"
            ));
            Report {
                text: out,
                exit_code: EXIT_INVALID,
            }
        }
        Err(e @ ConfigError::Read { .. }) => Report {
            text: format!("{e}\n"),
            exit_code: EXIT_UNREADABLE,
        },
    }
}

/// `FILE:LINE: `, or `FILE: ` where the line is not known.
fn located(file: &impl std::fmt::Display, line: Option<usize>) -> String {
    match line {
        Some(line) => format!("{file}:{line}: "),
        None => format!("{file}: "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Report {
        report(Path::new("/etc/gs.toml"), false, Ok(text.to_owned()))
    }

    #[test]
    fn a_good_file_naming_what_this_machine_lacks_fails_naming_each_path() {
        let missing = vec![
            Problem::at(
                "runtime.library",
                "/usr/lib/x.so",
                "no such file on this machine",
            ),
            Problem::at("runtime.hook", "/usr/bin/h", "no executable file there"),
        ];
        let good = check("[scheduler]\nslice_ms = 10\n");
        let failed = on_this_machine(Path::new("/etc/gs.toml"), good.clone(), missing.clone());
        assert_eq!(failed.exit_code, EXIT_INVALID);
        assert_eq!(
            failed.text,
            "/etc/gs.toml: runtime.library = /usr/lib/x.so: no such file on this machine\n\
             /etc/gs.toml: runtime.hook = /usr/bin/h: no executable file there\n\
             /etc/gs.toml: reads as a configuration, but 2 paths it names (or its defaults \
             name) missing on this machine; with it every container that asks for gpushare \
             fails to start (others run untouched)\n"
        );
        // Nothing missing: the report stands; a file already refused keeps its own.
        assert_eq!(
            on_this_machine(Path::new("/etc/gs.toml"), good.clone(), vec![]),
            good
        );
        let refused = check("[scheduler]\nslice_ms = -1\n");
        assert_eq!(
            on_this_machine(Path::new("/etc/gs.toml"), refused.clone(), missing),
            refused
        );
    }

    #[test]
    fn a_good_file_is_ok_with_what_it_changes() {
        for (text, expected) in [
            ("", "/etc/gs.toml: ok (every key at its default)\n"),
            (
                "[scheduler]\nslice_ms = 10\n",
                "/etc/gs.toml: ok (1 key differs from the defaults: scheduler.slice_ms)\n",
            ),
            (
                "[scheduler]\nslice_ms = 10\n[arbiter]\nlow_nums_limit = 2\n",
                "/etc/gs.toml: ok (2 keys differ from the defaults: arbiter.low_nums_limit, scheduler.slice_ms)\n",
            ),
            // The shipped example writes out the defaults.
            (
                include_str!("../config.toml"),
                "/etc/gs.toml: ok (every key at its default)\n",
            ),
        ] {
            assert_eq!(
                check(text),
                Report {
                    text: expected.into(),
                    exit_code: EXIT_OK
                },
                "{text}"
            );
        }
    }

    #[test]
    fn a_size_without_its_unit_is_ok_with_a_warning_before_the_verdict() {
        let report = check("[[arbiter.devices]]\nuuid = \"GPU-1\"\nmemory = 16\n");
        assert_eq!(report.exit_code, EXIT_OK);
        assert_eq!(
            report.text,
            "/etc/gs.toml:3: warning: arbiter.devices[0].memory = 16: read as 16 bytes; did you mean \"16Gi\"? \
             a size is a string with its unit (\"512Mi\", \"16Gi\")\n\
             /etc/gs.toml: ok (1 key differs from the defaults: arbiter.devices)\n"
        );
    }

    #[test]
    fn each_problem_is_a_line_naming_file_line_key_value_and_fix() {
        let report =
            check("[runtime]\nlibary = \"/x.so\"\n\n[arbiter]\ndefault_memory = \"4GB\"\n");
        assert_eq!(report.exit_code, EXIT_INVALID);
        let lines: Vec<&str> = report.text.lines().collect();
        assert_eq!(lines.len(), 3, "{}", report.text);
        assert!(
            lines[0].starts_with("/etc/gs.toml:2: runtime.libary = \"/x.so\": unknown key (accepted: runtimes, library,")
                && lines[0].ends_with("; did you mean runtime.library?"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].starts_with("/etc/gs.toml:5: arbiter.default_memory = \"4GB\": invalid memory amount")
                && lines[1].ends_with(
                    "the unit reads two ways: did you mean \"4Gi\" (4294967296 bytes) or \"4G\" (4000000000 bytes)?"
                ),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].starts_with("/etc/gs.toml: 2 problems; "),
            "{}",
            lines[2]
        );
    }

    #[test]
    fn a_syntax_error_names_its_line() {
        let report = check("[runtime]\nlibrary = /x.so\n");
        assert_eq!(report.exit_code, EXIT_INVALID);
        assert!(
            report.text.starts_with("/etc/gs.toml:2: not valid TOML: "),
            "{}",
            report.text
        );
    }

    #[test]
    fn an_unreadable_file_is_exit_2_unless_it_is_the_absent_default() {
        let missing = || Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        let named = report(Path::new("/etc/gs.toml"), false, missing());
        assert_eq!(named.exit_code, EXIT_UNREADABLE);
        assert!(
            named.text.starts_with("/etc/gs.toml: cannot read: "),
            "{}",
            named.text
        );
        let default = report(Path::new(DEFAULT_PATH), true, missing());
        assert_eq!(
            default,
            Report {
                text: format!("{DEFAULT_PATH}: absent; every component uses the defaults\n"),
                exit_code: EXIT_OK,
            }
        );
        let denied = report(
            Path::new(DEFAULT_PATH),
            true,
            Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
        );
        assert_eq!(denied.exit_code, EXIT_UNREADABLE);
    }

    #[test]
    fn the_file_is_the_one_named_then_the_environment_s_then_the_default() {
        let env = Some(OsString::from("/env.toml"));
        for (named, env, expected) in [
            (Some("/named.toml"), env.clone(), ("/named.toml", false)),
            (None, env, ("/env.toml", false)),
            (None, None, (DEFAULT_PATH, true)),
        ] {
            let (path, absent_is_defaults) = target(named.map(Path::new), env);
            assert_eq!((path.to_str().unwrap(), absent_is_defaults), expected);
        }
    }
}
