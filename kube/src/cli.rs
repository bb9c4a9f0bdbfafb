//! `gpushare-kube`'s command line, in the library so that gpushare-docgen renders
//! its man page and shell completions from the definition the binary parses with.

use std::path::PathBuf;

use clap::Parser;

use gpushare_types::cli::HELP_TEMPLATE;

#[derive(Parser, Debug)]
#[command(
    name = "gpushare-kube",
    version,
    help_template = HELP_TEMPLATE,
    about = "gpushare's Kubernetes device plugin",
    long_about = "gpushare's Kubernetes device plugin: advertises gpushare.io/memory, gpushare.io/high and gpushare.io/compute, and turns Allocate into arbiter grants"
)]
pub struct KubeArgs {
    /// Configuration file (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definition_is_consistent_and_names_the_binary() {
        let command = KubeArgs::command();
        command.clone().debug_assert();
        let help = command.clone().render_help().to_string();
        assert!(
            help.starts_with(&format!("gpushare-kube {}\n", env!("CARGO_PKG_VERSION"))),
            "{help}"
        );
        assert_eq!(
            command.render_version(),
            format!("gpushare-kube {}\n", env!("CARGO_PKG_VERSION"))
        );
    }
}
