//! The shim's command line as data: containerd starts it with Go-style flags
//! (`-namespace ns -id x -address a start`), which `containerd_shim::parse`
//! reads. This table is what `-h` prints and what gpushare-docgen renders the
//! man page from; it depends on nothing, so gpushare-docgen compiles this very
//! file (the shim has no library to depend on).

use std::ffi::OsString;

pub const BINARY: &str = "containerd-shim-gpushare-v2";

pub const SUMMARY: &str = "gpushare's containerd shim (runtime io.containerd.gpushare.v2)";

/// What it does, after [`SUMMARY`] and a colon.
pub const DETAILS: &str =
    "it starts containerd-shim-runc-v2 for the same container group and forwards every task call \
to it, adding gpushare's lease and spec edits on Create, the injected environment on Exec, \
and the lease's release on Delete and when the container's init process exits. containerd \
starts it; people rarely do.";

/// One flag as containerd passes it: `-name value` or `-name=value` (Go's flag
/// package, which also takes `--name`).
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    pub name: &'static str,
    /// The value's placeholder; `None` for a switch.
    pub value: Option<&'static str>,
    pub help: &'static str,
}

/// Every flag `containerd_shim::parse` (0.11) accepts, in its order.
pub const FLAGS: &[Flag] = &[
    Flag {
        name: "debug",
        value: None,
        help: "Log at debug level",
    },
    Flag {
        name: "v",
        value: None,
        help: "Print the version, the runtime name and the runc shim it decorates, then exit",
    },
    Flag {
        name: "version",
        value: None,
        help: "The same as -v",
    },
    Flag {
        name: "namespace",
        value: Some("NAMESPACE"),
        help: "containerd namespace that owns the shim",
    },
    Flag {
        name: "id",
        value: Some("ID"),
        help: "Id of the task",
    },
    Flag {
        name: "socket",
        value: Some("PATH"),
        help: "Socket path to serve",
    },
    Flag {
        name: "bundle",
        value: Some("DIR"),
        help: "Path to the bundle, if not the working directory",
    },
    Flag {
        name: "address",
        value: Some("ADDRESS"),
        help: "containerd's GRPC address",
    },
    Flag {
        name: "publish-binary",
        value: Some("PATH"),
        help: "Binary that publishes events to containerd (containerd itself)",
    },
    Flag {
        name: "info",
        value: None,
        help:
            "Read runtime options from stdin, print the RuntimeInfo protobuf to stdout, then exit",
    },
];

/// The actions containerd names after the flags; with none the shim serves.
pub const ACTIONS: &[(&str, &str)] = &[
    (
        "start",
        "Start (or join) the shim of the container group; print its address",
    ),
    (
        "delete",
        "Clean up after a task whose shim is gone; print the exit status",
    ),
];

/// What `-h`, `-help` and `--help` print.
pub fn usage(version: &str) -> String {
    let mut text = format!(
        "{BINARY} {version}\n{SUMMARY}: {DETAILS}\n\nUsage: {BINARY} [FLAGS] [start|delete]\n\nActions:\n"
    );
    for (action, help) in ACTIONS {
        text += &format!("  {action:<24}{help}\n");
    }
    text += "\nFlags (one dash or two, value after a space or '='):\n";
    for flag in FLAGS {
        let spelled = match flag.value {
            Some(value) => format!("-{} {value}", flag.name),
            None => format!("-{}", flag.name),
        };
        text += &format!("  {spelled:<24}{}\n", flag.help);
    }
    text += &format!("  {:<24}Print this help, then exit\n", "-h, -help");
    text
}

/// `-h`, `-help` or `--help` among the flags, where Go's flag package would stop
/// with ErrHelp (and Go's shims print their usage and exit 0). Flags end at the
/// first argument that is not one, or at `--`.
pub fn asks_for_help(args: &[OsString]) -> bool {
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].to_string_lossy();
        if arg == "--" {
            return false;
        }
        let Some(flag) = arg
            .strip_prefix("--")
            .or_else(|| arg.strip_prefix('-'))
            .filter(|f| !f.is_empty())
        else {
            return false;
        };
        let (name, inline_value) = match flag.split_once('=') {
            Some((name, _)) => (name, true),
            None => (flag, false),
        };
        if name == "h" || name == "help" {
            return true;
        }
        let takes_value = FLAGS.iter().any(|f| f.name == name && f.value.is_some());
        if takes_value && !inline_value {
            i += 1;
        }
        i += 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_is_asked_only_among_the_flags() {
        for (line, expected) in [
            ("-h", true),
            ("-help", true),
            ("--help", true),
            ("-debug -h", true),
            ("-namespace ns --help", true),
            // A value that looks like the flag is a value.
            ("-id -h start", false),
            ("-id=x -h", true),
            // After the action, or after `--`: not a flag.
            ("-namespace ns start -h", false),
            ("-- -h", false),
            ("-namespace ns -id x -address /a start", false),
            ("-v", false),
            ("", false),
        ] {
            let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
            assert_eq!(asks_for_help(&args), expected, "{line:?}");
        }
    }

    #[test]
    fn usage_names_the_version_every_flag_and_action() {
        let text = usage("9.9.9");
        assert!(
            text.starts_with("containerd-shim-gpushare-v2 9.9.9\n"),
            "{text}"
        );
        for flag in FLAGS {
            assert!(text.contains(&format!("  -{}", flag.name)), "{text}");
        }
        for (action, _) in ACTIONS {
            assert!(text.contains(&format!("  {action} ")), "{text}");
        }
    }
}
