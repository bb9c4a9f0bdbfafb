//! What a man page says beyond the command line: the files each program reads and
//! writes, the environment it reads, its signals, its exit statuses, examples and
//! related pages. Written from each program's code (the paths are the defaults of
//! gpushare's configuration), one table per binary; a subcommand's page shows its
//! binary's table, with the examples that run that subcommand.

/// One item of a section: a term (a path, a variable, a signal, a status) and what
/// it means for the program.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub term: &'static str,
    pub text: &'static str,
}

/// A section's content: items, or one sentence saying there is nothing to list.
#[derive(Debug, Clone, Copy)]
pub enum Section {
    Entries(&'static [Entry]),
    Nothing(&'static str),
}

/// A command line that works as shown, and what it does.
#[derive(Debug, Clone, Copy)]
pub struct Example {
    pub command: &'static str,
    pub text: &'static str,
}

/// The sections of one binary's pages after OPTIONS.
#[derive(Debug, Clone, Copy)]
pub struct Manual {
    pub files: Section,
    pub environment: Section,
    pub signals: Section,
    pub exit_status: Section,
    pub examples: &'static [Example],
    /// Other pages, as `name(section)`.
    pub see_also: &'static [&'static str],
}

const fn entry(term: &'static str, text: &'static str) -> Entry {
    Entry { term, text }
}

const fn example(command: &'static str, text: &'static str) -> Example {
    Example { command, text }
}

/// The configuration file as every program finds it.
const CONFIG_FILE: Entry = entry(
    "/etc/gpushare/config.toml",
    "gpushare's configuration, gpushare.toml(5), unless an option or $GPUSHARE_CONFIG names \
     another file; absent, every key has its default.",
);

const GPUSHARE_CONFIG: Entry = entry(
    "GPUSHARE_CONFIG",
    "The configuration file to read when no option names one (default \
     /etc/gpushare/config.toml).",
);

const GPUSHARE_LOG: Entry = entry(
    "GPUSHARE_LOG",
    "What is logged to standard error, as a tracing filter: a level (error, warn, info, debug, \
     trace) or per module (info,gpushare_arbiter::tokens=debug). Default info.",
);

const CONTROL_SOCKET: Entry = entry(
    "/run/gpushare/control.sock",
    "The arbiter's control socket, root only: arbiter.control_socket, by default \
     arbiter.run_dir/control.sock.",
);

/// Every page of gpushare lists the others.
const ALL_PAGES: &[&str] = &[
    "gpushare-arbiter(1)",
    "gpusharectl(1)",
    "gpushare-runc(1)",
    "gpushare-hook(1)",
    "containerd-shim-gpushare-v2(1)",
    "gpushare-kube(1)",
    "gpushare.toml(5)",
];

pub const ARBITER: Manual = Manual {
    files: Section::Entries(&[
        CONFIG_FILE,
        entry(
            "/run/gpushare",
            "arbiter.run_dir, a tmpfs rebuilt from the state directory after a reboot: the \
             control socket and leases/LEASE/arbiter.sock, each lease's own socket (mounted \
             into its container as /run/gpushare); paused, the processes stopped for \
             launching past their time-slice gate.",
        ),
        CONTROL_SOCKET,
        entry(
            "/var/lib/gpushare",
            "arbiter.state_dir, the durable lease records: leases.json and leases.log (written \
             before a lease is acknowledged), arbiter.lock (one arbiter per state directory), \
             and with memory.reclaim, reclaim.json, the checkpoint journal.",
        ),
    ]),
    environment: Section::Entries(&[
        GPUSHARE_CONFIG,
        GPUSHARE_LOG,
        entry(
            "NOTIFY_SOCKET",
            "Set by systemd (Type=notify): the arbiter reports READY=1 there once its control \
             socket is served and its leases recovered, and STOPPING=1 when it stops.",
        ),
        entry(
            "CUDA_MPS_PIPE_DIRECTORY",
            "Where the host's MPS control daemon listens (default /tmp/nvidia-mps), as the MPS \
             tools read it: a GPU under MPS is reported unshareable.",
        ),
        entry(
            "GPUSHARE_FAULT_RECLAIM",
            "For the fault tests only: ends the daemon at a named step of a memory reclaim. \
             Never set it on a node.",
        ),
    ]),
    signals: Section::Entries(&[
        entry(
            "SIGHUP",
            "Reload the configuration file (systemctl reload gpushare-arbiter): what can change \
             live is applied, each changed key that needs a restart is named in the log and \
             keeps its running value. gpushare.toml(5) says which keys are which.",
        ),
        entry(
            "SIGTERM, SIGINT",
            "Stop: the control socket is removed, the lease table made durable, and the daemon \
             exits 0. Leases stay on disk for the next start; running containers keep their \
             GPUs.",
        ),
    ]),
    exit_status: Section::Entries(&[
        entry(
            "0",
            "Stopped by SIGTERM or SIGINT; check-config: the file is valid.",
        ),
        entry(
            "1",
            "The daemon could not start or failed (the reason on standard error): a refused \
             configuration, another arbiter holding the state directory, a socket that cannot \
             be bound. check-config: the file has problems, each listed.",
        ),
        entry(
            "2",
            "check-config: the file cannot be read; or a command line clap refuses.",
        ),
    ]),
    examples: &[
        example(
            "systemctl reload gpushare-arbiter",
            "Apply an edited configuration file (sends SIGHUP).",
        ),
        example(
            "gpushare-arbiter check-config /etc/gpushare/config.toml",
            "Check the file as every component reads it before the daemon is reloaded.",
        ),
        example(
            "GPUSHARE_LOG=info,gpushare_arbiter::tokens=debug gpushare-arbiter --config /tmp/test.toml",
            "Run a second arbiter in the foreground, with its own configuration (its own \
             run_dir and state_dir), logging the token service in detail.",
        ),
    ],
    see_also: ALL_PAGES,
};

pub const CTL: Manual = Manual {
    files: Section::Entries(&[
        CONFIG_FILE,
        CONTROL_SOCKET,
        entry(
            "/etc/docker/daemon.json, /etc/containerd/config.toml, /etc/containers/containers.conf, /etc/crio/crio.conf.d/50-gpushare.conf",
            "setup: the engine's configuration file it edits when --config names no other; the \
             file as it was is kept beside it as FILE.gpushare-backup until setup --undo.",
        ),
    ]),
    environment: Section::Entries(&[GPUSHARE_CONFIG]),
    signals: Section::Nothing(
        "gpusharectl handles no signals of its own: top redraws until SIGINT (Ctrl-C) ends it; \
         a reader that goes away (| head) ends any command quietly, with status 0.",
    ),
    exit_status: Section::Entries(&[
        entry("0", "Done; check-config: the file is valid."),
        entry(
            "1",
            "Failed, the reason on standard error (no arbiter at the socket, an unknown lease \
             or GPU, an engine file setup cannot edit); check-config: the file has problems.",
        ),
        entry("2", "check-config: the file cannot be read; or a command line clap refuses."),
    ]),
    examples: &[
        example(
            "gpusharectl status",
            "Each GPU with its containers, what waits and what is wrong.",
        ),
        example("gpusharectl list --json", "The leases, as JSON."),
        example(
            "gpusharectl check-config /etc/gpushare/config.toml",
            "Check gpushare's configuration file without an arbiter.",
        ),
        example(
            "gpusharectl release 3f9c2a41",
            "Release a lease by the id list shows (releasing it twice is not an error).",
        ),
        example(
            "gpusharectl drain 0",
            "Place no new leases on GPU 0; its leases stay.",
        ),
        example("gpusharectl undrain 0", "Place leases on GPU 0 again."),
        example(
            "gpusharectl setup docker --dry-run",
            "Show the daemon.json that would add gpushare's runtime; change nothing.",
        ),
        example(
            "gpusharectl setup containerd --config /etc/containerd/config.toml --set-as-default",
            "Add gpushare's runtime to containerd's configuration file (here named with \
             --config, the engine's file) and make it the default runtime; restart containerd \
             afterwards.",
        ),
        example(
            "gpusharectl setup docker --undo",
            "Take gpushare's runtime out of daemon.json again.",
        ),
        example(
            "gpusharectl top --once",
            "One frame of the live view, without terminal control codes.",
        ),
        example(
            "gpusharectl timeline --since 60 --svg /tmp/tokens.svg",
            "Who held each GPU's time-slice token in the last minute, also as an SVG chart.",
        ),
    ],
    see_also: ALL_PAGES,
};

pub const RUNC: Manual = Manual {
    files: Section::Entries(&[
        CONFIG_FILE,
        CONTROL_SOCKET,
        entry(
            "BUNDLE/config.json",
            "create and run: the container's OCI spec, edited in place (gpushare's library, the \
             lease's socket, its environment and hooks) before the runtime reads it.",
        ),
        entry(
            "/usr/local/lib/gpushare/libgpushare.so",
            "runtime.library: the interposer mounted read-only into the containers that ask for \
             a share.",
        ),
    ]),
    environment: Section::Entries(&[
        GPUSHARE_CONFIG,
        entry(
            "PATH",
            "Where the runtimes of runtime.runtimes (nvidia-container-runtime, runc) are looked \
             for, when not named by an absolute path.",
        ),
    ]),
    signals: Section::Nothing(
        "gpushare-runc handles no signals of its own: it hands every command but create, run \
         and exec to the runtime by exec(2), so the runtime receives them; a create whose \
         wrapper is killed is undone by a forked guard that notices its death.",
    ),
    exit_status: Section::Entries(&[
        entry("0", "The runtime succeeded."),
        entry(
            "1",
            "gpushare refused the container or failed (the reason on standard error and in the \
             runtime's log).",
        ),
        entry(
            "other",
            "The runtime's own exit status, passed on (128 + N when it died of signal N).",
        ),
    ]),
    examples: &[
        example(
            "gpusharectl setup docker",
            "Register gpushare-runc with docker, which then runs it as \
             gpushare-runc --root ... create --bundle DIR ID.",
        ),
        example(
            "docker run --runtime gpushare -e GPUSHARE_MEMORY=2Gi IMAGE",
            "Start a container through it with a 2 GiB share of a GPU.",
        ),
        example(
            "gpushare-runc --version",
            "gpushare-runc's version line, then the runtime's.",
        ),
    ],
    see_also: ALL_PAGES,
};

pub const HOOK: Manual = Manual {
    files: Section::Entries(&[CONFIG_FILE, CONTROL_SOCKET]),
    environment: Section::Entries(&[GPUSHARE_CONFIG]),
    signals: Section::Nothing("gpushare-hook handles no signals of its own."),
    exit_status: Section::Entries(&[
        entry("0", "Done."),
        entry(
            "1",
            "The stage failed or refused the container, the reason on standard error, which \
             podman and runc show; fail always exits 1.",
        ),
        entry("2", "A command line clap refuses."),
    ]),
    examples: &[
        example(
            "gpushare-hook precreate < config.json > edited.json",
            "What podman runs from its hooks.d/gpushare.json: the spec in, \
             the spec with gpushare's edits out.",
        ),
        example(
            "gpushare-hook create-runtime < state.json",
            "What runc runs from the edited spec's createRuntime hook: confirms the lease with \
             the container's pid.",
        ),
        example(
            "gpushare-hook poststop < state.json",
            "What runc runs from the spec's poststop hook: releases the container's lease.",
        ),
        example(
            "gpushare-hook fail --message 'no GPU fits 40Gi'",
            "Fail with the message, as a refused precreate makes runc report it.",
        ),
    ],
    see_also: ALL_PAGES,
};

pub const SHIM: Manual = Manual {
    files: Section::Entries(&[
        CONFIG_FILE,
        CONTROL_SOCKET,
        entry(
            "/etc/containerd/config.toml",
            "containerd's configuration: the runtime io.containerd.gpushare.v2 \
             (gpusharectl setup containerd) makes containerd start this shim.",
        ),
    ]),
    environment: Section::Entries(&[
        GPUSHARE_CONFIG,
        entry(
            "GPUSHARE_RUNC_SHIM",
            "The runc shim to start (default: containerd-shim-runc-v2 found on PATH).",
        ),
        entry(
            "PATH",
            "Where containerd-shim-runc-v2 is found when GPUSHARE_RUNC_SHIM names none.",
        ),
        entry(
            "GPUSHARE_SHIM_RUNC_ADDRESS, GPUSHARE_SHIM_RUNC_TASK_API",
            "Set by the shim's start action for the serving shim it spawns: where the runc \
             shim it started serves, and which task API that one speaks.",
        ),
    ]),
    signals: Section::Entries(&[entry(
        "SIGTERM, SIGINT",
        "Caught and ignored (containerd's shim library): containerd ends the shim with the \
         task API's Shutdown call, or SIGKILL.",
    )]),
    exit_status: Section::Entries(&[
        entry(
            "0",
            "Done (start, delete, -v, -h), or served until Shutdown.",
        ),
        entry(
            "1",
            "A flag the shim does not know, or the action failed (the reason on standard error).",
        ),
    ]),
    examples: &[
        example(
            "ctr run --runtime io.containerd.gpushare.v2 --env GPUSHARE_MEMORY=2Gi IMAGE ID",
            "Start a container through the shim with a 2 GiB share of a GPU; containerd starts \
             the shim.",
        ),
        example(
            "containerd-shim-gpushare-v2 -v",
            "The shim's version, its runtime name and the runc shim it decorates.",
        ),
    ],
    see_also: ALL_PAGES,
};

pub const KUBE: Manual = Manual {
    files: Section::Entries(&[
        CONFIG_FILE,
        CONTROL_SOCKET,
        entry(
            "/var/lib/kubelet/device-plugins",
            "kubernetes.device_plugin_dir: kubelet's registration socket kubelet.sock and the \
             plugin's own sockets.",
        ),
        entry(
            "/var/lib/kubelet/pod-resources/kubelet.sock",
            "kubernetes.pod_resources_socket: which pods hold which devices, to collect grants \
             no pod holds.",
        ),
    ]),
    environment: Section::Entries(&[GPUSHARE_CONFIG, GPUSHARE_LOG]),
    signals: Section::Entries(&[entry("SIGTERM, SIGINT", "Stop serving kubelet and exit 0.")]),
    exit_status: Section::Entries(&[
        entry("0", "Stopped by SIGTERM or SIGINT."),
        entry(
            "1",
            "The configuration was refused or the plugin could not start (the reason on \
             standard error).",
        ),
        entry("2", "A command line clap refuses."),
    ]),
    examples: &[
        example(
            "gpushare-kube --config /etc/gpushare/config.toml",
            "Serve kubelet as a device plugin (normally a DaemonSet's container on each GPU \
             node).",
        ),
        example(
            "GPUSHARE_LOG=debug gpushare-kube",
            "The same, logging each Allocate and collected grant.",
        ),
    ],
    see_also: ALL_PAGES,
};

/// The table of the binary `program`, or `None` for one gpushare does not ship.
pub fn of(program: &str) -> Option<&'static Manual> {
    Some(match program {
        "gpushare-arbiter" => &ARBITER,
        "gpusharectl" => &CTL,
        "gpushare-runc" => &RUNC,
        "gpushare-hook" => &HOOK,
        "containerd-shim-gpushare-v2" => &SHIM,
        "gpushare-kube" => &KUBE,
        _ => return None,
    })
}

/// The examples of `manual` a subcommand's page shows: those that run `path`
/// (`["gpusharectl", "setup"]`), whole words only.
pub fn examples_running<'a>(manual: &'a Manual, path: &[&str]) -> Vec<&'a Example> {
    manual
        .examples
        .iter()
        .filter(|example| {
            let words: Vec<&str> = example
                .command
                .split_whitespace()
                .skip_while(|word| word.contains('='))
                .collect();
            words.starts_with(path)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_are_picked_by_whole_words_after_the_environment() {
        const EXAMPLES: &[Example] = &[
            example("gpusharectl setup docker", ""),
            example("gpusharectl setups", ""),
            example("GPUSHARE_LOG=debug gpusharectl setup podman", ""),
            example("gpusharectl status", ""),
        ];
        let manual = Manual {
            examples: EXAMPLES,
            ..CTL
        };
        let picked = |path: &[&str]| -> Vec<&str> {
            examples_running(&manual, path)
                .iter()
                .map(|e| e.command)
                .collect()
        };
        assert_eq!(
            picked(&["gpusharectl", "setup"]),
            [
                "gpusharectl setup docker",
                "GPUSHARE_LOG=debug gpusharectl setup podman"
            ]
        );
        assert_eq!(picked(&["gpusharectl", "status"]), ["gpusharectl status"]);
        assert!(picked(&["gpusharectl", "top"]).is_empty());
        assert_eq!(picked(&["gpusharectl"]).len(), 4);
    }
}
