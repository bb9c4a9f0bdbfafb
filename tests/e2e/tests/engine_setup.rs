//! `gpusharectl setup` against real engines: the file it writes is the one a private
//! daemon then runs a gpushare container with, a second run leaves it alone, and `--undo`
//! gives back the original byte for byte.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use gpushare_e2e::*;

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `gpusharectl setup ENGINE --config FILE [extra…]` from this build (gpushare-runc is
/// found beside it); returns what it printed.
fn setup(engine: &str, file: &Path, extra: &[&str]) -> String {
    let out = Command::new(bin("gpusharectl"))
        .arg("setup")
        .arg(engine)
        .arg("--config")
        .arg(file)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "setup {engine} {extra:?}: {}",
        text(&out)
    );
    text(&out)
}

/// A sleeping container asking for 1 GiB, run with `runtime_args` (none: docker's default
/// runtime); its lease is checked. Returns its id.
fn leased_container(docker: &Dockerd, arbiter: &Arbiter, runtime_args: &[&str]) -> String {
    let mut args = vec!["run", "-d"];
    args.extend(runtime_args);
    args.extend(["-e", "GPUSHARE_MEMORY=1Gi", IMAGE, "sleep", "600"]);
    let id = docker.ok(&args).trim().to_owned();
    let leases = arbiter.leases();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["container_id"], id.as_str());
    assert_eq!(leases[0]["memory_bytes"], 1u64 << 30);
    id
}

fn remove_and_release(docker: &Dockerd, arbiter: &Arbiter, id: &str) {
    docker.ok(&["rm", "-f", id]);
    wait_until("the lease's release", Duration::from_secs(10), || {
        arbiter.leases().is_empty()
    });
}

#[test]
fn docker_runs_a_gpushare_container_from_the_file_setup_wrote_and_undo_restores_it() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let daemon_json = dir.path().join("daemon.json");
    // As an operator's file might be: compact, other settings, another runtime.
    let original = r#"{"log-level":"warn","runtimes":{"plain":{"path":"/usr/bin/runc"}}}"#;
    std::fs::write(&daemon_json, original).unwrap();

    let said = setup("docker", &daemon_json, &[]);
    assert!(said.contains("restart docker"), "{said}");
    let written = std::fs::read(&daemon_json).unwrap();
    let backup = dir.path().join("daemon.json.gpushare-backup");
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), original);
    let said = setup("docker", &daemon_json, &[]);
    assert!(said.contains("nothing changed"), "{said}");
    assert_eq!(std::fs::read(&daemon_json).unwrap(), written);

    {
        let docker = Dockerd::start_on(dir.path(), &daemon_json, arbiter.config_path());
        let id = leased_container(&docker, &arbiter, &["--runtime", "gpushare"]);
        // The operator's other runtime still works beside it.
        let plain = docker.ok(&["run", "--rm", "--runtime", "plain", IMAGE, "echo", "plain"]);
        assert_eq!(plain.trim(), "plain");
        remove_and_release(&docker, &arbiter, &id);
    }

    let said = setup("docker", &daemon_json, &["--undo"]);
    assert!(said.contains("removed"), "{said}");
    assert_eq!(std::fs::read_to_string(&daemon_json).unwrap(), original);
    assert!(!backup.exists());
}

/// `--set-as-default`: dockerd reads gpushare as its default runtime, so a container that
/// names no runtime gets its lease; one that asks nothing runs as ever; undo restores.
#[test]
fn docker_with_gpushare_as_its_default_runtime_leases_containers_that_name_none() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let daemon_json = dir.path().join("daemon.json");
    let original = r#"{"log-level":"warn"}"#;
    std::fs::write(&daemon_json, original).unwrap();
    setup("docker", &daemon_json, &["--set-as-default"]);
    {
        let docker = Dockerd::start_on(dir.path(), &daemon_json, arbiter.config_path());
        let default = docker.ok(&["info", "--format", "{{.DefaultRuntime}}"]);
        assert_eq!(default.trim(), "gpushare");
        let id = leased_container(&docker, &arbiter, &[]);
        let plain = docker.ok(&["run", "--rm", IMAGE, "echo", "untouched"]);
        assert_eq!(plain.trim(), "untouched");
        assert_eq!(arbiter.leases().len(), 1, "asking nothing, it got no lease");
        remove_and_release(&docker, &arbiter, &id);
    }
    setup("docker", &daemon_json, &["--undo"]);
    assert_eq!(std::fs::read_to_string(&daemon_json).unwrap(), original);
}

/// containerd 1.6's CRI plugin on a config.toml that setup edited: the pod's app container
/// runs under the `gpushare` handler through gpushare-runc (runc's BinaryName) with a lease,
/// and `--undo` gives back the operator's file byte for byte.
#[test]
fn containerd_serves_the_gpushare_handler_from_the_file_setup_wrote_and_undo_restores_it() {
    use gpushare_cri::image::{self, ImageConfig};
    use gpushare_cri::Cri;
    use gpushare_e2e::containerd::{Containerd, ContainerdOptions};
    use gpushare_e2e::cri::{annotation, cri_config, handler_config, Entry, HANDLER, IMAGE};
    use std::collections::HashMap;

    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    // The operator's file: what Containerd::start writes before its extra configuration
    // (root, state, socket), and the CRI plugin set up for this machine without gpushare.
    let d = dir.path();
    let base = format!(
        "version = 2\nroot = \"{}\"\nstate = \"{}\"\n\n[grpc]\n  address = \"{}\"\n\n\
         [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{}\"\n",
        d.join("root").display(),
        d.join("state").display(),
        d.join("c.sock").display(),
        d.join("opt").display(),
    );
    let cri_part = cri_config(Entry::RuncBinary, d);
    let cri_part = cri_part
        .strip_suffix(&handler_config(Entry::RuncBinary, d))
        .expect("the handler comes last")
        .to_owned();
    let original = base.clone() + &cri_part;
    let file = d.join("operator-config.toml");
    std::fs::write(&file, &original).unwrap();

    setup("containerd", &file, &[]);
    let edited = std::fs::read_to_string(&file).unwrap();
    let said = setup("containerd", &file, &[]);
    assert!(said.contains("nothing changed"), "{said}");
    assert!(
        edited.starts_with(&original),
        "the runtime is added after everything else:\n{edited}"
    );

    {
        let ctr = Containerd::start(
            d,
            &arbiter.config_path,
            ContainerdOptions {
                extra_config: &edited[base.len()..],
                cri: true,
            },
        );
        assert_eq!(
            std::fs::read_to_string(d.join("containerd.toml")).unwrap(),
            edited,
            "containerd runs on exactly the file setup wrote"
        );
        let archive = d.join("image.tar");
        image::write_archive(
            &ctr.rootfs,
            &ImageConfig {
                name: IMAGE,
                cmd: &["/bin/sleep", "3600"],
            },
            &d.join("image-layout"),
            &archive,
        )
        .unwrap();
        image::import(&ctr.address, &archive, gpushare_e2e::cri::SNAPSHOTTER).unwrap();
        let cri = Cri::connect(&ctr.address).unwrap();
        let pod_config = gpushare_cri::host_network_pod(
            "setup-pod",
            "default",
            "c6a3c9a2-0002-4000-8000-000000000002",
            HashMap::from([("gpushare.io/memory".to_owned(), "1Gi".to_owned())]),
        );
        let pod = cri
            .run_pod_sandbox(&pod_config, HANDLER)
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}{}", ctr.log_tail()));
        let app_config = gpushare_cri::container("app", IMAGE, &["/bin/sleep", "3600"]);
        let app = cri
            .create_container(&pod, &app_config, &pod_config)
            .unwrap_or_else(|e| panic!("CreateContainer: {e}{}", ctr.log_tail()));
        cri.start_container(&app)
            .unwrap_or_else(|e| panic!("StartContainer: {e}{}", ctr.log_tail()));
        let bundle = d
            .join("state/io.containerd.runtime.v2.task")
            .join(gpushare_cri::CRI_NAMESPACE)
            .join(&app);
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
        let lease = annotation(&spec, "gpushare.io/lease")
            .unwrap_or_else(|| panic!("the app has no lease: {}", spec["annotations"]))
            .to_owned();
        let leases = arbiter.leases();
        assert_eq!(leases.len(), 1, "{leases:#?}");
        assert_eq!(leases[0]["id"], lease.as_str());
        assert_eq!(leases[0]["memory_bytes"], 1u64 << 30);
        cri.stop_pod_sandbox(&pod).unwrap();
        cri.remove_pod_sandbox(&pod).unwrap();
        wait_until("the lease's release", Duration::from_secs(10), || {
            arbiter.leases().is_empty()
        });
    }

    let said = setup("containerd", &file, &["--undo"]);
    assert!(said.contains("removed"), "{said}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), original);
    assert!(!d.join("operator-config.toml.gpushare-backup").exists());
}

/// podman on a containers.conf that setup edited: `--runtime gpushare` names gpushare-runc
/// through [engine.runtimes], its container gets a lease, and `--undo` gives the file back.
#[test]
fn podman_runs_the_gpushare_runtime_named_in_containers_conf_and_undo_restores_it() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    // Podman::start writes its containers.conf (an [engine] table among others) and
    // imports the image with runc; setup then edits that file.
    let podman = Podman::start(dir.path(), arbiter.config_path());
    let conf = podman.dir.join("containers.conf");
    let original = std::fs::read_to_string(&conf).unwrap();
    setup("podman", &conf, &[]);
    let said = setup("podman", &conf, &[]);
    assert!(said.contains("nothing changed"), "{said}");

    // podman's own flags as Podman::command passes them, but the runtime by its name.
    let gpushare_podman = |args: &[&str]| {
        let out = Command::new(PODMAN)
            .env("CONTAINERS_CONF", &conf)
            .arg("--root")
            .arg(podman.dir.join("root"))
            .arg("--runroot")
            .arg(podman.dir.join("runroot"))
            .arg("--tmpdir")
            .arg(podman.dir.join("tmp"))
            .args(["--storage-driver", "vfs", "--runtime", "gpushare"])
            .arg("--runtime-flag")
            .arg(format!(
                "gpushare-config={}",
                arbiter.config_path().display()
            ))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "podman {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let id = gpushare_podman(&[
        "run",
        "-d",
        "--annotation",
        "gpushare.io/memory=1Gi",
        PODMAN_IMAGE,
        "sleep",
        "600",
    ]);
    let leases = arbiter.leases();
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["memory_bytes"], 1u64 << 30);
    assert!(
        id.starts_with(leases[0]["container_id"].as_str().unwrap()),
        "{id} {leases:?}"
    );
    gpushare_podman(&["rm", "-f", "-t", "0", &id]);
    wait_until("the lease's release", Duration::from_secs(15), || {
        arbiter.leases().is_empty()
    });

    setup("podman", &conf, &["--undo"]);
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), original);
}

/// `gpusharectl setup docker --profile high`, with gpushare's configuration (which must
/// define the profile) named as the runtimes find it.
fn setup_profile(file: &Path, config: &Path, profile: &str) -> std::process::Output {
    Command::new(bin("gpusharectl"))
        .args(["setup", "docker", "--profile", profile, "--config"])
        .arg(file)
        .env("GPUSHARE_CONFIG", config)
        .output()
        .unwrap()
}

#[test]
fn docker_grants_a_runtime_profile_through_the_entry_setup_wrote() {
    require_root();
    let dir = scratch();
    let options = ArbiterOptions {
        configure: Some(Box::new(|config: &mut Config| {
            define_high_profile(config, "2Gi")
        })),
        ..Default::default()
    };
    let arbiter = Arbiter::start(dir.path(), options);
    let daemon_json = dir.path().join("daemon.json");

    // A profile the configuration does not define: refused, and nothing written.
    let out = setup_profile(&daemon_json, arbiter.config_path(), "batch");
    assert!(!out.status.success());
    let said = text(&out);
    assert!(
        said.contains("\"batch\"") && said.contains("[runtime.profiles.batch]"),
        "{said}"
    );
    assert!(!daemon_json.exists());

    let out = setup_profile(&daemon_json, arbiter.config_path(), HIGH_PROFILE);
    assert!(out.status.success(), "{}", text(&out));
    {
        let docker = Dockerd::start_on(dir.path(), &daemon_json, arbiter.config_path());
        let env = env_map(&docker.ok(&["run", "--rm", "--runtime", "gpushare-high", IMAGE, "env"]));
        assert_eq!(env["GPUSHARE_QUOTA_PRIORITY"], "high");
        assert_eq!(env["GPUSHARE_QUOTA_MEMORY"], (2u64 << 30).to_string());
        wait_until("the lease's release", Duration::from_secs(10), || {
            arbiter.leases().is_empty()
        });
    }
    let said = setup("docker", &daemon_json, &["--undo"]);
    assert!(said.contains("removed"), "{said}");
    assert!(!daemon_json.exists(), "setup created it, undo removes it");
}

/// containerd 2.3.4 loads what setup writes into files of version 2, 3 and 4 (its
/// own `config default`), and sees the gpushare runtime at its CRI path: `config dump`
/// reads and migrates the file as the daemon does at start.
#[test]
fn containerd_2_3_loads_what_setup_writes_into_files_of_versions_2_3_and_4() {
    let Some(engine) = gpushare_e2e::engines::containerd_2_3_dir() else {
        eprintln!(
            "SKIPPED: the containerd 2.3.4 archive is not in ../shared/engines (or \
             GPUSHARE_ENGINES_DIR)"
        );
        return;
    };
    let containerd = engine.join("containerd");
    let dir = scratch();
    let default_v4 = Command::new(&containerd)
        .args(["config", "default"])
        .output()
        .unwrap();
    assert!(default_v4.status.success(), "{}", text(&default_v4));
    let files = [
        ("v2", "version = 2\n".to_owned()),
        (
            "v3",
            "version = 3\n\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  SystemdCgroup = true\n"
                .to_owned(),
        ),
        ("v4", String::from_utf8(default_v4.stdout).unwrap()),
    ];
    for (name, original) in files {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, &original).unwrap();
        // Plain, then as the default runtime (`--set-as-default`); each undone byte for byte.
        for (extra, default) in [(&[][..], false), (&["--set-as-default"][..], true)] {
            setup("containerd", &file, extra);
            let dump = Command::new(&containerd)
                .arg("--config")
                .arg(&file)
                .args(["config", "dump"])
                .output()
                .unwrap();
            assert!(dump.status.success(), "{name}: {}", text(&dump));
            let dump = String::from_utf8_lossy(&dump.stdout);
            for wanted in [
                "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpushare]".to_owned(),
                format!("BinaryName = '{}'", bin("gpushare-runc").display()),
            ] {
                assert!(dump.contains(&wanted), "{name}: no {wanted} in\n{dump}");
            }
            assert_eq!(
                dump.contains("default_runtime_name = 'gpushare'"),
                default,
                "{name} {extra:?}:\n{dump}"
            );
            setup("containerd", &file, &["--undo"]);
            assert_eq!(
                std::fs::read_to_string(&file).unwrap(),
                original,
                "{name} {extra:?}"
            );
        }
    }
}
