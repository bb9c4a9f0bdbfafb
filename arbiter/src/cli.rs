//! `gpushare-arbiter`'s command line, in the library so that gpushare-docgen renders its
//! man page and shell completions from the very definitions the binary parses with
//! (`gpusharectl`'s is in its own crate, `gpushare-ctl`).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use gpushare_types::cli::HELP_TEMPLATE;

/// `gpushare-arbiter`'s arguments.
#[derive(Parser, Debug)]
#[command(
    // Without a name clap shows the package's (`gpushare-arbiter` for gpusharectl too).
    name = "gpushare-arbiter",
    version,
    help_template = HELP_TEMPLATE,
    about = "gpushare's node daemon: places containers on GPUs",
    long_about = "gpushare's node daemon: places containers on GPUs and owns their leases \
                  (memory quotas, the time-slice token), serving the control socket and \
                  one socket per lease. Without a command it runs the daemon."
)]
pub struct ArbiterArgs {
    /// Configuration file (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Without one, run the daemon.
    #[command(subcommand)]
    pub command: Option<ArbiterCommand>,
}

#[derive(Subcommand, Debug)]
pub enum ArbiterCommand {
    /// Check gpushare's configuration file.
    ///
    /// Checks the file as every component reads it, before saving it where they read
    /// it: `FILE: ok`, or each problem as FILE:LINE: key = value: what is wrong; the
    /// likely fix. Exit 0 ok, 1 problems, 2 unreadable.
    CheckConfig(CheckConfig),
}

pub use gpushare_config::check::CheckConfig;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        ArbiterArgs::command().debug_assert();
    }

    #[test]
    fn check_config_takes_an_optional_file() {
        let arbiter = |args: &[&str]| ArbiterArgs::try_parse_from(args).unwrap();
        let daemon = arbiter(&["gpushare-arbiter", "--config", "/c.toml"]);
        assert!(daemon.command.is_none());
        for (args, file) in [
            (vec!["gpushare-arbiter", "check-config"], None),
            (
                vec!["gpushare-arbiter", "check-config", "/x.toml"],
                Some("/x.toml"),
            ),
        ] {
            let Some(ArbiterCommand::CheckConfig(check)) = arbiter(&args).command else {
                panic!("{args:?}")
            };
            assert_eq!(check.file, file.map(PathBuf::from), "{args:?}");
        }
    }

    #[test]
    fn the_binary_is_named_as_itself() {
        let command = ArbiterArgs::command();
        let name = "gpushare-arbiter";
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
