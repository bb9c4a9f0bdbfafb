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
    /// Who is on each GPU, what waits, what is wrong.
    ///
    /// Each GPU with its containers (priority, memory used/quota, token time, token share),
    /// then what is waiting and why, then what is wrong (or "no problems"); with no GPU,
    /// why not. --verbose adds the scheduler's internals.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Also the internals: inventory, placement, token counters, admission windows,
        /// memory reclaim, each lease's processes and pod.
        #[arg(long, short)]
        verbose: bool,
    },
    /// The leases, a row each.
    ///
    /// A table: container, lease id, GPUs, priority, memory quota, state (and grants, where a
    /// lease has any), the containers named as status names them.
    List {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check gpushare's configuration file.
    ///
    /// Checks the file as every component reads it (no arbiter needed): `FILE: ok`, or
    /// each problem as FILE:LINE: key = value: what is wrong; the likely fix. Exit 0
    /// ok, 1 problems, 2 unreadable.
    CheckConfig(CheckConfig),
    /// Release a lease by id (idempotent).
    Release { lease: String },
    /// Place no new leases on a GPU; its leases stay.
    ///
    /// The GPU is named by UUID or index.
    Drain { gpu: String },
    /// Place leases on a drained GPU again.
    Undrain { gpu: String },
    /// Add gpushare's runtime to an engine's configuration.
    ///
    /// Edits the container ENGINE's configuration file (docker's daemon.json,
    /// containerd's config.toml, podman's containers.conf, CRI-O's drop-in), keeping
    /// everything else; with --undo, takes it out again (the file as it was, byte for
    /// byte, if nothing else changed it since). Here --config names that engine's file,
    /// not gpushare's configuration. The engine is not restarted.
    #[command(arg(
        clap::Arg::new("config")
            .long("config")
            .value_name("FILE")
            .value_parser(clap::value_parser!(PathBuf))
            .help(
                "The engine's configuration file, not gpushare's (default: docker \
                 /etc/docker/daemon.json, containerd /etc/containerd/config.toml, podman \
                 /etc/containers/containers.conf, crio /etc/crio/crio.conf.d/50-gpushare.conf)"
            )
    ))]
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
    /// Live view of each GPU, redrawn every second.
    ///
    /// Per GPU: memory used/quota, token time and token share per container, priority, the
    /// token's holder and the queue, redrawn every second (one frame when stdout is not a
    /// terminal).
    Top {
        /// Print one frame, without terminal control codes, and exit.
        #[arg(long)]
        once: bool,
    },
    /// Who held each GPU's time-slice token when.
    ///
    /// A text strip per GPU (a letter per container) with each container's token time and
    /// token share of the span, an SVG chart, or JSON.
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
    fn setup_says_its_config_is_the_engines_and_still_reads_it_into_config() {
        for args in [
            ["gpusharectl", "setup", "docker", "--config", "/x.json"],
            ["gpusharectl", "--config", "/x.json", "setup", "docker"],
        ] {
            let parsed = CtlArgs::try_parse_from(args).unwrap();
            assert!(
                matches!(parsed.command, CtlCommand::Setup { .. }),
                "{args:?}"
            );
            assert_eq!(parsed.config, Some(PathBuf::from("/x.json")), "{args:?}");
        }
        let mut command = CtlArgs::command();
        command.build();
        let help_of = |command: &clap::Command| {
            let arg = command
                .get_arguments()
                .find(|a| a.get_id() == "config")
                .expect("--config");
            arg.get_help().map(|h| h.to_string()).unwrap_or_default()
        };
        let setup = command.find_subcommand("setup").unwrap();
        assert!(help_of(setup).starts_with("The engine's configuration file, not gpushare's"));
        assert!(setup
            .get_long_about()
            .unwrap()
            .to_string()
            .contains("not gpushare's configuration"));
        // Every other command's --config is gpushare's file.
        let status = command.find_subcommand("status").unwrap();
        assert!(help_of(status).starts_with("Configuration file (default: $GPUSHARE_CONFIG"));
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
