//! docker 20.10 (Debian's) with gpushare-runc as a path runtime, in a private dockerd.

use std::time::Duration;

use gpushare_e2e::*;
use gpushare_testkit::config::PlacementPolicy;

/// A node that defines the runtime profile `high` (the private dockerd's
/// `gpushare-high` runtime), placing with `policy`; the environment may ask for
/// 4 GiB, as the operator of a node of 16 GiB GPUs may set.
fn with_high_profile(policy: PlacementPolicy) -> ArbiterOptions {
    ArbiterOptions {
        configure: Some(Box::new(move |config: &mut Config| {
            config.placement.policy = policy;
            config.requests.env_memory_ceiling = Some("4Gi".parse().unwrap());
            define_high_profile(config, "4Gi");
        })),
        ..Default::default()
    }
}

#[test]
fn docker_run_gets_lease_environment_and_releases_on_exit() {
    require_root();
    let dir = scratch();
    let mut arbiter = Arbiter::start(dir.path(), with_high_profile(PlacementPolicy::default()));
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let id = docker
        .ok(&[
            "run",
            "-d",
            "--name",
            "trainer-7",
            "--runtime",
            "gpushare",
            "-e",
            "GPUSHARE_MEMORY=1Gi",
            IMAGE,
            "sh",
            "-c",
            "env; ls /run/gpushare /usr/local/gpushare; sleep 600",
        ])
        .trim()
        .to_owned();
    let mut logs = String::new();
    wait_until(
        "the container to print its environment",
        Duration::from_secs(20),
        || {
            logs = docker.ok(&["logs", &id]);
            logs.contains("GPUSHARE_LEASE=")
        },
    );
    let env = env_map(&logs);

    let leases = arbiter.leases();
    assert_eq!(
        leases.len(),
        1,
        "exactly one lease while the container runs: {leases:?}"
    );
    let lease = &leases[0];
    assert_eq!(lease["container_id"], id.as_str());
    assert_eq!(lease["memory_bytes"], 1u64 << 30);
    assert_eq!(
        lease["state"], "confirmed",
        "the createRuntime hook confirmed it"
    );
    assert!(lease["pid"].as_u64().unwrap() > 1);
    let gpu = lease["gpus"][0].as_str().unwrap();
    assert!(gpu == sim_uuid(0) || gpu == sim_uuid(1), "{gpu}");

    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], gpu);
    assert_eq!(env["GPUSHARE_LEASE"], lease["id"].as_str().unwrap());
    assert_eq!(env["LD_PRELOAD"], "/usr/local/gpushare/libgpushare.so");
    assert_eq!(env["NVIDIA_DRIVER_CAPABILITIES"], "compute,utility");
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (1u64 << 30).to_string());
    assert!(
        logs.contains("libgpushare.so"),
        "the library is mounted: {logs}"
    );

    // Docker puts no name in the spec; the arbiter reads it from the engine's own
    // record (engine_names.rs) after the hook confirms the container, so status
    // names the container as `docker ps` does, and again after a restart.
    let lease_id = lease["id"].clone();
    assert_eq!(arbiter.shown_name(&lease_id), "trainer-7");
    arbiter.restart(); // SIGKILL, then a new arbiter on the same state
    assert_eq!(arbiter.shown_name(&lease_id), "trainer-7");

    docker.ok(&["rm", "-f", &id]);
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(
        arbiter.lease_dirs(),
        0,
        "the lease directory is removed with the lease"
    );

    // A container that runs to completion releases its lease too; high priority
    // comes from the operator's runtime entry (`gpushare-high`), not the environment.
    let out = docker.ok(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare-high",
        "-e",
        "GPUSHARE_MEMORY=512Mi",
        IMAGE,
        "env",
    ]);
    let env = env_map(&out);
    assert_eq!(env["GPUSHARE_QUOTA_PRIORITY"], "high");
    assert!(env["NVIDIA_VISIBLE_DEVICES"].starts_with("GPU-"));
    wait_until(
        "the lease of the finished container to be released",
        Duration::from_secs(15),
        || arbiter.leases().is_empty(),
    );
}

#[test]
fn container_without_request_passes_through_unchanged() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let through_gpushare = env_map(&docker.ok(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        "--hostname",
        "h",
        IMAGE,
        "env",
    ]));
    let through_runc = env_map(&docker.ok(&[
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--hostname",
        "h",
        IMAGE,
        "env",
    ]));
    assert_eq!(through_gpushare, through_runc);
    assert!(!through_gpushare.contains_key("NVIDIA_VISIBLE_DEVICES"));

    // The spec the runtime received carries no trace of gpushare.
    let id = docker
        .ok(&["run", "-d", "--runtime", "gpushare", IMAGE, "sleep", "600"])
        .trim()
        .to_owned();
    let spec = docker.bundle_config(&id).to_string();
    assert!(!spec.contains("gpushare"), "spec was edited: {spec}");
    assert!(!spec.contains("LD_PRELOAD"));
    assert!(
        arbiter.leases().is_empty(),
        "no lease for a container that asked for nothing"
    );
    docker.ok(&["rm", "-f", &id]);
}

/// `docker run --runtime gpushare -e variable`, which must fail; its stderr.
fn refused_run(docker: &Dockerd, variable: &str) -> String {
    let out = docker.docker(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        "-e",
        variable,
        IMAGE,
        "true",
    ]);
    assert!(!out.status.success(), "{variable} was granted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_memory_value_fails_the_run_with_a_clear_error_and_no_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let stderr = refused_run(&docker, "GPUSHARE_MEMORY=lots");
    assert!(
        stderr.contains("GPUSHARE_MEMORY"),
        "names the variable: {stderr}"
    );
    assert!(
        stderr.contains("\\\"lots\\\"") || stderr.contains("\"lots\""),
        "names the value: {stderr}"
    );
    assert!(
        stderr.contains("512Mi") && stderr.contains("40%"),
        "lists the accepted forms: {stderr}"
    );
    assert!(arbiter.leases().is_empty());
    assert_eq!(arbiter.lease_dirs(), 0);
}

#[test]
fn docker_exec_sees_the_injected_environment() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    // The image bakes in NVIDIA_VISIBLE_DEVICES=all, as CUDA images do.
    let id = docker
        .ok(&[
            "run",
            "-d",
            "--runtime",
            "gpushare",
            "-e",
            "NVIDIA_VISIBLE_DEVICES=all",
            "-e",
            "GPUSHARE_MEMORY=2Gi",
            IMAGE,
            "sleep",
            "600",
        ])
        .trim()
        .to_owned();
    let lease = arbiter.leases().into_iter().next().expect("a lease");
    let env = env_map(&docker.ok(&["exec", &id, "env"]));
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        lease["gpus"][0].as_str().unwrap(),
        "replaced, not 'all'"
    );
    assert_eq!(env["GPUSHARE_LEASE"], lease["id"].as_str().unwrap());
    assert_eq!(env["LD_PRELOAD"], "/usr/local/gpushare/libgpushare.so");
    // exec with its own environment keeps it, and still gets gpushare's.
    let env = env_map(&docker.ok(&[
        "exec",
        "-e",
        "LD_PRELOAD=/lib/extra.so",
        "-e",
        "MINE=1",
        &id,
        "env",
    ]));
    assert_eq!(
        env["LD_PRELOAD"],
        "/usr/local/gpushare/libgpushare.so:/lib/extra.so"
    );
    assert_eq!(env["MINE"], "1");
    docker.ok(&["rm", "-f", &id]);
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}

#[test]
fn a_crashed_container_releases_its_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    // One dies by a signal from outside, one exits with an error by itself.
    let killed = docker
        .ok(&[
            "run",
            "-d",
            "--runtime",
            "gpushare",
            "-e",
            "GPUSHARE_MEMORY=1Gi",
            IMAGE,
            "sleep",
            "600",
        ])
        .trim()
        .to_owned();
    let failing = docker
        .ok(&[
            "run",
            "-d",
            "--runtime",
            "gpushare",
            "-e",
            "GPUSHARE_MEMORY=1Gi",
            IMAGE,
            "sh",
            "-c",
            "sleep 1; exit 3",
        ])
        .trim()
        .to_owned();
    wait_until("both leases confirmed", Duration::from_secs(15), || {
        let leases = arbiter.leases();
        leases.len() == 2 && leases.iter().all(|l| l["state"] == "confirmed")
    });
    let pid = docker
        .ok(&["inspect", "-f", "{{.State.Pid}}", &killed])
        .trim()
        .to_owned();
    assert!(std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    wait_until("both leases released", Duration::from_secs(20), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(
        docker
            .ok(&["inspect", "-f", "{{.State.ExitCode}}", &failing])
            .trim(),
        "3"
    );
    assert_eq!(arbiter.lease_dirs(), 0);
}

/// Runs a detached sleeping container through `runtime` with the given `-e`
/// requests; returns (id, its GPU).
fn place(
    docker: &Dockerd,
    arbiter: &Arbiter,
    runtime: &str,
    requests: &[&str],
) -> (String, String) {
    let mut args = vec!["run", "-d", "--runtime", runtime];
    for r in requests {
        args.extend(["-e", r]);
    }
    args.extend([IMAGE, "sleep", "600"]);
    let id = docker.ok(&args).trim().to_owned();
    let gpu = arbiter
        .leases()
        .into_iter()
        .find(|l| l["container_id"] == id.as_str())
        .map(|l| l["gpus"][0].as_str().unwrap().to_owned())
        .expect("a lease for the container");
    let env = env_map(&docker.ok(&["exec", &id, "env"]));
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"], gpu,
        "the container sees the GPU its lease names"
    );
    (id, gpu)
}

#[test]
fn high_and_low_priority_containers_land_where_algorithm_1_says() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), with_high_profile(PlacementPolicy::Wang));
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let (_, high_a) = place(&docker, &arbiter, "gpushare-high", &["GPUSHARE_MEMORY=4Gi"]);
    // Low priority soaks up a busy GPU's idle time rather than taking an unused GPU.
    let (_, low_b) = place(
        &docker,
        &arbiter,
        "gpushare",
        &["GPUSHARE_PRIORITY=low", "GPUSHARE_MEMORY=4Gi"],
    );
    assert_eq!(low_b, high_a);
    // At most one high-priority job per GPU.
    let (_, high_c) = place(&docker, &arbiter, "gpushare-high", &["GPUSHARE_MEMORY=4Gi"]);
    assert_ne!(high_c, high_a);
    // Among GPUs with a high-priority job, the one with fewer low-priority jobs.
    let (_, low_d) = place(
        &docker,
        &arbiter,
        "gpushare",
        &["GPUSHARE_PRIORITY=low", "GPUSHARE_MEMORY=4Gi"],
    );
    assert_eq!(low_d, high_c);
    assert_eq!(arbiter.leases().len(), 4);
}

#[test]
fn the_balanced_policy_spreads_jobs_while_a_gpu_is_unused() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), with_high_profile(PlacementPolicy::Balanced));
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let (_, high_a) = place(&docker, &arbiter, "gpushare-high", &["GPUSHARE_MEMORY=4Gi"]);
    // Where Algorithm 1 packs the low job beside the high one, the balanced policy
    // opens the unused GPU: a job alone on a GPU costs less than beside another.
    let (_, low_b) = place(
        &docker,
        &arbiter,
        "gpushare",
        &["GPUSHARE_PRIORITY=low", "GPUSHARE_MEMORY=4Gi"],
    );
    assert_ne!(low_b, high_a);
    // Still at most one high-priority job per GPU.
    let (_, high_c) = place(&docker, &arbiter, "gpushare-high", &["GPUSHARE_MEMORY=4Gi"]);
    assert_ne!(high_c, high_a);
    assert_eq!(arbiter.leases().len(), 3);
}

#[test]
fn image_needing_a_newer_cuda_than_the_driver_is_rejected() {
    require_root();
    let dir = scratch();
    // The (simulated) driver supports CUDA 12.2.
    let options = ArbiterOptions {
        simulated_driver: Some("12020"),
        ..Default::default()
    };
    let arbiter = Arbiter::start(dir.path(), options);
    assert_eq!(arbiter.status()["driver_cuda_version"], 12020);
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    let out = docker.docker(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        "-e",
        "GPUSHARE_MEMORY=1Gi",
        "-e",
        "CUDA_VERSION=12.4.1",
        IMAGE,
        "true",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("CUDA_VERSION=12.4.1") && stderr.contains("CUDA 12.2"),
        "names both versions: {stderr}"
    );
    assert!(arbiter.leases().is_empty(), "nothing reserved");

    let ok = docker.ok(&[
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        "-e",
        "GPUSHARE_MEMORY=1Gi",
        "-e",
        "NVIDIA_REQUIRE_CUDA=cuda>=12.0",
        IMAGE,
        "true",
    ]);
    assert!(ok.is_empty());
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}

/// An image's own `ENV GPUSHARE_PRIORITY=high` (here `-e`, which the runtime cannot
/// tell from it) is refused naming the variable and how to get more; the operator's
/// runtime entry grants it.
#[test]
fn the_environment_cannot_ask_for_high_priority_and_the_profile_runtime_grants_it() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), with_high_profile(PlacementPolicy::default()));
    let docker = Dockerd::start(dir.path(), arbiter.config_path());

    for asked in [
        "GPUSHARE_PRIORITY=high",
        "GPUSHARE_TENANT=inference",
        "GPUSHARE_MEMORY=100%",
    ] {
        let stderr = refused_run(&docker, asked);
        let (key, _) = asked.split_once('=').unwrap();
        assert!(
            stderr.contains(key)
                && stderr.contains("the environment may ask for")
                && stderr.contains("runtime.profiles"),
            "{asked}: {stderr}"
        );
        assert!(arbiter.leases().is_empty(), "{asked}: nothing reserved");
    }
    let env = env_map(&docker.ok(&["run", "--rm", "--runtime", "gpushare-high", IMAGE, "env"]));
    assert_eq!(env["GPUSHARE_QUOTA_PRIORITY"], "high");
    assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (4u64 << 30).to_string());
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}
