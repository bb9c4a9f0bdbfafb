//! gpushare-runc killed mid-create, against a real arbiter and a stand-in for the
//! next runtime (a script that records its pid and takes its time, as runc may):
//! the lease and the spec edit must not wait for the reservation's bound (300 s).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_testkit::{binaries, wait_until, Arbiter};

/// Generous: only to catch a hang on a loaded 2-core machine.
const HANG: Duration = Duration::from_secs(30);

/// The next runtime: `create` records its pid and waits until killed; `state`
/// says no such container exists (its create never finished).
const STAND_IN: &str = r#"#!/bin/sh
for a in "$@"; do
  case "$a" in
    state) echo "container does not exist" >&2; exit 1 ;;
    create) echo $$ > "$(dirname "$0")/create.pid"; exec sleep 600 ;;
  esac
done
exit 0
"#;

struct Node {
    arbiter: Arbiter,
    dir: tempfile::TempDir,
    bundle: PathBuf,
}

fn node() -> Node {
    binaries::cargo_build(&["gpushare-arbiter"]);
    binaries::require(&["gpushare-arbiter", "gpushare-runc"]);
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("next-runtime");
    std::fs::write(&runtime, STAND_IN).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o755)).unwrap();
    let arbiter = Arbiter::builder()
        .declared_gpus(1, "16Gi")
        .configure(|c| c.runtime.runtimes = vec![runtime.display().to_string()])
        .start();
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["true"], "cwd": "/", "env": ["PATH=/bin"]},
        "root": {"path": "rootfs"},
        "annotations": {"gpushare.io/memory": "1Gi"},
    });
    // Pretty-printed with a trailing space: any rewrite would show in the bytes.
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_string_pretty(&spec).unwrap() + " \n",
    )
    .unwrap();
    Node {
        arbiter,
        dir,
        bundle,
    }
}

fn leases(arbiter: &Arbiter) -> usize {
    arbiter.client().list().unwrap().len()
}

fn create(node: &Node, id: &str) -> Child {
    Command::new(binaries::program("gpushare-runc"))
        .env("GPUSHARE_CONFIG", node.arbiter.config_path())
        .arg("--root")
        .arg(node.dir.path().join("state"))
        .args(["create", "--bundle"])
        .arg(&node.bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn kill(pid: u32) {
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL {pid}");
}

fn stand_in_pid(dir: &Path) -> u32 {
    let file = dir.join("create.pid");
    wait_until("the next runtime's create", HANG, || {
        std::fs::read_to_string(&file).is_ok_and(|p| p.ends_with('\n'))
    });
    std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_wrapper_killed_while_the_runtime_creates_releases_the_lease_and_restores_the_spec() {
    let node = node();
    let config = node.bundle.join("config.json");
    let before = std::fs::read(&config).unwrap();
    let mut wrapper = create(&node, "c1");
    let runtime = stand_in_pid(node.dir.path());
    assert_eq!(leases(&node.arbiter), 1, "reserved before the runtime ran");
    assert_ne!(
        std::fs::read(&config).unwrap(),
        before,
        "the spec was edited before the runtime ran"
    );
    kill(wrapper.id());
    wrapper.wait().unwrap();
    // The engine (or the runtime's parent-death signal) ends the orphaned create.
    kill(runtime);
    wait_until("the dead create's lease to be released", HANG, || {
        leases(&node.arbiter) == 0
    });
    wait_until("the spec to be restored byte for byte", HANG, || {
        std::fs::read(&config).unwrap() == before
    });
    assert!(
        node.arbiter.lease_dirs().is_empty(),
        "no lease directory left"
    );
}
