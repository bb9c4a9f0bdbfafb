//! The command lines of `gpushare-hook` and `gpushare-runc`, in the library so that
//! gpushare-docgen renders their man pages from what the binaries accept.
//!
//! gpushare-hook parses with clap. gpushare-runc does not: every argument it does
//! not own must reach the runtime unchanged (runc_args), so [`runc_wrapper_command`]
//! only documents it, and [`wrapper_query`] picks out the two questions it answers
//! itself before handing over.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Arg, ArgAction, Parser, Subcommand};

use crate::runc_args::{self, GPUSHARE_CONFIG_FLAG, GPUSHARE_PROFILE_FLAG};

pub const HOOK: &str = "gpushare-hook";
pub const RUNC_WRAPPER: &str = "gpushare-runc";

/// `gpushare-runc 0.1.0`: the first line of its `--version` and `--help`, in clap's
/// `<name> <version>` layout like every other gpushare binary.
pub fn runc_wrapper_version_line() -> String {
    format!("{RUNC_WRAPPER} {}", env!("CARGO_PKG_VERSION"))
}

pub use gpushare_types::cli::HELP_TEMPLATE;

/// `gpushare-hook`'s arguments.
#[derive(Parser, Debug)]
#[command(
    name = HOOK,
    version,
    help_template = HELP_TEMPLATE,
    about = "gpushare's OCI hooks for podman and runc",
    long_about = "gpushare's OCI hooks: each stage reads the spec or the container's state on stdin"
)]
pub struct HookCli {
    /// gpushare's configuration (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The arbiter's control socket (default: the configuration's).
    #[arg(long, global = true, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,
    #[command(subcommand)]
    pub stage: Stage,
}

#[derive(Subcommand, Debug)]
pub enum Stage {
    /// podman's precreate hook: edits the spec.
    ///
    /// The spec on stdin, the edited spec on stdout.
    Precreate,
    /// createRuntime hook: confirm the lease.
    ///
    /// Confirms the container's lease with its pid (the OCI state on stdin).
    CreateRuntime,
    /// poststop hook: release the container's lease.
    ///
    /// Releases the container's lease (the OCI state on stdin).
    Poststop,
    /// Fail with a message, as a refused precreate does.
    ///
    /// Fails with the message: how precreate reports an error through runc.
    Fail {
        /// What to fail with (default: container creation refused).
        #[arg(long)]
        message: Option<String>,
    },
}

const RUNC_WRAPPER_ABOUT: &str = "gpushare's runc-compatible wrapper: on create and run it \
reserves a GPU lease and edits the container's spec, on exec it gives the process the \
container's injected environment, and it hands every command line on, unchanged, to the \
first runtime of runtime.runtimes (runc)";

/// gpushare-runc as documentation: its one flag, and the runtime's command line.
/// Not a parser (see the module comment).
pub fn runc_wrapper_command() -> clap::Command {
    clap::Command::new(RUNC_WRAPPER)
        .version(env!("CARGO_PKG_VERSION"))
        // runc's spelling, -v, not clap's -V: the wrapper answers what runc answers.
        .disable_version_flag(true)
        .arg(
            Arg::new("version")
                .short('v')
                .long("version")
                .action(ArgAction::Version)
                .help("Print gpushare-runc's version, then the runtime's"),
        )
        .about("gpushare's runc-compatible wrapper")
        .long_about(RUNC_WRAPPER_ABOUT)
        .after_help(
            "--version prints gpushare-runc's version line, then the runtime's own version; \
             --help, what the wrapper does, then the runtime's help. Every other argument is \
             the runtime's: see runc(8).",
        )
        .arg(
            Arg::new(GPUSHARE_CONFIG_FLAG)
                .long(GPUSHARE_CONFIG_FLAG)
                .value_name("FILE")
                .help(
                    "gpushare's configuration (default: $GPUSHARE_CONFIG, then \
                     /etc/gpushare/config.toml); removed before the runtime sees the command line",
                ),
        )
        .arg(
            Arg::new(GPUSHARE_PROFILE_FLAG)
                .long(GPUSHARE_PROFILE_FLAG)
                .value_name("NAME")
                .help(
                    "The runtime profile ([runtime.profiles.NAME]) this runtime entry grants \
                     its containers: priority, memory and tenant beyond what their environment \
                     may ask; removed before the runtime sees the command line",
                ),
        )
        .arg(
            Arg::new("runtime-args")
                .value_name("RUNC_ARGS")
                .num_args(0..)
                .trailing_var_arg(true)
                .allow_hyphen_values(true)
                .action(ArgAction::Append)
                .help("runc's global flags, command and its arguments, passed on unchanged"),
        )
}

/// The text `gpushare-runc --help` prints before the runtime's help.
pub fn runc_wrapper_help() -> String {
    format!(
        "{}\n{RUNC_WRAPPER_ABOUT}.\n\ngpushare's own flag (before the command): \
         --{GPUSHARE_CONFIG_FLAG} FILE, gpushare's configuration (default: $GPUSHARE_CONFIG, \
         then /etc/gpushare/config.toml); --{GPUSHARE_PROFILE_FLAG} NAME, the runtime profile \
         ([runtime.profiles.NAME]) this runtime entry grants its containers.\n",
        runc_wrapper_version_line()
    )
}

/// A question gpushare-runc answers (its own line first, then the runtime's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrapperQuery {
    Version,
    Help,
}

/// `--version`/`-v` or `--help`/`-h` among the global flags, with no command after
/// them (urfave/cli takes one or two dashes). `runc create --help` is the command's
/// own help: the runtime's alone. No arguments at all is runc's help too.
pub fn wrapper_query(args: &[OsString]) -> Option<WrapperQuery> {
    let args = runc_args::strip_gpushare_flags(args);
    if args.is_empty() {
        return Some(WrapperQuery::Help);
    }
    let invocation = runc_args::scan(&args);
    if invocation.subcommand.is_some() {
        return None;
    }
    args.iter().find_map(|arg| {
        let arg = arg.to_string_lossy();
        let name = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-'))?;
        match name {
            "version" | "v" => Some(WrapperQuery::Version),
            "help" | "h" => Some(WrapperQuery::Help),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        HookCli::command().debug_assert();
        runc_wrapper_command().debug_assert();
    }

    #[test]
    fn versions_read_name_then_version() {
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            HookCli::command().render_version(),
            format!("gpushare-hook {version}\n")
        );
        assert_eq!(
            runc_wrapper_version_line(),
            format!("gpushare-runc {version}")
        );
        assert!(runc_wrapper_help().starts_with(&runc_wrapper_version_line()));
        let help = HookCli::command().render_help().to_string();
        assert!(
            help.starts_with(&format!("gpushare-hook {version}\n")),
            "{help}"
        );
    }

    #[test]
    fn the_wrapper_answers_only_top_level_version_and_help() {
        use WrapperQuery::{Help, Version};
        for (line, expected) in [
            ("--version", Some(Version)),
            ("-v", Some(Version)),
            ("-version", Some(Version)),
            ("--help", Some(Help)),
            ("-h", Some(Help)),
            ("", Some(Help)),
            ("--gpushare-config /etc/g.toml --version", Some(Version)),
            ("--root /r --help", Some(Help)),
            // A command's own help, and a container named like a flag, are runc's.
            ("create --help", None),
            ("--root /r exec --process p.json id --version", None),
            ("--root /r list", None),
            ("--debug", None),
        ] {
            let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
            assert_eq!(wrapper_query(&args), expected, "{line:?}");
        }
    }
}
