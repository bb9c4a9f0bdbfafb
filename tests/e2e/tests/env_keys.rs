//! A misspelt `GPUSHARE_*` variable refuses the container, naming the
//! variable, its value and the accepted keys, through docker (gpushare-runc) and
//! through ctr (the shim); a name on `requests.allowed_env` runs; and the variables
//! gpushare writes itself, handed back in a new container's spec, are no error.

use std::process::Output;
use std::time::Duration;

use gpushare_e2e::containerd::{Containerd, ContainerdOptions, RUNTIME};
use gpushare_e2e::*;

const ALLOWED: &str = "GPUSHARE_MYTOOL_MODE=fast";

/// A private arbiter whose configuration (the runtimes read it too) allows
/// `GPUSHARE_MYTOOL_*`.
fn arbiter(dir: &std::path::Path) -> Arbiter {
    Arbiter::start(
        dir,
        ArbiterOptions {
            configure: Some(Box::new(|config: &mut Config| {
                config.requests.allowed_env = vec!["GPUSHARE_MYTOOL_*".into()];
            })),
            ..Default::default()
        },
    )
}

/// What the refusal of `GPUSHARE_MEMROY=4Gi` must say; docker escapes the quotes
/// of the runtime's message, ctr does not.
fn assert_names_the_typo(stderr: &str) {
    let unescaped = stderr.replace("\\\"", "\"");
    for part in [
        "unknown variable GPUSHARE_MEMROY=\"4Gi\"",
        "(did you mean GPUSHARE_MEMORY?)",
        "accepted keys are GPUSHARE_PRIORITY, GPUSHARE_MEMORY",
        "requests.allowed_env (GPUSHARE_MYTOOL_*)",
    ] {
        assert!(unescaped.contains(part), "{part:?} missing from: {stderr}");
    }
}

/// The `GPUSHARE_*` entries of a sharing container's environment: every variable
/// the runtime wrote, with the request and the allowed one.
fn gpushare_entries(env_output: &str) -> Vec<String> {
    let entries: Vec<String> = env_output
        .lines()
        .filter(|l| l.starts_with("GPUSHARE_"))
        .map(str::to_owned)
        .collect();
    for injected in [
        "GPUSHARE_LEASE=",
        "GPUSHARE_SOCKET=",
        "GPUSHARE_QUOTA_MEMORY=",
    ] {
        assert!(
            entries.iter().any(|e| e.starts_with(injected)),
            "{injected} missing: {env_output}"
        );
    }
    entries
}

/// The three cases, through one engine. `run(id, env, request)` runs `env` in a
/// sharing container with `env` in its spec and, with `request`, a 1Gi request of
/// the engine's kind; `log_tail` is the engine's log, for a failure.
fn refuses_the_typo_and_runs_allowed_and_gpushares_own(
    arbiter: &Arbiter,
    run: impl Fn(&str, &[&str], bool) -> Output,
    log_tail: impl Fn() -> String,
) {
    let out = run("typo", &["GPUSHARE_MEMROY=4Gi"], false);
    assert!(!out.status.success(), "the typo ran");
    assert_names_the_typo(&String::from_utf8_lossy(&out.stderr));
    assert!(arbiter.leases().is_empty());

    let succeeded = |out: Output| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}{}", log_tail());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stdout = succeeded(run("allowed", &[ALLOWED], true));
    let env = env_map(&stdout);
    assert_eq!(env["GPUSHARE_MYTOOL_MODE"], "fast");
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (1u64 << 30).to_string());

    // A new container whose spec already carries them (an image built from that
    // environment): admitted, with a lease of its own.
    let entries = gpushare_entries(&stdout);
    let mut handed_back: Vec<&str> = entries.iter().map(String::as_str).collect();
    handed_back.push("GPUSHARE_GRANT=g-1");
    let again = env_map(&succeeded(run("own", &handed_back, true)));
    assert_ne!(
        again["GPUSHARE_LEASE"], env["GPUSHARE_LEASE"],
        "a lease of its own"
    );
    wait_until("the leases to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}

#[test]
fn docker_refuses_a_misspelt_variable_and_runs_allowed_and_gpushares_own() {
    require_root();
    let dir = scratch();
    let arbiter = arbiter(dir.path());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());
    let run = |_id: &str, env: &[&str], request: bool| {
        let mut args = vec!["run", "--rm", "--runtime", "gpushare"];
        for &e in env {
            args.extend(["-e", e]);
        }
        if request {
            args.extend(["-e", "GPUSHARE_MEMORY=1Gi"]);
        }
        args.extend([IMAGE, "env"]);
        docker.docker(&args)
    };
    refuses_the_typo_and_runs_allowed_and_gpushares_own(&arbiter, run, || docker.log_tail());
}

#[test]
fn ctr_refuses_a_misspelt_variable_and_runs_allowed_and_gpushares_own() {
    require_root();
    let dir = scratch();
    let arbiter = arbiter(dir.path());
    let ctr = Containerd::start(
        dir.path(),
        arbiter.config_path(),
        ContainerdOptions::default(),
    );
    let run = |id: &str, env: &[&str], request: bool| {
        let mut flags = vec!["--rm"];
        for &e in env {
            flags.extend(["--env", e]);
        }
        if request {
            flags.extend(["--annotation", "gpushare.io/memory=1Gi"]);
        }
        ctr.ctr(&ctr.run_args(RUNTIME, &flags, id, &["/bin/env"]))
    };
    refuses_the_typo_and_runs_allowed_and_gpushares_own(&arbiter, run, || ctr.log_tail());
}
