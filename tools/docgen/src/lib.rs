//! gpushare-docgen: man pages (clap_mangen) and bash/zsh/fish completions
//! (clap_complete) for gpushare's binaries, rendered from the command-line
//! definitions the binaries themselves parse with, so the two cannot drift.
//!
//! gpushare-runc and the containerd shim do not parse with clap (every argument
//! the wrapper does not own is runc's; containerd passes the shim Go-style flags):
//! they get a man page from a clap description of what they accept, and no
//! completions, which would offer a sliver of the command line as all of it.

use std::path::{Path, PathBuf};

use clap::builder::{PossibleValue, PossibleValuesParser};
use clap::{Arg, ArgAction, CommandFactory};
use clap_complete::Shell;

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
        .about(shim_cli::SUMMARY)
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

/// Writes `<name>.1` (and `<name>-<command>.1` per subcommand) into `man_dir`, and
/// `<name>.bash`, `_<name>` and `<name>.fish` into `completions_dir` for each
/// binary that parses with clap.
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
        clap_mangen::generate_to(program.command.clone(), man_dir)
            .map_err(failed("man page", man_dir))?;
        if program.completions {
            let mut command = program.command;
            for shell in SHELLS {
                clap_complete::generate_to(shell, &mut command, &name, completions_dir)
                    .map_err(failed("completions", completions_dir))?;
            }
        }
    }
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
