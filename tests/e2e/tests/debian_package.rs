//! `make deb`'s package, from this build (scripts/build-deb.sh with the debug binaries,
//! stripped as the release ones are), installed into a private root with
//! `dpkg --root --force-script-chrootless`: its files, two containers with a quota each run
//! through the installed gpushare-runc, hook and library against the installed arbiter with
//! a minimal configuration (only the node's directories: every path else is found from the
//! install prefix), an upgrade to a second build while they hold their leases (leases,
//! containers and the edited conffile survive; the arbiter restarted as postinst would
//! under systemd), then a purge that leaves nothing behind.
//!
//! Not exercised: the maintainer scripts' systemctl branch (systemd is not PID 1 here, and
//! under $DPKG_ROOT they skip it by design), and CUDA work inside the container (the lease
//! is placed on a declared GPU; the demo and tests/e2e's other suites run the simulated
//! GPU through the same library).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gpushare_e2e::*;
use gpushare_testkit::{binaries, Arbiter};
use serde_json::{json, Value};

const PACKAGE: &str = "gpushare";
const FIRST: &str = "0.1.0~test1";
const SECOND: &str = "0.1.0~test2";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn ok(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(out.status.success(), "{command:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds the package at `version` from this build into `dir`; returns its path.
fn build_package(dir: &Path, docs: &Path, version: &str) -> PathBuf {
    let out = ok(Command::new(repo().join("scripts/build-deb.sh"))
        .env("BUILD_DIR", binaries::bin_dir())
        .env("LIBRARY", binaries::preload_library())
        .env("MAN_DIR", docs.join("man"))
        .env("COMPLETIONS_DIR", docs.join("completions"))
        .env("DEB_VERSION", version)
        .env("OUT", dir.join("debs"))
        .env("WORK", dir.join(format!("work-{version}")))
        .env("FAST", "1"));
    PathBuf::from(
        out.lines()
            .last()
            .expect("build-deb.sh prints the package's path"),
    )
}

/// Debian's own checker on the package: no error, no warning (make test installs lintian;
/// where it is missing the check says so and is skipped).
fn lintian_finds_nothing(deb: &Path) {
    let out = match Command::new("lintian")
        .args(["--tag-display-limit", "0"])
        .arg(deb)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED lintian: {e} (apt-get install lintian)");
            return;
        }
    };
    let said = String::from_utf8_lossy(&out.stdout);
    let tags: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("E: ") || l.starts_with("W: "))
        .collect();
    assert!(
        tags.is_empty(),
        "lintian {}:\n{}",
        deb.display(),
        text(&out)
    );
    assert!(
        out.status.success(),
        "lintian {}:\n{}",
        deb.display(),
        text(&out)
    );
}

/// dpkg working on the private root `root`, its maintainer scripts run on this host with
/// DPKG_ROOT=root. libc6 is not installed there: dependencies are not checked.
fn dpkg(root: &Path) -> Command {
    let mut command = Command::new("dpkg");
    command
        .arg(format!("--root={}", root.display()))
        .args([
            "--force-script-chrootless",
            "--force-depends",
            "--force-confold",
        ])
        .arg(format!("--log={}", root.join("../dpkg.log").display()))
        .stdin(Stdio::null());
    command
}

fn dpkg_query(root: &Path, format: &str) -> String {
    ok(Command::new("dpkg-query")
        .arg(format!(
            "--admindir={}",
            root.join("var/lib/dpkg").display()
        ))
        .args(["-W", "-f", format, PACKAGE]))
}

/// Every file and link under `root`, relative to it, but dpkg's own database.
fn entries(root: &Path) -> Vec<String> {
    let out = ok(Command::new("find")
        .arg(".")
        .args(["(", "-type", "f", "-o", "-type", "l", ")"])
        .current_dir(root));
    let mut found: Vec<String> = out
        .lines()
        .filter(|f| !f.starts_with("./var/lib/dpkg/"))
        .map(str::to_owned)
        .collect();
    found.sort();
    found
}

/// The installed gpushare-runc, reading the installed configuration.
fn runc(root: &Path, state: &Path, args: &[&str]) -> Output {
    run_runtime(
        &root.join("usr/bin/gpushare-runc"),
        &root.join("etc/gpushare/config.toml"),
        state,
        args,
    )
}

/// The installed gpusharectl's leases.
fn leases(root: &Path) -> Vec<Value> {
    let out = ok(Command::new(root.join("usr/bin/gpusharectl"))
        .arg("--config")
        .arg(root.join("etc/gpushare/config.toml"))
        .args(["list", "--json"]));
    serde_json::from_str::<Vec<Value>>(&out).unwrap()
}

#[test]
fn a_packaged_node_runs_two_containers_on_a_minimal_config_upgrades_and_purges_cleanly() {
    require_root();
    let dir = scratch();
    let docs = dir.path().join("docgen");
    ok(Command::new(binaries::program("gpushare-docgen"))
        .arg("--man-dir")
        .arg(docs.join("man"))
        .arg("--completions-dir")
        .arg(docs.join("completions")));
    let first = build_package(dir.path(), &docs, FIRST);
    let second = build_package(dir.path(), &docs, SECOND);
    lintian_finds_nothing(&first);

    let root = dir.path().join("root");
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    let host_wants =
        Path::new("/etc/systemd/system/multi-user.target.wants/gpushare-arbiter.service");
    let host_had_it = host_wants.exists();

    // Install.
    ok(dpkg(&root).arg("--install").arg(&first));
    assert_eq!(
        dpkg_query(&root, "${Version} ${db:Status-Abbrev}"),
        format!("{FIRST} ii ")
    );
    let conffiles = dpkg_query(&root, "${Conffiles}");
    assert!(
        conffiles.contains("/etc/gpushare/config.toml"),
        "{conffiles}"
    );
    let installed = entries(&root);
    for expected in [
        "./usr/bin/gpushare-arbiter",
        "./usr/bin/gpusharectl",
        "./usr/bin/gpushare-runc",
        "./usr/bin/gpushare-hook",
        "./usr/bin/containerd-shim-gpushare-v2",
        "./usr/bin/gpushare-kube",
        "./usr/lib/gpushare/libgpushare.so",
        "./usr/lib/systemd/system/gpushare-arbiter.service",
        "./etc/gpushare/config.toml",
        "./usr/share/man/man1/gpusharectl.1.gz",
        "./usr/share/man/man5/gpushare.toml.5.gz",
        "./usr/share/bash-completion/completions/gpusharectl",
        "./usr/share/zsh/vendor-completions/_gpusharectl",
        "./usr/share/fish/vendor_completions.d/gpusharectl.fish",
        "./usr/share/doc/gpushare/README.md",
        "./usr/share/doc/gpushare/changelog.gz",
        // Where podman looks for the distribution's OCI hooks, and the Grafana dashboard.
        "./usr/share/containers/oci/hooks.d/gpushare.json",
        "./usr/share/gpushare/grafana/gpushare.json",
        // postinst enabled the unit inside the root (deb-systemd-helper under DPKG_ROOT)...
        "./etc/systemd/system/multi-user.target.wants/gpushare-arbiter.service",
    ] {
        assert!(
            installed.iter().any(|f| f == expected),
            "{expected} in {installed:#?}"
        );
    }
    // ...and touched nothing of the host's.
    assert_eq!(
        host_wants.exists(),
        host_had_it,
        "postinst reached the host's /etc"
    );
    let unit =
        std::fs::read_to_string(root.join("usr/lib/systemd/system/gpushare-arbiter.service"))
            .unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/gpushare-arbiter\n"),
        "{unit}"
    );
    let hook: Value = serde_json::from_slice(
        &std::fs::read(root.join("usr/share/containers/oci/hooks.d/gpushare.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(hook["hook"]["path"], "/usr/bin/gpushare-hook", "{hook}");
    let shipped_config = std::fs::read_to_string(root.join("etc/gpushare/config.toml")).unwrap();
    assert!(
        shipped_config.contains("library = \"/usr/lib/gpushare/libgpushare.so\"")
            && shipped_config.contains("hook = \"/usr/bin/gpushare-hook\""),
        "{shipped_config}"
    );
    for program in [
        "usr/bin/gpushare-arbiter",
        "usr/lib/gpushare/libgpushare.so",
    ] {
        let sections = ok(Command::new("readelf").arg("-S").arg(root.join(program)));
        assert!(
            !sections.contains(".debug_info") && !sections.contains(".symtab"),
            "{program} is stripped"
        );
    }

    // The installed arbiter on a declared GPU, and the installed configuration replaced by
    // a minimal one naming only this node's directories: the library, the hook and the
    // runtime are where the package put them, found from where the installed programs are
    // (the prefix above their bin/, here the private root's /usr).
    let installed_library = root.join("usr/lib/gpushare/libgpushare.so");
    let mut arbiter = Arbiter::builder()
        .declared_gpus(1, "16Gi")
        .program(root.join("usr/bin/gpushare-arbiter"))
        .start();
    let edited = format!(
        "# a minimal configuration: this node's directories, every path else a default\n\
         [arbiter]\nrun_dir = \"{}\"\nstate_dir = \"{}\"\n",
        arbiter.config().arbiter.run_dir.display(),
        arbiter.config().arbiter.state_dir.display(),
    );
    std::fs::write(root.join("etc/gpushare/config.toml"), &edited).unwrap();
    let check = Command::new(root.join("usr/bin/gpushare-arbiter"))
        .arg("check-config")
        .arg(root.join("etc/gpushare/config.toml"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check));

    // Two containers with a quota each, through the installed gpushare-runc and hook.
    let state = dir.path().join("runc-state");
    let mut bundles = Vec::new();
    for name in ["pkg1", "pkg2"] {
        let bundle = dir.path().join(format!("bundle-{name}"));
        busybox_rootfs(&bundle.join("rootfs"));
        let mut spec = runc_default_spec(&bundle);
        spec["process"]["args"] = json!(["sleep", "600"]);
        spec["annotations"] = json!({"gpushare.io/memory": "1Gi"});
        std::fs::write(bundle.join("config.json"), spec.to_string()).unwrap();
        let b = bundle.to_str().unwrap();
        for args in [&["create", "--bundle", b, name][..], &["start", name][..]] {
            let out = runc(&root, &state, args);
            assert!(
                out.status.success(),
                "{args:?}: {}{}",
                text(&out),
                arbiter.log_tail(20)
            );
        }
        bundles.push(bundle);
    }
    let mut held = leases(&root);
    held.sort_by_key(|l| l["container_id"].as_str().unwrap_or_default().to_owned());
    assert_eq!(held.len(), 2, "{held:#?}");
    for (lease, name) in held.iter().zip(["pkg1", "pkg2"]) {
        assert_eq!(lease["container_id"], name);
        assert_eq!(lease["memory_bytes"], 1u64 << 30);
        assert_eq!(
            lease["state"], "confirmed",
            "the installed hook confirmed it"
        );
    }
    let lease_ids: Vec<Value> = held.iter().map(|l| l["id"].clone()).collect();
    for bundle in &bundles {
        let running: Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        let mounts = running["mounts"].as_array().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["source"] == installed_library.to_str().unwrap()),
            "the installed library is mounted: {mounts:#?}"
        );
    }

    // Upgrade while the lease is held: the arbiter keeps running from the old binary until
    // it is restarted from the new one, as postinst's restart does under systemd.
    ok(dpkg(&root).arg("--install").arg(&second));
    assert_eq!(
        dpkg_query(&root, "${Version} ${db:Status-Abbrev}"),
        format!("{SECOND} ii ")
    );
    assert_eq!(
        std::fs::read_to_string(root.join("etc/gpushare/config.toml")).unwrap(),
        edited,
        "the conffile edit survives"
    );
    assert!(!root.join("etc/gpushare/config.toml.dpkg-dist").exists());
    arbiter.restart();
    let mut after: Vec<Value> = leases(&root).iter().map(|l| l["id"].clone()).collect();
    after.sort_by_key(Value::to_string);
    let mut before = lease_ids.clone();
    before.sort_by_key(Value::to_string);
    assert_eq!(
        after, before,
        "the leases survive the upgrade and the restart"
    );
    for name in ["pkg1", "pkg2"] {
        let status = runc(&root, &state, &["state", name]);
        assert!(
            String::from_utf8_lossy(&status.stdout).contains("\"running\""),
            "{}",
            text(&status)
        );
    }

    // The containers end; the restarted arbiter releases their leases.
    for name in ["pkg1", "pkg2"] {
        let out = runc(&root, &state, &["kill", name, "KILL"]);
        assert!(out.status.success(), "{}", text(&out));
        wait_until("the container to stop", Duration::from_secs(10), || {
            String::from_utf8_lossy(&runc(&root, &state, &["state", name]).stdout)
                .contains("\"stopped\"")
        });
        let out = runc(&root, &state, &["delete", name]);
        assert!(out.status.success(), "{}", text(&out));
    }
    assert_eq!(leases(&root), Vec::<Value>::new());
    arbiter.stop();

    // Purge: nothing of the package is left, the edited conffile and what the unit's
    // directories held included (StateDirectory, RuntimeDirectory as systemd leaves it).
    for dir in ["var/lib/gpushare", "run/gpushare/leases/l1"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        std::fs::write(root.join(dir).join("left"), "").unwrap();
    }
    ok(dpkg(&root).args(["--purge", PACKAGE]));
    assert_eq!(entries(&root), Vec::<String>::new());
    assert!(!root.join("etc/gpushare").exists());
    assert!(!root.join("run/gpushare").exists());
    assert_eq!(host_wants.exists(), host_had_it);
}
