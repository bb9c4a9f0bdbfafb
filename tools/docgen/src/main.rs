//! gpushare-docgen: writes the man pages and shell completions (`make man`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "gpushare-docgen",
    version,
    help_template = gpushare_oci::cli::HELP_TEMPLATE,
    about = "Writes man pages and bash/zsh/fish completions for gpushare's binaries"
)]
struct Args {
    /// Where the man pages (section 1) go.
    #[arg(long, value_name = "DIR", default_value = "target/man")]
    man_dir: PathBuf,
    /// Where the completion scripts go.
    #[arg(long, value_name = "DIR", default_value = "target/completions")]
    completions_dir: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match gpushare_docgen::write_all(&args.man_dir, &args.completions_dir) {
        Ok(()) => {
            println!(
                "man pages in {}, completions in {}",
                args.man_dir.display(),
                args.completions_dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpushare-docgen: {e}");
            ExitCode::FAILURE
        }
    }
}
