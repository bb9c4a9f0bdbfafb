//! containerd-shim-gpushare-v2: a containerd shim (task API v2, accepted by
//! containerd 1.6, 1.7 and 2.x) that decorates containerd's own runc shim. It
//! starts `containerd-shim-runc-v2` for the same container group and forwards
//! every task call to it, adding gpushare's lease and spec edits on `Create`,
//! the injected environment on `Exec`, and the lease's release on `Delete` and
//! when the container's init process exits.
//!
//! Modules: `bootstrap` (the process: start / serve / delete), `service` (the
//! task API), `forward` (the ttrpc client to the runc shim), `inner` (running
//! the runc shim's command line), `gpushare` (admission's inputs, releases), `layout`
//! (grouping; which files and sockets are whose), `about` (`-v`, `-info`, `-h`),
//! `cli` (the flags, as data).

mod about;
mod bootstrap;
mod cli;
mod failed_create;
mod forward;
mod gpushare;
mod inner;
mod layout;
mod service;

use std::io::Write;
use std::process::ExitCode;

/// The runtime name containerd maps to this binary (`io.containerd.gpushare.v2`
/// → `containerd-shim-gpushare-v2`).
pub const RUNTIME_ID: &str = "io.containerd.gpushare.v2";

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().collect();
    // Go's flag package, whose conventions containerd_shim::parse follows, answers
    // -h with the usage; that parser rejects it as an unknown flag.
    if cli::asks_for_help(&args[1..]) {
        print!("{}", about::help_text());
        return ExitCode::SUCCESS;
    }
    let flags = match containerd_shim::parse(&args[1..]) {
        Ok(flags) => flags,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if flags.version {
        print!("{}", about::version_text(&flags.publish_binary));
        return ExitCode::SUCCESS;
    }
    if flags.info {
        return match about::runtime_info(&flags.publish_binary) {
            Ok(bytes) => {
                let _ = std::io::stdout().write_all(&bytes);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{RUNTIME_ID}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let config = containerd_shim::Config {
        // This shim runs no container process itself (the runc shim does): it
        // must not reap, nor adopt orphans as a subreaper.
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(
        containerd_shim::asynchronous::run::<bootstrap::GpushareShim>(RUNTIME_ID, Some(config)),
    );
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    /// The help and the man page list only flags the parser accepts, with or
    /// without a value as it expects.
    #[test]
    fn every_documented_flag_is_one_the_parser_accepts() {
        for flag in crate::cli::FLAGS {
            let mut args = vec![OsString::from(format!("-{}", flag.name))];
            if flag.value.is_some() {
                args.push("x".into());
            }
            args.push("start".into());
            let parsed =
                containerd_shim::parse(&args).unwrap_or_else(|e| panic!("-{}: {e}", flag.name));
            assert_eq!(
                parsed.action, "start",
                "-{} took the action as its value",
                flag.name
            );
        }
        assert!(
            containerd_shim::parse(&["-h"]).is_err(),
            "-h is the shim's to answer"
        );
    }
}
