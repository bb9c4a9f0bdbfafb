//! Reading just enough of a runc command line to act on it.
//!
//! The wrapper must never break a container over a flag it does not need to
//! understand, so this is not a full parser (youki's liboci-cli rejects flags runc
//! accepts, such as `--rootless`, `--criu` and runc 1.2's `--pidfd-socket`). It
//! knows which of runc's flags take a value, so it can step over them, finds the
//! subcommand and the few values gpushare needs, and the wrapper passes the whole
//! command line on untouched. runc (urfave/cli) accepts `-flag` and `--flag`, with
//! the value either separate or after `=`.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::admission::Namespace;

/// Global flags of runc that take a value, and gpushare's own.
const GLOBAL_VALUE_FLAGS: &[&str] = &[
    "root",
    "log",
    "log-format",
    "criu",
    "rootless",
    GPUSHARE_CONFIG_FLAG,
    GPUSHARE_PROFILE_FLAG,
];
/// `--gpushare-config PATH`: gpushare-runc's own global flag, removed before the
/// command line is handed on. Engines that do not pass their environment to the
/// runtime (podman through conmon) can set it with `--runtime-flag`, docker with
/// `runtimeArgs`.
pub const GPUSHARE_CONFIG_FLAG: &str = "gpushare-config";
/// `--gpushare-profile NAME`: the runtime profile (`[runtime.profiles.NAME]`) this
/// runtime entry grants its containers, removed like `--gpushare-config`. Only the
/// engine's operator writes it: docker's `runtimeArgs`, which dockerd puts before
/// runc's own global flags (it runs the entry as `path runtimeArgs… runc-args…`).
pub const GPUSHARE_PROFILE_FLAG: &str = "gpushare-profile";
/// gpushare-runc's own global flags.
const GPUSHARE_FLAGS: [&str; 2] = [GPUSHARE_CONFIG_FLAG, GPUSHARE_PROFILE_FLAG];
/// Flags of `create`, `run` and `exec` that take a value.
const COMMAND_VALUE_FLAGS: &[&str] = &[
    "bundle",
    "b",
    "console-socket",
    "pid-file",
    "preserve-fds",
    "pidfd-socket",
    "cwd",
    "env",
    "e",
    "user",
    "u",
    "additional-gids",
    "g",
    "process",
    "p",
    "process-label",
    "apparmor",
    "cap",
    "c",
    "cgroup",
];

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Invocation {
    pub subcommand: Option<String>,
    /// Position of the subcommand in the arguments: what precedes it are runc's
    /// global flags, which any further runc call for this container must repeat.
    pub subcommand_index: Option<usize>,
    pub container_id: Option<String>,
    /// `--bundle`; runc's default is the working directory.
    pub bundle: Option<PathBuf>,
    /// `exec --process`.
    pub process: Option<PathBuf>,
    /// `--log`: where containerd's shim looks for runc's last error.
    pub log: Option<PathBuf>,
    pub log_format_json: bool,
    pub gpushare_config: Option<PathBuf>,
    /// `--gpushare-profile`.
    pub gpushare_profile: Option<String>,
    /// `--root`: runc's state directory, the id space of its container ids (each
    /// containerd namespace, docker and podman use their own).
    pub root: Option<PathBuf>,
}

impl Invocation {
    /// The id space of this invocation's container id, for the lease's key.
    pub fn namespace(&self) -> Namespace {
        match &self.root {
            Some(root) => Namespace::RuntimeRoot(root.clone()),
            None => Namespace::Unknown,
        }
    }
}

/// Removes gpushare-runc's own flags (`--gpushare-config`, `--gpushare-profile`;
/// both `--flag value` and `--flag=value`, one or two dashes) from the global
/// flags, leaving every other argument as it was.
pub fn strip_gpushare_flags(args: &[OsString]) -> Vec<OsString> {
    let subcommand = scan(args).subcommand_index.unwrap_or(args.len());
    let mut kept = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].to_string_lossy();
        let name = arg.trim_start_matches('-');
        let dashed = arg.starts_with('-');
        let own = |flag: &&str| name == *flag;
        let own_with_value = |flag: &&str| name.starts_with(&format!("{flag}="));
        if i < subcommand && dashed && GPUSHARE_FLAGS.iter().any(own) {
            i += 2;
            continue;
        }
        if i < subcommand && dashed && GPUSHARE_FLAGS.iter().any(own_with_value) {
            i += 1;
            continue;
        }
        kept.push(args[i].clone());
        i += 1;
    }
    kept
}

/// `args` excludes the program name.
pub fn scan(args: &[OsString]) -> Invocation {
    let mut inv = Invocation::default();
    let mut i = 0;
    let mut in_command = false;
    while i < args.len() {
        let arg = args[i].to_string_lossy();
        if arg == "--" {
            if in_command && inv.container_id.is_none() {
                inv.container_id = args.get(i + 1).map(|a| a.to_string_lossy().into_owned());
            }
            break;
        }
        if let Some(flag) = arg
            .strip_prefix("--")
            .or_else(|| arg.strip_prefix('-'))
            .filter(|f| !f.is_empty())
        {
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (flag, None),
            };
            let takes_value = if in_command {
                COMMAND_VALUE_FLAGS.contains(&name)
            } else {
                GLOBAL_VALUE_FLAGS.contains(&name)
            };
            let mut value = inline;
            if takes_value && value.is_none() {
                i += 1;
                value = args.get(i).map(|a| a.to_string_lossy().into_owned());
            }
            match (in_command, name, value) {
                (false, "log", Some(v)) => inv.log = Some(v.into()),
                (false, "root", Some(v)) => inv.root = Some(v.into()),
                (false, "log-format", Some(v)) => inv.log_format_json = v == "json",
                (false, GPUSHARE_CONFIG_FLAG, Some(v)) => inv.gpushare_config = Some(v.into()),
                (false, GPUSHARE_PROFILE_FLAG, Some(v)) => inv.gpushare_profile = Some(v),
                (true, "bundle" | "b", Some(v)) => inv.bundle = Some(v.into()),
                (true, "process" | "p", Some(v)) => inv.process = Some(v.into()),
                _ => {}
            }
        } else if !in_command {
            inv.subcommand = Some(arg.into_owned());
            inv.subcommand_index = Some(i);
            in_command = true;
        } else if inv.container_id.is_none() {
            inv.container_id = Some(arg.into_owned());
            // exec's command and its arguments follow; they are not ours to read.
            if inv.subcommand.as_deref() == Some("exec") {
                break;
            }
        }
        i += 1;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_str(line: &str) -> Invocation {
        scan(
            &line
                .split_whitespace()
                .map(OsString::from)
                .collect::<Vec<_>>(),
        )
    }

    /// The command line the next runtime sees, as one line.
    fn stripped(args: &[OsString]) -> String {
        let kept: Vec<String> = strip_gpushare_flags(args)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        kept.join(" ")
    }

    #[test]
    fn containerd_shim_create() {
        let inv = scan_str(
            "--root /run/docker/runtime-runc/moby --log /b/log.json --log-format json --systemd-cgroup \
             create --bundle /b --pid-file /b/init.pid --console-socket /tmp/pty.sock abc123",
        );
        assert_eq!(inv.subcommand.as_deref(), Some("create"));
        assert_eq!(inv.subcommand_index, Some(7));
        assert_eq!(inv.container_id.as_deref(), Some("abc123"));
        assert_eq!(inv.bundle, Some(PathBuf::from("/b")));
        assert_eq!(inv.log, Some(PathBuf::from("/b/log.json")));
        assert!(inv.log_format_json);
    }

    #[test]
    fn go_style_single_dash_and_equals() {
        let inv = scan_str("-root=/r -debug create -b=/x -no-pivot id1");
        assert_eq!(inv.subcommand.as_deref(), Some("create"));
        assert_eq!(inv.bundle, Some(PathBuf::from("/x")));
        assert_eq!(inv.container_id.as_deref(), Some("id1"));
        assert_eq!(inv.namespace().key().as_deref(), Some("runtime-root:/r"));
    }

    #[test]
    fn the_state_root_names_the_id_space() {
        for (line, namespace) in [
            (
                "--root /run/containerd/runc/k8s.io create --bundle /b c1",
                Some("runtime-root:/run/containerd/runc/k8s.io"),
            ),
            (
                "--root=/var/run/docker/runtime-runc/moby create c1",
                Some("runtime-root:/var/run/docker/runtime-runc/moby"),
            ),
            // runc's own default root: no flag, no namespace (the id alone).
            ("create --bundle /b c1", None),
            // A `--root` after the subcommand is not runc's global flag.
            ("create --root /x c1", None),
        ] {
            assert_eq!(
                scan_str(line).namespace().key().as_deref(),
                namespace,
                "{line}"
            );
        }
    }

    #[test]
    fn unknown_boolean_flags_are_stepped_over() {
        let inv = scan_str(
            "--rootless false --criu /usr/sbin/criu create --no-new-keyring --pidfd-socket /s c9",
        );
        assert_eq!(inv.container_id.as_deref(), Some("c9"));
        assert_eq!(inv.bundle, None);
    }

    #[test]
    fn exec_stops_at_the_command() {
        let inv =
            scan_str("--root /r exec --process /tmp/p.json -d --pid-file /p cid sh -c --bundle");
        assert_eq!(inv.subcommand.as_deref(), Some("exec"));
        assert_eq!(inv.process, Some(PathBuf::from("/tmp/p.json")));
        assert_eq!(inv.container_id.as_deref(), Some("cid"));
        assert_eq!(inv.bundle, None);
    }

    #[test]
    fn gpushare_config_flag_is_read_and_stripped() {
        let args: Vec<OsString> =
            "--root /r --gpushare-config /etc/g.toml exec --process p.json id --gpushare-config x"
                .split_whitespace()
                .map(OsString::from)
                .collect();
        let inv = scan(&args);
        assert_eq!(inv.gpushare_config, Some(PathBuf::from("/etc/g.toml")));
        assert_eq!(inv.subcommand.as_deref(), Some("exec"));
        // The command's own arguments are not ours to touch, even if they look alike.
        assert_eq!(
            stripped(&args),
            "--root /r exec --process p.json id --gpushare-config x"
        );
        let eq: Vec<OsString> = ["-gpushare-config=/c.toml", "create", "x"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(scan(&eq).gpushare_config, Some(PathBuf::from("/c.toml")));
        assert_eq!(
            strip_gpushare_flags(&eq),
            vec![OsString::from("create"), OsString::from("x")]
        );
    }

    /// How dockerd runs a runtime entry with `runtimeArgs` (containerd's runc shim
    /// adds runc's global flags and the command after them).
    #[test]
    fn the_profile_flag_from_dockers_runtime_args_is_read_and_stripped() {
        for line in [
            "--gpushare-profile=high --root /var/run/docker/runtime-runc/moby --log /b/log.json \
             --log-format json create --bundle /b --pid-file /b/init.pid c1",
            "--gpushare-profile high --root /var/run/docker/runtime-runc/moby --log /b/log.json \
             --log-format json create --bundle /b --pid-file /b/init.pid c1",
            "-gpushare-profile=high --gpushare-config /etc/g.toml --root /var/run/docker/runtime-runc/moby \
             --log /b/log.json --log-format json create --bundle /b --pid-file /b/init.pid c1",
        ] {
            let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
            let inv = scan(&args);
            assert_eq!(inv.gpushare_profile.as_deref(), Some("high"), "{line}");
            assert_eq!(inv.subcommand.as_deref(), Some("create"), "{line}");
            assert_eq!(inv.container_id.as_deref(), Some("c1"), "{line}");
            assert_eq!(
                inv.namespace().key().as_deref(),
                Some("runtime-root:/var/run/docker/runtime-runc/moby")
            );
            assert_eq!(
                stripped(&args),
                "--root /var/run/docker/runtime-runc/moby --log /b/log.json --log-format json \
                 create --bundle /b --pid-file /b/init.pid c1",
                "{line}"
            );
        }
        // After the command it is the container's argument, not ours.
        let exec: Vec<OsString> = "exec --process p.json c1 --gpushare-profile high"
            .split_whitespace()
            .map(OsString::from)
            .collect();
        assert_eq!(scan(&exec).gpushare_profile, None);
        assert_eq!(strip_gpushare_flags(&exec), exec);
    }

    #[test]
    fn other_subcommands_and_empty() {
        assert_eq!(
            scan_str("--root /r delete --force abc")
                .subcommand
                .as_deref(),
            Some("delete")
        );
        assert_eq!(scan_str("--version").subcommand, None);
        assert_eq!(scan_str(""), Invocation::default());
    }
}
