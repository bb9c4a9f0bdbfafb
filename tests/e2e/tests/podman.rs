//! podman 4.3 (Debian's) with gpushare's precreate hook from hooks.d and `--annotation` requests.

use std::time::Duration;

use gpushare_e2e::*;

const RUN: [&str; 3] = ["run", "--network", "none"];

#[test]
fn podman_annotation_request_gets_a_lease_bound_to_the_container() {
    require_root();
    let dir = scratch();
    let mut arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let podman = Podman::start(dir.path(), arbiter.config_path());

    let id = podman
        .ok(&[
            &RUN[..],
            &[
                "-d",
                "--name",
                "named-job",
                "--annotation",
                "gpushare.io/memory=1Gi",
                "--annotation",
                "gpushare.io/priority=high",
            ],
            &[PODMAN_IMAGE, "sh", "-c", "env; sleep 600"],
        ]
        .concat())
        .trim()
        .to_owned();
    let mut logs = String::new();
    wait_until(
        "the container to print its environment",
        Duration::from_secs(20),
        || {
            logs = podman.ok(&["logs", &id]);
            logs.contains("GPUSHARE_LEASE=")
        },
    );
    let env = env_map(&logs);
    let leases = arbiter.leases();
    assert_eq!(leases.len(), 1, "{leases:?}");
    let lease = &leases[0];
    assert_eq!(
        lease["container_id"],
        id.as_str(),
        "the pending lease was bound to podman's container id"
    );
    assert_eq!(lease["state"], "confirmed");
    assert_eq!(lease["priority"], "high");
    assert_eq!(env["GPUSHARE_LEASE"], lease["id"].as_str().unwrap());
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        lease["gpus"][0].as_str().unwrap()
    );
    assert_eq!(env["LD_PRELOAD"], "/usr/local/gpushare/libgpushare.so");

    // Podman puts no name in the spec either; the arbiter reads it from the
    // container's conmon (engine_names.rs), and again after a restart.
    let lease_id = lease["id"].clone();
    assert_eq!(arbiter.shown_name(&lease_id), "named-job");
    arbiter.restart();
    assert_eq!(arbiter.shown_name(&lease_id), "named-job");

    podman.ok(&["rm", "-f", "-t", "0", &id]);
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(arbiter.lease_dirs(), 0);
}

#[test]
fn podman_bad_annotation_fails_with_the_parsers_message_and_no_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let podman = Podman::start(dir.path(), arbiter.config_path());

    let out = podman.podman(
        &[
            &RUN[..],
            &[
                "--rm",
                "--annotation",
                "gpushare.io/memory=lots",
                PODMAN_IMAGE,
                "true",
            ],
        ]
        .concat(),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("gpushare.io/memory")
            && stderr.contains("lots")
            && stderr.contains("512Mi"),
        "{stderr}"
    );
    assert!(arbiter.leases().is_empty());

    // Containers without a gpushare annotation do not even run the hook.
    let out = podman.ok(&[&RUN[..], &["--rm", PODMAN_IMAGE, "env"]].concat());
    assert!(
        !out.contains("GPUSHARE") && !out.contains("NVIDIA_VISIBLE_DEVICES"),
        "{out}"
    );
    assert!(arbiter.leases().is_empty());
}

#[test]
fn podman_crashed_container_releases_its_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let podman = Podman::start(dir.path(), arbiter.config_path());

    let id = podman
        .ok(&[
            &RUN[..],
            &[
                "-d",
                "--annotation",
                "gpushare.io/memory=1Gi",
                PODMAN_IMAGE,
                "sleep",
                "600",
            ],
        ]
        .concat())
        .trim()
        .to_owned();
    wait_until("the lease to be confirmed", Duration::from_secs(15), || {
        arbiter
            .leases()
            .first()
            .is_some_and(|l| l["state"] == "confirmed")
    });
    let pid = podman
        .ok(&["inspect", "-f", "{{.State.Pid}}", &id])
        .trim()
        .to_owned();
    assert!(std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    wait_until("the lease to be released", Duration::from_secs(20), || {
        arbiter.leases().is_empty()
    });
}

#[test]
fn podman_high_and_low_priority_containers_land_where_algorithm_1_says() {
    require_root();
    let dir = scratch();
    // Algorithm 1's rules, so the policy that has them (balanced is the default).
    let arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions::placing(gpushare_testkit::config::PlacementPolicy::Wang),
    );
    let podman = Podman::start(dir.path(), arbiter.config_path());

    let place = |priority: &str| -> String {
        let annotation = format!("gpushare.io/priority={priority}");
        let id = podman
            .ok(&[
                &RUN[..],
                &[
                    "-d",
                    "--annotation",
                    &annotation,
                    "--annotation",
                    "gpushare.io/memory=4Gi",
                ],
                &[PODMAN_IMAGE, "sleep", "600"],
            ]
            .concat())
            .trim()
            .to_owned();
        let mut gpu = String::new();
        wait_until(
            "the lease to be bound to the container",
            Duration::from_secs(15),
            || match arbiter
                .leases()
                .into_iter()
                .find(|l| l["container_id"] == id.as_str())
            {
                Some(l) => {
                    gpu = l["gpus"][0].as_str().unwrap().to_owned();
                    true
                }
                None => false,
            },
        );
        gpu
    };
    let high_a = place("high");
    assert_eq!(place("low"), high_a, "low priority joins the busy GPU");
    let high_c = place("high");
    assert_ne!(high_c, high_a, "one high-priority job per GPU");
    assert_eq!(place("low"), high_c, "the GPU with fewer low-priority jobs");
}

/// `podman exec` builds its process from podman's own copy of the spec, which the
/// precreate hook's edits never reach; with gpushare-runc as podman's runtime the
/// exec process is patched like docker's.
#[test]
fn podman_exec_sees_the_environment_with_gpushare_runc_as_runtime() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let podman = Podman::with_runtime(dir.path(), arbiter.config_path(), &bin("gpushare-runc"));

    let id = podman
        .ok(&[
            &RUN[..],
            &[
                "-d",
                "--annotation",
                "gpushare.io/memory=1Gi",
                "-e",
                "NVIDIA_VISIBLE_DEVICES=all",
            ],
            &[PODMAN_IMAGE, "sleep", "600"],
        ]
        .concat())
        .trim()
        .to_owned();
    wait_until("the lease to be confirmed", Duration::from_secs(15), || {
        arbiter
            .leases()
            .first()
            .is_some_and(|l| l["state"] == "confirmed" && l["container_id"] == id.as_str())
    });
    let lease = arbiter.leases().remove(0);
    let env = env_map(&podman.ok(&["exec", &id, "env"]));
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        lease["gpus"][0].as_str().unwrap()
    );
    assert_eq!(env["GPUSHARE_LEASE"], lease["id"].as_str().unwrap());
    assert_eq!(env["LD_PRELOAD"], "/usr/local/gpushare/libgpushare.so");
    podman.ok(&["rm", "-f", "-t", "0", &id]);
    wait_until("the lease to be released", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });
}
