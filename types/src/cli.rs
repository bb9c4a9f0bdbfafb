//! What every gpushare binary's command line shares.

/// `--help` opens with `<name> <version>` in every gpushare binary, gpushare-runc's
/// included (clap's default help names neither). A clap template string, so this
/// crate needs no clap.
pub const HELP_TEMPLATE: &str =
    "{name} {version}\n{about-with-newline}\n{usage-heading} {usage}\n\n{all-args}{after-help}";
