//! `gpusharectl`'s command line, in the library so that gpushare-docgen renders its man
//! page and shell completions from the very definitions the binary parses with.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use gpushare_types::cli::HELP_TEMPLATE;

/// `gpusharectl`'s arguments.
#[derive(Parser, Debug)]
#[command(
    name = "gpusharectl",
    version,
    help_template = HELP_TEMPLATE,
    about = "Inspect and manage the gpushare arbiter"
)]
pub struct CtlArgs {
    /// Configuration file (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Control socket (default: from the configuration).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// Each GPU with its containers (priority, memory used/quota, token time, token share),
    /// then what is waiting and why, then what is wrong (or "no problems"); with no GPU,
    /// why not.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Also the internals: inventory, placement, token counters, admission windows,
        /// memory reclaim, each lease's processes and pod.
        #[arg(long, short)]
        verbose: bool,
    },
    /// The leases alone, a row each: container, lease id, GPUs, priority, memory, state.
    List {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check a configuration file as every component reads it (no arbiter needed):
    /// `FILE: ok`, or each problem as FILE:LINE: key = value: what is wrong; the
    /// likely fix. Exit 0 ok, 1 problems, 2 unreadable.
    CheckConfig(CheckConfig),
    /// Release a lease by id (idempotent).
    Release { lease: String },
    /// Place no new leases on a GPU (UUID or index); its leases stay.
    Drain { gpu: String },
    /// Place leases on a drained GPU again.
    Undrain { gpu: String },
    /// Add gpushare's runtime to a container engine's configuration (docker's daemon.json,
    /// containerd's config.toml, podman's containers.conf), keeping everything else; with
    /// --undo, take it out again (the file as it was, byte for byte, if nothing else changed
    /// it since). Here --config names the engine's file. The engine is not restarted.
    Setup {
        engine: crate::setup::Engine,
        /// Take gpushare's runtime out again.
        #[arg(long)]
        undo: bool,
        /// Print what would be written; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Where gpushare-runc is (default: gpusharectl's own directory).
        #[arg(long, value_name = "DIR")]
        bin_dir: Option<PathBuf>,
        /// docker only: also add the runtime "gpushare-NAME", which grants its containers
        /// the runtime profile [runtime.profiles.NAME] of gpushare's configuration
        /// (priority, memory, tenant beyond what their environment may ask). Repeatable.
        #[arg(long, value_name = "NAME", value_parser = profile_name)]
        profile: Vec<String>,
        /// docker and containerd: also make gpushare the default runtime (docker's
        /// default-runtime, the CRI plugin's default_runtime_name), so containers and pods
        /// that name no runtime go through it; --undo takes that out too.
        #[arg(long)]
        set_as_default: bool,
    },
    /// Live view per GPU: memory used/quota, token time and token share per container,
    /// priority, the token's holder and the queue, redrawn every second (one frame when stdout is
    /// not a terminal).
    Top {
        /// Print one frame, without terminal control codes, and exit.
        #[arg(long)]
        once: bool,
    },
    /// Who held each GPU's time-slice token when: a text strip per GPU (a letter per
    /// container) with each container's token time and token share of the span, an SVG
    /// chart, or JSON.
    Timeline {
        /// Only holds that ended within the last SECS seconds (default: all kept,
        /// up to 10 minutes).
        #[arg(long, value_name = "SECS")]
        since: Option<u64>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Also write the chart as SVG to FILE.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
}

/// A runtime profile's name, as gpushare's configuration accepts it.
fn profile_name(name: &str) -> Result<String, String> {
    if gpushare_config::is_profile_name(name) {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} is not a profile name: expected {}",
            gpushare_config::PROFILE_NAME_FORMS
        ))
    }
}

pub use gpushare_config::check::CheckConfig;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        CtlArgs::command().debug_assert();
    }

    #[test]
    fn check_config_takes_an_optional_file() {
        for (args, file) in [
            (vec!["gpusharectl", "check-config"], None),
            (
                vec!["gpusharectl", "check-config", "/x.toml"],
                Some("/x.toml"),
            ),
        ] {
            let CtlCommand::CheckConfig(check) = CtlArgs::try_parse_from(&args).unwrap().command
            else {
                panic!("{args:?}")
            };
            assert_eq!(check.file, file.map(PathBuf::from), "{args:?}");
        }
    }

    #[test]
    fn the_binary_is_named_as_itself() {
        let command = CtlArgs::command();
        let name = "gpusharectl";
        assert_eq!(command.get_name(), name);
        let help = command.clone().render_help().to_string();
        assert!(
            help.starts_with(&format!("{name} {}\n", env!("CARGO_PKG_VERSION"))),
            "{help}"
        );
        assert_eq!(
            command.render_version(),
            format!("{name} {}\n", env!("CARGO_PKG_VERSION"))
        );
    }
}
