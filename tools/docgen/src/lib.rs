//! gpushare-docgen: man pages (clap_mangen) and bash/zsh/fish completions
//! (clap_complete) for gpushare's binaries, rendered from the command-line
//! definitions the binaries themselves parse with, so the two cannot drift; and
//! gpushare.toml(5), the configuration file's page, from the typed configuration.
//!
//! A command's page adds to clap's sections those of its binary's [`manual::Manual`]
//! (FILES, ENVIRONMENT, SIGNALS, EXIT STATUS, EXAMPLES, SEE ALSO).
//!
//! gpushare-runc and the containerd shim do not parse with clap (every argument
//! the wrapper does not own is runc's; containerd passes the shim Go-style flags):
//! they get a man page from a clap description of what they accept, and no
//! completions, which would offer a sliver of the command line as all of it.

use std::path::{Path, PathBuf};

use clap::builder::{PossibleValue, PossibleValuesParser};
use clap::{Arg, ArgAction, CommandFactory};
use clap_complete::Shell;

pub mod config_page;
pub mod manual;
pub mod page;

// The shim is a binary alone (containerd runs it; there is no library to depend
// on), so its flag table, plain data, is compiled here from the shim's own file.
#[allow(dead_code)] // -h detection and the usage text are the shim's to use.
#[path = "../../../shim/src/cli.rs"]
mod shim_cli;

/// The shells completions are written for.
pub const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// One binary to document.
pub struct Program {
    pub command: clap::Command,
    /// Whether the binary parses its command line with `command`, so that
    /// completions from it are the whole truth.
    pub completions: bool,
}

impl Program {
    pub fn name(&self) -> &str {
        self.command.get_name()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DocgenError {
    #[error("creating {dir}: {source}")]
    CreateDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the configuration's schema cannot be read: {0}")]
    Schema(String),
    #[error("{program} has no manual table in gpushare-docgen (manual::of)")]
    NoManual { program: String },
    #[error("writing the {what} of {program} into {dir}: {source}")]
    Write {
        what: &'static str,
        program: String,
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// Every gpushare binary, in the Makefile's order.
pub fn programs() -> Vec<Program> {
    let parsed = |command| Program {
        command,
        completions: true,
    };
    let described = |command| Program {
        command,
        completions: false,
    };
    vec![
        parsed(gpushare_arbiter::cli::ArbiterArgs::command()),
        parsed(gpushare_ctl::cli::CtlArgs::command()),
        described(gpushare_oci::cli::runc_wrapper_command()),
        parsed(gpushare_oci::cli::HookCli::command()),
        described(shim_command()),
        parsed(gpushare_kube::cli::KubeArgs::command()),
    ]
}

/// The shim's flags as containerd passes them; a one-letter flag is shown as a
/// short one (`-v`), the others as long ones, which Go's flag package also takes.
fn shim_command() -> clap::Command {
    let mut command = clap::Command::new(shim_cli::BINARY)
        .version(env!("CARGO_PKG_VERSION"))
        // The NAME line's summary; SUMMARY, with the runtime's name, opens the description.
        .about("gpushare's containerd shim")
        .long_about(format!("{}: {}", shim_cli::SUMMARY, shim_cli::DETAILS))
        // -v and -version are the shim's own flags, listed below.
        .disable_version_flag(true)
        .after_long_help(
            "Flags take one dash or two, the value after a space or '='. containerd runs \
             `-namespace NS -address ADDRESS -publish-binary PATH -id ID start`, and `delete` \
             the same way.",
        );
    for flag in shim_cli::FLAGS {
        let mut arg = Arg::new(flag.name).help(flag.help);
        let mut letters = flag.name.chars();
        arg = match (letters.next(), letters.next()) {
            (Some(letter), None) => arg.short(letter),
            _ => arg.long(flag.name),
        };
        arg = match flag.value {
            Some(value) => arg.value_name(value).action(ArgAction::Set),
            None => arg.action(ArgAction::SetTrue),
        };
        command = command.arg(arg);
    }
    let actions = shim_cli::ACTIONS
        .iter()
        .map(|(name, help)| PossibleValue::new(*name).help(*help));
    command.arg(
        Arg::new("action")
            .value_name("ACTION")
            .value_parser(PossibleValuesParser::new(actions))
            .help("What to do; with none the shim serves the task API"),
    )
}

/// Every page of `program`: its own and one per subcommand (hidden ones and clap's
/// `help` left out), as (file name, page).
pub fn command_pages(program: &Program) -> Result<Vec<(String, Vec<u8>)>, DocgenError> {
    let name = program.name();
    let manual = manual::of(name).ok_or_else(|| DocgenError::NoManual {
        program: name.to_owned(),
    })?;
    let mut command = program.command.clone().disable_help_subcommand(true);
    command.build();
    let mut pages = Vec::new();
    add_pages(&command, &[name], manual, &mut pages);
    Ok(pages)
}

fn add_pages(
    command: &clap::Command,
    path: &[&str],
    manual: &manual::Manual,
    pages: &mut Vec<(String, Vec<u8>)>,
) {
    pages.push((
        clap_mangen::Man::new(command.clone()).get_filename(),
        page::command_page(command, manual, path),
    ));
    for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
        let mut path = path.to_vec();
        path.push(sub.get_name());
        add_pages(sub, &path, manual, pages);
    }
}

/// gpushare.toml.5, the configuration file's page.
pub fn config_page() -> Result<Vec<u8>, DocgenError> {
    let defaults = gpushare_config::keys::settings(&gpushare_config::Config::default());
    let tables =
        config_page::tables(&config_page::schema(), &defaults).map_err(DocgenError::Schema)?;
    Ok(config_page::render(&tables))
}

/// Writes `<name>.1` (and `<name>-<command>.1` per subcommand) and
/// `gpushare.toml.5` into `man_dir`, and `<name>.bash`, `_<name>` and `<name>.fish`
/// into `completions_dir` for each binary that parses with clap.
pub fn write_all(man_dir: &Path, completions_dir: &Path) -> Result<(), DocgenError> {
    for dir in [man_dir, completions_dir] {
        std::fs::create_dir_all(dir).map_err(|source| DocgenError::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    for program in programs() {
        let name = program.name().to_owned();
        let failed = |what, dir: &Path| {
            let program = name.clone();
            let dir = dir.to_owned();
            move |source| DocgenError::Write {
                what,
                program,
                dir,
                source,
            }
        };
        for (file, text) in command_pages(&program)? {
            page::write_page(man_dir, &file, &text).map_err(failed("man page", man_dir))?;
        }
        if program.completions {
            let mut command = program.command;
            for shell in SHELLS {
                clap_complete::generate_to(shell, &mut command, &name, completions_dir)
                    .map_err(failed("completions", completions_dir))?;
            }
        }
    }
    let file = format!("{}.5", config_page::PAGE);
    page::write_page(man_dir, &file, &config_page()?).map_err(|source| DocgenError::Write {
        what: "man page",
        program: config_page::PAGE.to_owned(),
        dir: man_dir.to_owned(),
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_description_is_consistent_and_versioned() {
        let names: Vec<String> = programs().iter().map(|p| p.name().to_owned()).collect();
        assert_eq!(
            names,
            [
                "gpushare-arbiter",
                "gpusharectl",
                "gpushare-runc",
                "gpushare-hook",
                "containerd-shim-gpushare-v2",
                "gpushare-kube",
            ]
        );
        for program in programs() {
            program.command.clone().debug_assert();
            assert_eq!(
                program.command.get_version(),
                Some(env!("CARGO_PKG_VERSION")),
                "{}",
                program.name()
            );
        }
    }

    /// Every command and subcommand, with the words that run it.
    fn every_command() -> Vec<(Vec<String>, clap::Command)> {
        fn walk(
            command: &clap::Command,
            path: Vec<String>,
            all: &mut Vec<(Vec<String>, clap::Command)>,
        ) {
            all.push((path.clone(), command.clone()));
            for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
                let mut path = path.clone();
                path.push(sub.get_name().to_owned());
                walk(sub, path, all);
            }
        }
        let mut all = Vec::new();
        for program in programs() {
            let name = program.name().to_owned();
            let mut command = program.command.disable_help_subcommand(true);
            command.build();
            walk(&command, vec![name], &mut all);
        }
        all
    }

    #[test]
    fn every_page_name_has_a_summary_that_fits_one_line_of_name() {
        // man indents NAME by 7 columns and keeps 2 free: at 80 the line holds 71.
        for (path, command) in every_command() {
            let name = path.join("-");
            let about = command
                .get_about()
                .unwrap_or_else(|| panic!("{name} has no about"))
                .to_string();
            let line = format!("{name} - {about}");
            assert!(
                !about.contains('\n') && line.chars().count() <= 71,
                "{name}: the NAME line {line:?} is {} characters; the about (the first \
                 paragraph of the doc comment) must be one short line",
                line.chars().count()
            );
        }
    }

    #[test]
    fn every_subcommand_has_an_example_of_its_own() {
        for (path, _) in every_command() {
            let manual = manual::of(&path[0]).expect("a manual per program");
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            assert!(
                !manual::examples_running(manual, &path).is_empty(),
                "{}: no example in its manual (manual.rs) runs it",
                path.join(" ")
            );
        }
    }

    /// Words as the shell splits them, for the single quotes the examples use.
    fn shell_words(line: &str) -> Vec<String> {
        let (mut words, mut word, mut quoted) = (Vec::new(), String::new(), false);
        for c in line.chars() {
            match c {
                '\'' => quoted = !quoted,
                ' ' if !quoted => {
                    words.extend((!word.is_empty()).then(|| std::mem::take(&mut word)))
                }
                c => word.push(c),
            }
        }
        words.extend((!word.is_empty()).then_some(word));
        words
    }

    #[test]
    fn every_example_runs_a_command_that_parses() {
        for program in programs().into_iter().filter(|p| p.completions) {
            let name = program.name().to_owned();
            let manual = manual::of(&name).unwrap();
            for example in manual::examples_running(manual, &[&name]) {
                // The command line, without the environment before it or the shell's
                // redirections after it.
                let words: Vec<String> = shell_words(example.command)
                    .into_iter()
                    .skip_while(|word| word.contains('='))
                    .take_while(|word| !["<", ">", "|", "&&"].contains(&word.as_str()))
                    .collect();
                program
                    .command
                    .clone()
                    .try_get_matches_from(&words)
                    .unwrap_or_else(|e| panic!("{}: {e}", example.command));
            }
        }
    }

    #[test]
    fn the_configuration_page_describes_every_key() {
        let defaults = gpushare_config::keys::settings(&gpushare_config::Config::default());
        let tables = config_page::tables(&config_page::schema(), &defaults).unwrap();
        let keys: Vec<&config_page::Key> = tables.iter().flat_map(|t| &t.keys).collect();
        for key in &keys {
            assert!(
                !key.description.is_empty(),
                "{}: no doc comment on its field in config/src/lib.rs",
                key.key
            );
            for (value, meaning) in &key.values {
                assert!(
                    !meaning.is_empty(),
                    "{} = {value:?}: no doc comment",
                    key.key
                );
            }
        }
        for table in &tables {
            assert!(
                !table.description.is_empty(),
                "[{}]: no doc comment",
                table.name
            );
        }
        for key in defaults.keys() {
            assert!(keys.iter().any(|k| &k.key == key), "{key} missing");
        }
    }

    #[test]
    fn every_value_the_page_lists_for_an_enumeration_is_accepted() {
        let defaults = gpushare_config::keys::settings(&gpushare_config::Config::default());
        let tables = config_page::tables(&config_page::schema(), &defaults).unwrap();
        let mut checked = 0;
        for table in &tables {
            for key in table.keys.iter().filter(|k| !k.key.contains("[]")) {
                let Some(field) = key.key.strip_prefix(&format!("{}.", table.name)) else {
                    continue;
                };
                let values = key.kind.strip_prefix("one of: ").map(|v| v.split(", "));
                for value in values.into_iter().flatten() {
                    let (table_name, field) = match field.strip_prefix("profiles.NAME.") {
                        Some(inner) => (format!("{}.profiles.p", table.name), inner),
                        None => (table.name.clone(), field),
                    };
                    let text = format!("[{table_name}]\n{field} = \"{value}\"\n");
                    gpushare_config::Config::parse(&text, std::path::Path::new("page.toml"))
                        .unwrap_or_else(|e| panic!("{text}: {e}"));
                    checked += 1;
                }
            }
        }
        assert!(checked >= 10, "{checked} values checked");
    }

    #[test]
    fn the_configuration_pages_example_is_a_valid_file() {
        gpushare_config::Config::parse(config_page::EXAMPLE, std::path::Path::new("example.toml"))
            .unwrap();
    }

    #[test]
    fn the_shim_page_lists_every_flag_as_the_shim_takes_it() {
        let command = shim_command();
        for flag in shim_cli::FLAGS {
            let arg = command
                .get_arguments()
                .find(|a| a.get_id() == flag.name)
                .unwrap_or_else(|| panic!("-{} missing", flag.name));
            assert_eq!(
                matches!(arg.get_action(), ArgAction::Set),
                flag.value.is_some(),
                "-{}",
                flag.name
            );
        }
    }
}
