//! A broken configuration file fails only the containers that ask for
//! gpushare, through docker (gpushare-runc), ctr (the shim) and podman
//! (gpushare-runc, and the precreate hook for a share). With a
//! typo in the file the engines read, a plain container runs untouched and prints
//! its output, and the runtime's log says why gpushare let it through; a container
//! asking for a share is refused naming the file, the key and the fix; and the
//! fixed file takes effect at the next container, with no engine restarted.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use gpushare_e2e::containerd::{Containerd, ContainerdOptions, RUNTIME};
use gpushare_e2e::*;

/// The arbiter's own file with `libary` (for `library`) in its `[runtime]` table.
/// The arbiter read it at its start and is not told: only the runtimes read it.
fn break_config(path: &Path) -> String {
    let good = std::fs::read_to_string(path).unwrap();
    assert!(good.contains("[runtime]\n"), "{good}");
    let broken = good.replacen("[runtime]\n", "[runtime]\nlibary = \"/usr/lib/x.so\"\n", 1);
    std::fs::write(path, broken).unwrap();
    good
}

/// What a refusal must name; docker escapes the quotes of the runtime's message.
fn assert_names_file_key_and_fix(stderr: &str, config: &Path) {
    let unescaped = stderr.replace("\\\"", "\"");
    for part in [
        "asks for gpushare",
        &format!("invalid gpushare configuration {}", config.display()),
        "runtime.libary = \"/usr/lib/x.so\": unknown key",
        "did you mean runtime.library?",
        &format!("gpushare-arbiter check-config {}", config.display()),
    ] {
        assert!(unescaped.contains(part), "{part:?} missing from: {stderr}");
    }
}

/// The warning a plain container's start leaves in a log.
fn assert_warns(log: &str, config: &Path) {
    let unescaped = log.replace("\\\"", "\"");
    let warning = format!("invalid gpushare configuration {}", config.display());
    assert!(
        unescaped.contains(&warning)
            && unescaped.contains("runtime.libary")
            && unescaped.contains("asks nothing of gpushare and starts untouched"),
        "no warning in: {log}"
    );
}

fn succeeded(out: &Output, log_tail: impl Fn() -> String) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        log_tail()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn docker_runs_a_plain_container_and_refuses_a_share_while_the_file_is_broken() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let config = arbiter.config_path().to_owned();
    let docker = Dockerd::start(dir.path(), &config);
    let good = break_config(&config);

    // Untouched: its own output, and no lease.
    let out = docker.docker(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        IMAGE,
        "echo",
        "plain",
    ]);
    assert_eq!(succeeded(&out, || docker.log_tail()), "plain\n");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("gpushare"),
        "the warning is not the container's: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The warning is in the runtime's log, kept while the container lives.
    let id = docker
        .ok(&["run", "-d", "--runtime", "gpushare", IMAGE, "sleep", "30"])
        .trim()
        .to_owned();
    let log = docker
        .exec_root
        .join("containerd/daemon/io.containerd.runtime.v2.task/moby")
        .join(&id)
        .join("log.json");
    assert_warns(&std::fs::read_to_string(&log).unwrap_or_default(), &config);
    docker.ok(&["rm", "-f", &id]);

    let share = || {
        docker.docker(&[
            "run",
            "--rm",
            "--runtime",
            "gpushare",
            "-e",
            "GPUSHARE_MEMORY=1Gi",
            IMAGE,
            "env",
        ])
    };
    let refused = share();
    assert!(!refused.status.success(), "the share ran");
    assert_names_file_key_and_fix(&String::from_utf8_lossy(&refused.stderr), &config);
    // (Through the socket: gpusharectl reads the broken file too.)
    assert!(arbiter.client().list().unwrap().is_empty());

    // Fixed: the next container has its share, dockerd untouched.
    std::fs::write(&config, good).unwrap();
    let env = env_map(&succeeded(&share(), || docker.log_tail()));
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (1u64 << 30).to_string());
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}

#[test]
fn ctr_runs_a_plain_container_and_refuses_a_share_while_the_file_is_broken() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let config = arbiter.config_path().to_owned();
    let ctr = Containerd::start(dir.path(), &config, ContainerdOptions::default());
    let good = break_config(&config);
    let run = |id: &str, flags: &[&str], command: &[&str]| {
        let mut all = vec!["--rm"];
        all.extend_from_slice(flags);
        ctr.ctr(&ctr.run_args(RUNTIME, &all, id, command))
    };

    let out = run("plain", &[], &["/bin/echo", "plain"]);
    assert_eq!(succeeded(&out, || ctr.log_tail()), "plain\n");
    // The shim's warning reaches containerd's log.
    wait_until("the shim's warning", Duration::from_secs(10), || {
        std::fs::read_to_string(dir.path().join("containerd.log"))
            .is_ok_and(|log| log.contains("asks nothing of gpushare"))
    });
    assert_warns(
        &std::fs::read_to_string(dir.path().join("containerd.log")).unwrap(),
        &config,
    );

    let share = |id: &str| {
        run(
            id,
            &["--annotation", "gpushare.io/memory=1Gi"],
            &["/bin/env"],
        )
    };
    let refused = share("share");
    assert!(!refused.status.success(), "the share ran");
    assert_names_file_key_and_fix(&String::from_utf8_lossy(&refused.stderr), &config);
    // (Through the socket: gpusharectl reads the broken file too.)
    assert!(arbiter.client().list().unwrap().is_empty());

    // Fixed: the next container has its share, containerd untouched.
    std::fs::write(&config, good).unwrap();
    let env = env_map(&succeeded(&share("fixed"), || ctr.log_tail()));
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (1u64 << 30).to_string());
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}

/// podman with gpushare-runc as its runtime (a plain container) and the precreate
/// hook (a share): the hook plants the refusal, which podman shows.
#[test]
fn podman_runs_a_plain_container_and_refuses_a_share_while_the_file_is_broken() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let config = arbiter.config_path().to_owned();
    let podman = Podman::with_runtime(dir.path(), &config, &bin("gpushare-runc"));
    let good = break_config(&config);
    let run = |extra: &[&str], command: &[&str]| {
        let mut args = vec!["run", "--rm", "--network", "none"];
        args.extend_from_slice(extra);
        args.push(PODMAN_IMAGE);
        args.extend_from_slice(command);
        podman.podman(&args)
    };

    let out = run(&[], &["echo", "plain"]);
    assert_eq!(succeeded(&out, String::new), "plain\n");

    let share = || run(&["--annotation", "gpushare.io/memory=1Gi"], &["env"]);
    let refused = share();
    assert!(!refused.status.success(), "the share ran");
    assert_names_file_key_and_fix(&String::from_utf8_lossy(&refused.stderr), &config);
    assert!(arbiter.client().list().unwrap().is_empty());

    std::fs::write(&config, good).unwrap();
    let env = env_map(&succeeded(&share(), String::new));
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (1u64 << 30).to_string());
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}
