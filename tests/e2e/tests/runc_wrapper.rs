//! gpushare-runc driven directly, against real runc: the failure paths must leave
//! the bundle's config.json byte for byte as it was and no lease behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpushare_e2e::*;
use serde_json::{json, Value};

struct Bundle {
    dir: PathBuf,
}

impl Bundle {
    /// A busybox bundle from `runc spec`, running `args`, with `annotations`.
    fn new(parent: &Path, name: &str, args: &[&str], annotations: Value) -> Bundle {
        let dir = parent.join(name);
        busybox_rootfs(&dir.join("rootfs"));
        let mut spec = runc_default_spec(&dir);
        spec["process"]["args"] = json!(args);
        spec["annotations"] = annotations;
        // Pretty-printed with a trailing space: any rewrite would show in the bytes.
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&spec).unwrap() + " \n",
        )
        .unwrap();
        Bundle { dir }
    }

    fn config_bytes(&self) -> Vec<u8> {
        std::fs::read(self.dir.join("config.json")).unwrap()
    }
}

/// Runs this build's gpushare-runc (see `run_runtime`).
fn wrapper(config: &Path, state: &Path, args: &[&str]) -> Output {
    run_runtime(&bin("gpushare-runc"), config, state, args)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_request_leaves_the_spec_unchanged_and_no_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let state = dir.path().join("runc-state");
    let bundle = Bundle::new(
        dir.path(),
        "b1",
        &["true"],
        json!({"gpushare.io/gpu": "count:zero"}),
    );
    let before = bundle.config_bytes();
    let out = wrapper(
        arbiter.config_path(),
        &state,
        &["create", "--bundle", bundle.dir.to_str().unwrap(), "c1"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("gpushare.io/gpu") && stderr(&out).contains("count:N"),
        "{}",
        stderr(&out)
    );
    assert_eq!(bundle.config_bytes(), before, "spec on disk unchanged");
    assert!(arbiter.leases().is_empty());
}

#[test]
fn runtime_failure_after_the_edit_restores_the_spec_and_releases_the_lease() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let state = dir.path().join("runc-state");
    // runc create fails looking up the process's executable, after gpushare edited the spec.
    let bundle = Bundle::new(
        dir.path(),
        "b2",
        &["/no/such/program"],
        json!({"gpushare.io/memory": "1Gi"}),
    );
    let before = bundle.config_bytes();
    let out = wrapper(
        arbiter.config_path(),
        &state,
        &["create", "--bundle", bundle.dir.to_str().unwrap(), "c2"],
    );
    assert!(!out.status.success(), "runc create must fail");
    assert!(
        stderr(&out).contains("/no/such/program"),
        "runc's own error comes through: {}",
        stderr(&out)
    );
    assert_eq!(bundle.config_bytes(), before, "original bytes restored");
    assert!(arbiter.leases().is_empty(), "lease released");
    assert_eq!(arbiter.lease_dirs(), 0);
    assert_eq!(
        std::fs::read_dir(&bundle.dir).unwrap().count(),
        2,
        "no temporary file left in the bundle"
    );
}

#[test]
fn full_lifecycle_through_real_runc_and_next_runtime_selection() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let state = dir.path().join("runc-state");
    // The NVIDIA runtime comes first in the default list; where it is absent, runc is next.
    let config = arbiter.config_variant("config-chain.toml", |c| {
        c.runtime.runtimes = vec!["/opt/absent/nvidia-container-runtime".into(), "runc".into()]
    });

    let bundle = Bundle::new(
        dir.path(),
        "b3",
        &["sleep", "600"],
        json!({"gpushare.io/memory": "512Mi"}),
    );
    let b = bundle.dir.to_str().unwrap();
    let out = wrapper(&config, &state, &["create", "--bundle", b, "c3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let leases = arbiter.leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0]["container_id"], "c3");
    assert_eq!(leases[0]["state"], "confirmed", "createRuntime hook ran");
    let edited: Value = serde_json::from_slice(&bundle.config_bytes()).unwrap();
    assert_eq!(edited["annotations"]["gpushare.io/injected"], "v1");

    for args in [&["start", "c3"][..], &["kill", "c3", "KILL"][..]] {
        let out = wrapper(&config, &state, args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    wait_until(
        "the container to stop",
        std::time::Duration::from_secs(10),
        || {
            let out = wrapper(&config, &state, &["state", "c3"]);
            String::from_utf8_lossy(&out.stdout).contains("\"stopped\"")
        },
    );
    let out = wrapper(&config, &state, &["delete", "c3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(arbiter.leases().is_empty(), "poststop released the lease");

    // No runtime at all: a clear error naming the list.
    let none = arbiter.config_variant("config-none.toml", |c| {
        c.runtime.runtimes = vec![
            "/opt/absent/nvidia-container-runtime".into(),
            "/opt/absent/runc".into(),
        ]
    });
    let out = wrapper(&none, &state, &["state", "c3"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("runtime.runtimes") && stderr(&out).contains("/opt/absent/runc"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn forged_marker_annotation_is_refused() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let state = dir.path().join("runc-state");
    // Someone copies gpushare's own annotations to skip gpushare (and its void policy).
    let bundle = Bundle::new(
        dir.path(),
        "b4",
        &["true"],
        json!({"gpushare.io/injected": "v1", "gpushare.io/lease": "0000000000000001"}),
    );
    let before = bundle.config_bytes();
    let out = wrapper(
        arbiter.config_path(),
        &state,
        &["create", "--bundle", bundle.dir.to_str().unwrap(), "c4"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot be set by hand"),
        "{}",
        stderr(&out)
    );
    assert_eq!(bundle.config_bytes(), before);
}

/// `gpushare-runc` SIGKILLed mid-create, while its reserve waits in the
/// admission queue. The arbiter must notice the requester is gone: the request
/// leaves the queue, and room that opens later is not given to nobody (which would
/// leak a lease no container will ever confirm or release).
#[test]
fn a_wrapper_killed_while_its_reserve_waits_leaves_no_lease_and_the_spec_unchanged() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions {
            gpus: 1,
            ..ArbiterOptions::default()
        },
    );
    let state = dir.path().join("runc-state");
    let filler = Bundle::new(
        dir.path(),
        "fill",
        &["sleep", "600"],
        json!({"gpushare.io/memory": "16Gi"}),
    );
    let out = wrapper(
        arbiter.config_path(),
        &state,
        &["create", "--bundle", filler.dir.to_str().unwrap(), "fill"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let waiting = Bundle::new(
        dir.path(),
        "wait",
        &["true"],
        json!({"gpushare.io/memory": "8Gi"}),
    );
    let before = waiting.config_bytes();
    let mut requester = Command::new(bin("gpushare-runc"))
        .env("GPUSHARE_CONFIG", arbiter.config_path())
        .arg("--root")
        .arg(&state)
        .args([
            "create",
            "--bundle",
            waiting.dir.to_str().unwrap(),
            "waiter",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let queued = |a: &Arbiter| a.status()["queue"].as_array().map_or(0, |q| q.len());
    wait_until(
        "the reserve to wait in the queue",
        std::time::Duration::from_secs(10),
        || queued(&arbiter) == 1,
    );
    requester.kill().unwrap();
    requester.wait().unwrap();
    wait_until(
        "the dead requester's reserve to leave the queue",
        std::time::Duration::from_secs(5),
        || queued(&arbiter) == 0,
    );
    // Room opens: nobody is waiting for it any more.
    let fill_lease = arbiter.leases()[0]["id"].as_str().unwrap().to_owned();
    let out = Command::new(bin("gpusharectl"))
        .arg("--config")
        .arg(arbiter.config_path())
        .args(["release", &fill_lease])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(
        arbiter.leases().is_empty(),
        "a lease was granted to a dead requester: {:?}",
        arbiter.leases()
    );
    assert_eq!(arbiter.lease_dirs(), 0, "no lease directory left");
    assert_eq!(waiting.config_bytes(), before, "the spec was never edited");
    let out = wrapper(arbiter.config_path(), &state, &["delete", "-f", "fill"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Two runtimes (two containerd namespaces, docker beside containerd)
/// may use one container id at once. Each gets a lease of its own, confirmed by its
/// own createRuntime hook and released by its own poststop; keyed by the id alone,
/// the second container was handed the first one's lease.
#[test]
fn one_container_id_under_two_runtime_roots_holds_two_leases() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let roots = [dir.path().join("root-a"), dir.path().join("root-b")];
    let bundles: Vec<Bundle> = ["ba", "bb"]
        .iter()
        .map(|name| {
            Bundle::new(
                dir.path(),
                name,
                &["sleep", "600"],
                json!({"gpushare.io/memory": "1Gi"}),
            )
        })
        .collect();
    for (root, bundle) in roots.iter().zip(&bundles) {
        let b = bundle.dir.to_str().unwrap();
        let out = wrapper(
            arbiter.config_path(),
            root,
            &["create", "--bundle", b, "same"],
        );
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let leases = arbiter.leases();
    assert_eq!(leases.len(), 2, "{leases:?}");
    assert_ne!(leases[0]["id"], leases[1]["id"]);
    for lease in &leases {
        assert_eq!(lease["container_id"], "same");
        assert_eq!(lease["state"], "confirmed", "each hook confirmed its own");
    }
    let injected = |bundle: &Bundle| -> String {
        let spec: Value = serde_json::from_slice(&bundle.config_bytes()).unwrap();
        spec["annotations"]["gpushare.io/lease"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_ne!(injected(&bundles[0]), injected(&bundles[1]));
    // Deleting the first runtime's container releases its lease only.
    let out = wrapper(arbiter.config_path(), &roots[0], &["delete", "-f", "same"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let left = arbiter.leases();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["id"], injected(&bundles[1]).as_str());
    let out = wrapper(arbiter.config_path(), &roots[1], &["delete", "-f", "same"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(arbiter.leases().is_empty());
    assert_eq!(arbiter.lease_dirs(), 0);
}
