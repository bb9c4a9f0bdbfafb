//! The error-message review. Every failure a user commonly meets (a bad
//! request value, a misspelt key or variable, a request no GPU can hold, the
//! arbiter down, a non-root gpusharectl), through every entry point (docker with
//! gpushare-runc, ctr with the shim, ctr with `--runc-binary gpushare-runc`, podman
//! with the precreate hook, containerd's CRI plugin with each of the two handlers),
//! captured exactly as the user sees it: the engine's stderr, or the CRI status
//! message kubelet shows. Each message must name what the user needs (the key, the
//! value, what is accepted), carry no Go format garbage (`%!…(MISSING)`), repeat
//! no fragment, and blame the real cause.
//!
//! Every captured message goes into a transcript a person can read at once:
//! target/error-messages.md always, and docs/error-messages.md as well when
//! GPUSHARE_WRITE_ERROR_TRANSCRIPT=1 (how the committed copy is made).
//!
//! One private arbiter (one 16Gi GPU) and one daemon per engine serve all cases:
//! the engines start at once, the cases of a phase run on every engine at once.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpushare_cri::api;
use gpushare_cri::image::{self, ImageConfig};
use gpushare_e2e::containerd::{Containerd, ContainerdOptions, RUNC_RUNTIME, RUNTIME};
use gpushare_e2e::cri::{self as node, CriNode, Entry, SNAPSHOTTER};
use gpushare_e2e::*;

/// The CRI handler that runs gpushare-runc as runc's BinaryName, beside
/// `node::HANDLER` (the shim).
const RUNC_HANDLER: &str = "gpushare-runc";

/// What a user did wrong (or met), and what the message must then say.
struct Case {
    name: &'static str,
    what: &'static str,
    annotations: &'static [(&'static str, &'static str)],
    env: &'static [(&'static str, &'static str)],
    /// Fragments the message must contain (the key, the value, what is accepted).
    names: &'static [&'static str],
    /// Where the memory asked for is above what the environment may ask, what
    /// an entry point that can ask only through variables (docker 20.10) must say
    /// instead: the ceiling, and the ways to more.
    names_through_environment: Option<&'static [&'static str]>,
    /// Whether the arbiter being down is the true cause.
    arbiter_down: bool,
}

const INVALID_ANNOTATION_VALUE: Case = Case {
    name: "invalid-annotation-value",
    what: "an annotation value that is no quantity: gpushare.io/memory=lots",
    annotations: &[("gpushare.io/memory", "lots")],
    env: &[],
    names: &["gpushare.io/memory", "\"lots\"", "512Mi", "0.4"],
    names_through_environment: None,
    arbiter_down: false,
};

const INVALID_VARIABLE_VALUE: Case = Case {
    name: "invalid-variable-value",
    what: "a variable value that is no quantity: GPUSHARE_MEMORY=lots",
    annotations: &[],
    env: &[("GPUSHARE_MEMORY", "lots")],
    names: &["GPUSHARE_MEMORY", "\"lots\"", "512Mi", "0.4"],
    names_through_environment: None,
    arbiter_down: false,
};

const UNKNOWN_ANNOTATION_KEY: Case = Case {
    name: "unknown-annotation-key",
    what: "a misspelt annotation key: gpushare.io/memroy=1Gi",
    annotations: &[("gpushare.io/memroy", "1Gi")],
    env: &[],
    names: &["gpushare.io/memroy", "accepted keys", "gpushare.io/memory"],
    names_through_environment: None,
    arbiter_down: false,
};

const UNKNOWN_VARIABLE: Case = Case {
    name: "unknown-variable",
    what: "a misspelt variable: GPUSHARE_MEMROY=4Gi",
    annotations: &[],
    env: &[("GPUSHARE_MEMROY", "4Gi")],
    names: &[
        "GPUSHARE_MEMROY",
        "\"4Gi\"",
        "did you mean GPUSHARE_MEMORY?",
        "accepted keys",
        "requests.allowed_env",
    ],
    names_through_environment: None,
    arbiter_down: false,
};

const LARGER_THAN_ANY_GPU: Case = Case {
    name: "larger-than-any-gpu",
    what: "more memory than any GPU has: gpushare.io/memory=64Gi on 16Gi GPUs",
    annotations: &[("gpushare.io/memory", "64Gi")],
    env: &[],
    names: &["memory 64", "more than any candidate GPU has", "16"],
    names_through_environment: Some(&[
        "GPUSHARE_MEMORY=\"64Gi\"",
        "requests.env_memory_ceiling",
        "gpushare.io/memory annotation",
        "runtime.profiles",
    ]),
    arbiter_down: false,
};

const BELOW_PROCESS_OVERHEAD: Case = Case {
    name: "below-process-overhead",
    what: "a quota that cannot hold one CUDA process: gpushare.io/memory=100Mi",
    annotations: &[("gpushare.io/memory", "100Mi")],
    env: &[],
    names: &[
        "memory 100",
        "arbiter.context_memory_estimate",
        "ask for more",
    ],
    names_through_environment: None,
    arbiter_down: false,
};

const FIRST_PHASE: [&Case; 6] = [
    &INVALID_ANNOTATION_VALUE,
    &INVALID_VARIABLE_VALUE,
    &UNKNOWN_ANNOTATION_KEY,
    &UNKNOWN_VARIABLE,
    &LARGER_THAN_ANY_GPU,
    &BELOW_PROCESS_OVERHEAD,
];

/// Run while another container holds 12Gi of the 16Gi GPU.
const NO_ROOM_NOW: Case = Case {
    name: "no-room-now",
    what: "a quota the GPU cannot hold now: gpushare.io/memory=8Gi while another container holds 12Gi of 16Gi",
    annotations: &[("gpushare.io/memory", "8Gi")],
    env: &[],
    names: &["no GPU can take", "free", "wanted"],
    names_through_environment: Some(&[
        "GPUSHARE_MEMORY=\"8Gi\"",
        "requests.env_memory_ceiling",
        "gpushare.io/memory annotation",
        "runtime.profiles",
    ]),
    arbiter_down: false,
};

/// Run once the arbiter is stopped.
const ARBITER_DOWN: Case = Case {
    name: "arbiter-down",
    what: "a request while gpushare-arbiter is not running: gpushare.io/memory=1Gi",
    annotations: &[("gpushare.io/memory", "1Gi")],
    env: &[],
    names: &[
        "cannot reach the gpushare arbiter: its socket",
        "control.sock does not exist",
        "is gpushare-arbiter running?",
    ],
    names_through_environment: None,
    arbiter_down: true,
};

/// One captured message.
struct Captured {
    case: &'static str,
    entry: &'static str,
    /// Whether the entry point asked through variables alone.
    through_environment: bool,
    command: String,
    message: String,
}

/// An entry point: how a user reaches gpushare through it, and what they see.
trait EntryPoint: Sync {
    fn name(&self) -> &'static str;
    /// Runs `case` through this entry point: the command line as the user would
    /// type it, and the message they see; None where this entry point has no way
    /// to make the mistake.
    fn attempt(&self, n: usize, case: &Case) -> Option<(String, String)>;
    /// Whether this entry point can ask only through variables.
    fn asks_through_environment(&self) -> bool {
        false
    }
}

/// Written in place of a message where the container ran: a fault, with the rest.
const RAN: &str = "<no error: the container ran>";

/// What the user saw of a failed command: its stderr.
fn failed(out: &Output) -> String {
    if out.status.success() {
        return RAN.to_owned();
    }
    String::from_utf8_lossy(&out.stderr).trim_end().to_owned()
}

struct Docker(Dockerd);

impl EntryPoint for Docker {
    fn name(&self) -> &'static str {
        "docker (gpushare-runc)"
    }
    fn asks_through_environment(&self) -> bool {
        true
    }
    fn attempt(&self, _: usize, case: &Case) -> Option<(String, String)> {
        // dockerd 20.10 puts no annotations into the spec: its users ask with the
        // variables (gpushare.io/memory → GPUSHARE_MEMORY). A mistake in an
        // annotation's key or wording cannot be made here.
        if case.names.iter().any(|n| n.contains("gpushare.io/")) {
            return None;
        }
        let variables = case.annotations.iter().map(|(k, v)| {
            let key = k.trim_start_matches("gpushare.io/").to_uppercase();
            format!("GPUSHARE_{key}={v}")
        });
        let env: Vec<String> = variables
            .chain(case.env.iter().map(|(k, v)| format!("{k}={v}")))
            .collect();
        let mut args = vec!["run", "--rm", "--runtime", "gpushare"];
        for e in &env {
            args.extend(["-e", e]);
        }
        args.extend([IMAGE, "true"]);
        let out = self.0.docker(&args);
        Some((format!("docker {}", args.join(" ")), failed(&out)))
    }
}

/// ctr with the shim, or with `--runc-binary gpushare-runc` under runc's shim.
struct Ctr<'a> {
    containerd: &'a Containerd,
    runc_binary: Option<PathBuf>,
}

impl EntryPoint for Ctr<'_> {
    fn name(&self) -> &'static str {
        match self.runc_binary {
            None => "ctr (containerd-shim-gpushare-v2)",
            Some(_) => "ctr --runc-binary gpushare-runc",
        }
    }
    fn attempt(&self, n: usize, case: &Case) -> Option<(String, String)> {
        let binary = self
            .runc_binary
            .as_ref()
            .map(|b| b.to_str().unwrap().to_owned());
        let pairs: Vec<String> = case
            .annotations
            .iter()
            .chain(case.env)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut pair = pairs.iter();
        let mut flags: Vec<&str> = vec!["--rm"];
        if let Some(binary) = &binary {
            flags.extend(["--runc-binary", binary]);
        }
        for _ in case.annotations {
            flags.extend(["--annotation", pair.next().unwrap()]);
        }
        for _ in case.env {
            flags.extend(["--env", pair.next().unwrap()]);
        }
        let runtime = if binary.is_some() {
            RUNC_RUNTIME
        } else {
            RUNTIME
        };
        let id = format!("{}-{n}", if binary.is_some() { "runc" } else { "shim" });
        let args = self
            .containerd
            .run_args(runtime, &flags, &id, &["/bin/true"]);
        let out = self.containerd.ctr(&args);
        let shown = format!("ctr {}", args.join(" "))
            .replace(self.containerd.rootfs.to_str().unwrap(), "<rootfs>");
        Some((shown, failed(&out)))
    }
}

struct Podman(gpushare_e2e::Podman);

impl EntryPoint for Podman {
    fn name(&self) -> &'static str {
        "podman (precreate hook)"
    }
    fn attempt(&self, _: usize, case: &Case) -> Option<(String, String)> {
        // The shipped hooks.d entry runs the hook only for a container with a
        // gpushare.io/ annotation: a variable alone is never seen on this path, so
        // a variable's case is tried beside an annotation that asks for nothing
        // the variable does (an annotation wins over its variable).
        let annotations: Vec<(&str, &str)> = match case.annotations {
            [] => vec![("gpushare.io/priority", "low")],
            some => some.to_vec(),
        };
        let pairs: Vec<String> = annotations
            .iter()
            .chain(case.env)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut pair = pairs.iter();
        let mut args = vec!["run", "--rm", "--network", "none"];
        for _ in &annotations {
            args.extend(["--annotation", pair.next().unwrap()]);
        }
        for _ in case.env {
            args.extend(["-e", pair.next().unwrap()]);
        }
        args.extend([PODMAN_IMAGE, "true"]);
        let out = self.0.podman(&args);
        Some((format!("podman {}", args.join(" ")), failed(&out)))
    }
}

/// containerd's CRI plugin, played as kubelet: the request on the pod (as a pod's
/// annotations reach the CRI), variables on the container; kubelet shows the
/// failed call's status message.
struct Cri<'a> {
    node: &'a CriNode,
    handler: &'static str,
}

impl EntryPoint for Cri<'_> {
    fn name(&self) -> &'static str {
        match self.handler {
            node::HANDLER => "CRI (containerd-shim-gpushare-v2)",
            _ => "CRI (gpushare-runc as BinaryName)",
        }
    }
    fn attempt(&self, n: usize, case: &Case) -> Option<(String, String)> {
        let cri = &self.node.cri;
        let annotations: HashMap<String, String> = case
            .annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let uid = format!("c6a3c9a2-0019-4000-8000-{:012}", n);
        let pod_name = format!("{}-{n}", self.handler);
        let pod_config = gpushare_cri::host_network_pod(&pod_name, "default", &uid, annotations);
        let pod = cri
            .run_pod_sandbox(&pod_config, self.handler)
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}{}", self.node.log()));
        let mut config = gpushare_cri::container("app", node::IMAGE, &["/bin/true"]);
        config.envs = case
            .env
            .iter()
            .map(|(k, v)| api::KeyValue {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect();
        let outcome = cri
            .create_container(&pod, &config, &pod_config)
            .and_then(|id| cri.start_container(&id));
        let _ = cri.stop_pod_sandbox(&pod);
        let _ = cri.remove_pod_sandbox(&pod);
        let message = match &outcome {
            Ok(()) => RAN.to_owned(),
            Err(gpushare_cri::CriError::Call { rpc, status }) => {
                format!("{rpc}: {}", status.message())
            }
            Err(other) => panic!("not a refusal: {other}"),
        };
        let mut shown = format!(
            "pod {pod_name} (runtimeClassName → handler {})",
            self.handler
        );
        for (k, v) in case.annotations {
            shown.push_str(&format!(", annotation {k}={v}"));
        }
        for (k, v) in case.env {
            shown.push_str(&format!(", container env {k}={v}"));
        }
        Some((shown, message))
    }
}

/// containerd with its CRI plugin and both gpushare handlers: the shim's
/// (`node::HANDLER`) and gpushare-runc's (`RUNC_HANDLER`); ctr uses it too.
fn cri_node(dir: &Path, gpushare_config: &Path) -> CriNode {
    let runc_handler = node::handler_config(Entry::RuncBinary, dir)
        .replace(
            &format!("runtimes.{}]", node::HANDLER),
            &format!("runtimes.{RUNC_HANDLER}]"),
        )
        .replace(
            &format!("runtimes.{}.options]", node::HANDLER),
            &format!("runtimes.{RUNC_HANDLER}.options]"),
        );
    let extra = format!("{}{runc_handler}", node::cri_config(Entry::Shim, dir));
    let ctr = Containerd::start(
        dir,
        gpushare_config,
        ContainerdOptions {
            extra_config: &extra,
            cri: true,
        },
    );
    let archive = dir.join("image.tar");
    image::write_archive(
        &ctr.rootfs,
        &ImageConfig {
            name: node::IMAGE,
            cmd: &["/bin/sleep", "3600"],
        },
        &dir.join("image-layout"),
        &archive,
    )
    .unwrap();
    image::import(&ctr.address, &archive, SNAPSHOTTER).unwrap();
    let cri = gpushare_cri::Cri::connect(&ctr.address).unwrap();
    CriNode { cri, ctr }
}

/// The same clause twice in one message: ", " and ": " and "; " separate clauses;
/// short ones ("unknown", a key) may well recur.
fn repeated_clause(message: &str) -> Option<String> {
    let mut seen = BTreeMap::new();
    for clause in message
        .split([':', ';', '\n'])
        .map(str::trim)
        .filter(|c| c.len() >= 24)
    {
        *seen.entry(clause).or_insert(0) += 1;
    }
    seen.into_iter()
        .find(|&(_, n)| n > 1)
        .map(|(c, _)| c.to_owned())
}

/// What every message must be, and what this case's must say.
fn check(captured: &Captured, case: &Case) -> Vec<String> {
    let message = captured.message.replace("\\\"", "\"");
    let mut faults = Vec::new();
    if message == RAN {
        faults.push("the container ran".to_owned());
    }
    for garbage in ["%!", "(MISSING)", "%%"] {
        if message.contains(garbage) {
            faults.push(format!("Go format garbage {garbage:?}"));
        }
    }
    let names = match case.names_through_environment {
        Some(names) if captured.through_environment => names,
        _ => case.names,
    };
    for part in names {
        if !message.contains(part) {
            faults.push(format!("does not say {part:?}"));
        }
    }
    let mut os_errors: Vec<&str> = message
        .match_indices("(os error ")
        .map(|(i, _)| &message[i..message[i..].find(')').map_or(message.len(), |j| i + j)])
        .collect();
    os_errors.sort_unstable();
    if os_errors.windows(2).any(|w| w[0] == w[1]) {
        faults.push("the same (os error N) twice".to_owned());
    }
    if let Some(clause) = repeated_clause(&message) {
        faults.push(format!("repeats {clause:?}"));
    }
    if !case.arbiter_down && message.contains("is gpushare-arbiter running") {
        faults.push("blames the arbiter, which is running".to_owned());
    }
    // podman's reading of "no such file or directory" anywhere in a hook's message.
    if message.contains("attempted to invoke a command that was not found") {
        faults.push("blames a missing runtime binary".to_owned());
    }
    if !message.contains("gpushare") {
        faults.push("does not say it comes from gpushare".to_owned());
    }
    faults
        .into_iter()
        .map(|f| {
            format!(
                "{} / {}: {f}:\n{}",
                captured.entry, case.name, captured.message
            )
        })
        .collect()
}

/// Runs `cases` on every entry point at once; the messages in case order.
fn run_phase(entries: &[&dyn EntryPoint], cases: &[&Case], first: usize) -> Vec<Captured> {
    std::thread::scope(|scope| {
        let runs: Vec<_> = entries
            .iter()
            .map(|entry| {
                scope.spawn(move || {
                    cases
                        .iter()
                        .enumerate()
                        .filter_map(|(i, case)| {
                            let (command, message) = entry.attempt(first + i, case)?;
                            Some(Captured {
                                case: case.name,
                                entry: entry.name(),
                                through_environment: entry.asks_through_environment(),
                                command,
                                message,
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<Captured> = runs.into_iter().flat_map(|r| r.join().unwrap()).collect();
        all.sort_by_key(|c| cases.iter().position(|k| k.name == c.case));
        all
    })
}

/// `gpusharectl status`, as root or as `nobody`.
fn gpusharectl(arbiter: &Arbiter, as_nobody: bool) -> Captured {
    let ctl = bin("gpusharectl");
    let mut command = if as_nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&ctl);
        c
    } else {
        Command::new(&ctl)
    };
    command
        .arg("--config")
        .arg(&arbiter.config_path)
        .arg("status");
    let out = command.output().expect("run gpusharectl");
    Captured {
        case: if as_nobody {
            "gpusharectl-not-root"
        } else {
            "arbiter-down"
        },
        entry: "gpusharectl",
        through_environment: false,
        command: format!(
            "{}gpusharectl status",
            if as_nobody { "(as nobody) " } else { "" }
        ),
        message: failed(&out),
    }
}

const NOT_ROOT: Case = Case {
    name: "gpusharectl-not-root",
    what: "gpusharectl run by a user who may not use the control socket (the arbiter is running)",
    annotations: &[],
    env: &[],
    names: &["permission denied on", "control.sock", "root"],
    names_through_environment: None,
    arbiter_down: false,
};

/// The transcript: one section per case, each entry point's message verbatim
/// (the scratch directory's path replaced, so that a rerun writes the same text
/// where the engines do).
fn transcript(captured: &[Captured], cases: &[&Case], dir: &Path) -> String {
    let mut text = String::from(
        "# Error messages, as users see them\n\n\
         Generated by `tests/e2e/tests/error_messages.rs` \
         (`GPUSHARE_WRITE_ERROR_TRANSCRIPT=1 cargo test -p gpushare-e2e --test error_messages`): \
         each failure a user commonly meets, through each entry point, exactly as the \
         engine printed it (docker, ctr, podman: stderr; CRI: the status message of the \
         failed call, which kubelet shows in the pod's events). `$DIR` is the test's \
         private directory and `$BIN` the directory of the gpushare binaries under test; ids and timestamps differ from run to run.\n",
    );
    for case in cases {
        text.push_str(&format!("\n## {}\n\n{}.\n", case.name, case.what));
        for c in captured.iter().filter(|c| c.case == case.name) {
            text.push_str(&format!(
                "\n### {}\n\n```\n$ {}\n{}\n```\n",
                c.entry, c.command, c.message
            ));
        }
    }
    text.replace(dir.to_str().unwrap(), "$DIR")
        .replace(bin_dir().to_str().unwrap(), "$BIN")
}

#[test]
fn every_entry_points_messages_name_the_cause_once_and_without_garbage() {
    require_root();
    let dir = scratch();
    let sub = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let (docker_dir, containerd_dir) = (sub("d"), sub("c"));
    let mut arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions {
            gpus: 1,
            memory: "16Gi",
            // Through the simulated driver's NVML, as on a real node: the arbiter
            // then accounts a CUDA process's own overhead (the 100Mi case).
            simulated_driver: Some("12020"),
            configure: Some(Box::new(|config: &mut Config| {
                // The no-room case waits this long in the admission queue.
                config.arbiter.admission_wait_ms = 1500;
            })),
        },
    );
    let config = arbiter.config_path.clone();
    let (docker, node, podman) = std::thread::scope(|scope| {
        let docker = scope.spawn(|| Docker(Dockerd::start(&docker_dir, &config)));
        let node = scope.spawn(|| cri_node(&containerd_dir, &config));
        let podman = scope.spawn(|| Podman(gpushare_e2e::Podman::start(dir.path(), &config)));
        (
            docker.join().unwrap(),
            node.join().unwrap(),
            podman.join().unwrap(),
        )
    });
    let shim = Ctr {
        containerd: &node.ctr,
        runc_binary: None,
    };
    let runc_binary = Ctr {
        containerd: &node.ctr,
        runc_binary: Some(bin("gpushare-runc")),
    };
    let cri_shim = Cri {
        node: &node,
        handler: node::HANDLER,
    };
    let cri_runc = Cri {
        node: &node,
        handler: RUNC_HANDLER,
    };
    let entries: [&dyn EntryPoint; 6] =
        [&docker, &shim, &runc_binary, &podman, &cri_shim, &cri_runc];

    let mut captured = run_phase(&entries, &FIRST_PHASE, 0);
    captured.push(gpusharectl(&arbiter, true));
    assert!(arbiter.leases().is_empty(), "{:#?}", arbiter.leases());

    // Another container holds 12Gi of the GPU's 16Gi.
    node.ctr.ok(&node.ctr.run_args(
        RUNTIME,
        &["-d", "--annotation", "gpushare.io/memory=12Gi"],
        "holder",
        &["/bin/sleep", "600"],
    ));
    captured.extend(run_phase(&entries, &[&NO_ROOM_NOW], FIRST_PHASE.len()));
    assert_eq!(arbiter.leases().len(), 1, "{:#?}", arbiter.leases());

    arbiter.stop();
    captured.extend(run_phase(&entries, &[&ARBITER_DOWN], FIRST_PHASE.len() + 1));
    captured.push(gpusharectl(&arbiter, false));

    let cases: Vec<&Case> = FIRST_PHASE
        .iter()
        .copied()
        .chain([&NO_ROOM_NOW, &ARBITER_DOWN, &NOT_ROOT])
        .collect();
    let text = transcript(&captured, &cases, dir.path());
    let target = gpushare_testkit::binaries::bin_dir().join("../error-messages.md");
    std::fs::write(&target, &text).unwrap();
    if std::env::var_os("GPUSHARE_WRITE_ERROR_TRANSCRIPT").is_some_and(|v| v == "1") {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/error-messages.md");
        std::fs::write(docs, &text).unwrap();
    }

    let faults: Vec<String> = captured
        .iter()
        .flat_map(|c| check(c, cases.iter().find(|k| k.name == c.case).unwrap()))
        .collect();
    assert!(
        faults.is_empty(),
        "{} message faults (transcript: {}):\n\n{}",
        faults.len(),
        target.display(),
        faults.join("\n\n")
    );
    // Every case through every entry point, but docker's two annotation mistakes
    // (gpusharectl: two of its own).
    assert_eq!(
        captured.len(),
        entries.len() * (FIRST_PHASE.len() + 2) - 2 + 2
    );
    drop(node);
    drop(docker);
    drop(podman);
}

/// The checks catch what the review found before its fixes (messages as they
/// were then), and pass what is right.
#[test]
fn the_checks_catch_the_faults_the_review_found() {
    let faults = |case: &Case, message: &str| {
        check(
            &Captured {
                case: case.name,
                entry: "test",
                through_environment: false,
                command: String::new(),
                message: message.to_owned(),
            },
            case,
        )
    };
    let before = [
        (
            &INVALID_ANNOTATION_VALUE,
            "ctr: failed to create shim task: gpushare: invalid gpushare request gpushare.io/memory=\"lots\": \
             expected bytes with a unit (512Mi, 8Gi, 8G, 1073741824) or a fraction of the GPU greater \
             than 0 and at most 1 (0.4, 40%!)(MISSING): invalid argument",
            "Go format garbage",
        ),
        (
            &ARBITER_DOWN,
            "gpusharectl: cannot reach the gpushare arbiter: its socket /run/gpushare/control.sock does not \
             exist (os error 2) (is gpushare-arbiter running?): No such file or directory (os error 2)",
            "the same (os error N) twice",
        ),
        (
            &NOT_ROOT,
            "gpusharectl: cannot reach the gpushare arbiter at /run/gpushare/control.sock: Permission \
             denied (os error 13) (is gpushare-arbiter running?)",
            "blames the arbiter",
        ),
        (
            &ARBITER_DOWN,
            "Error: runc: runc create failed: gpushare-hook: gpushare: cannot reach the gpushare arbiter: \
             its socket /run/gpushare/control.sock does not exist (is gpushare-arbiter running?): OCI \
             runtime attempted to invoke a command that was not found",
            "blames a missing runtime binary",
        ),
        (
            &LARGER_THAN_ANY_GPU,
            "gpushare: memory 64Gi per GPU is more than any candidate GPU has (16Gi at most): \
             memory 64Gi per GPU is more than any candidate GPU has (16Gi at most)",
            "repeats",
        ),
        (&UNKNOWN_VARIABLE, RAN, "the container ran"),
    ];
    for (case, message, fault) in before {
        let found = faults(case, message);
        assert!(
            found.iter().any(|f| f.contains(fault)),
            "{fault:?} not found in {message:?}: {found:#?}"
        );
    }
    let right =
        "ctr: failed to create shim task: gpushare: container c1: memory 64Gi per GPU is more \
                 than any candidate GPU has (16Gi at most): invalid argument";
    assert_eq!(faults(&LARGER_THAN_ANY_GPU, right), Vec::<String>::new());

    // Through variables alone, the ceiling is the cause to name; elsewhere it
    // would hide the placement's answer.
    let ceiling = "docker: Error response from daemon: failed to create shim task: OCI runtime create \
         failed: gpushare: invalid request GPUSHARE_MEMORY=\"64Gi\": the environment may ask for at \
         most 25% of GPU memory on this node (requests.env_memory_ceiling); more comes only from the \
         gpushare.io/memory annotation or a runtime profile the operator defined (runtime.profiles): unknown";
    let through = |through_environment: bool| {
        check(
            &Captured {
                case: LARGER_THAN_ANY_GPU.name,
                entry: "test",
                through_environment,
                command: String::new(),
                message: ceiling.to_owned(),
            },
            &LARGER_THAN_ANY_GPU,
        )
    };
    assert_eq!(through(true), Vec::<String>::new());
    assert!(
        through(false)
            .iter()
            .any(|f| f.contains("more than any candidate GPU has")),
        "{:#?}",
        through(false)
    );
}
