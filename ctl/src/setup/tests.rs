use super::*;
use proptest::prelude::*;

fn programs() -> Programs {
    Programs::in_dir(Path::new("/usr/local/bin"))
}

fn configured(engine: Engine, text: &str) -> String {
    configure(engine, text, &programs()).unwrap_or_else(|e| panic!("{engine}: {e}\n{text}"))
}

/// docker's daemon.json as people write it: keys in no particular order, compact spacing,
/// another runtime already there.
const DOCKER_IN_USE: &str = r#"{"log-driver":"json-file","runtimes":{"nvidia":{"path":"nvidia-container-runtime","runtimeArgs":[]}},"data-root":"/srv/docker"}"#;

/// containerd 1.7's file with comments, a runc runtime on the systemd cgroup driver and
/// tables after the CRI plugin's.
const CONTAINERD_V2: &str = r#"version = 2
# Set by the node's provisioning; keep.
root = "/var/lib/containerd"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true  # the kubelet's driver

[metrics]
  address = "127.0.0.1:1338"
"#;

const CONTAINERD_V3: &str = r#"version = 3

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = false
"#;

const PODMAN_IN_USE: &str = r#"# containers.conf, edited by hand
[containers]
log_size_max = -1

[engine]
cgroup_manager = "systemd"   # not cgroupfs

[engine.runtimes]
crun = ["/usr/bin/crun", "/usr/local/bin/crun"]
"#;

fn toml(text: &str) -> toml::Table {
    text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

#[test]
fn docker_gains_the_runtime_and_keeps_every_other_key_in_order() {
    let out = configured(Engine::Docker, DOCKER_IN_USE);
    let mut expected = json(DOCKER_IN_USE);
    expected["runtimes"]["gpushare"] = serde_json::json!({"path": "/usr/local/bin/gpushare-runc"});
    assert_eq!(json(&out), expected);
    let out_json = json(&out);
    let keys: Vec<&str> = out_json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["log-driver", "runtimes", "data-root"]);
    assert!(out.ends_with("}\n"), "{out}");
}

#[test]
fn each_engine_from_no_file() {
    let cases: [(Engine, &str); 4] = [
        (
            Engine::Docker,
            "{\n  \"runtimes\": {\n    \"gpushare\": {\n      \"path\": \"/usr/local/bin/gpushare-runc\"\n    }\n  }\n}\n",
        ),
        (
            Engine::Containerd,
            "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare]\nruntime_type = \"io.containerd.runc.v2\"\npod_annotations = [\"gpushare.io/*\"]\ncontainer_annotations = [\"gpushare.io/*\", \"grant.gpushare.io/*\"]\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare.options]\nBinaryName = \"/usr/local/bin/gpushare-runc\"\n",
        ),
        (
            Engine::Podman,
            "[engine.runtimes]\ngpushare = [\"/usr/local/bin/gpushare-runc\"]\n",
        ),
        (
            Engine::Crio,
            "[crio.runtime.runtimes.gpushare]\nruntime_path = \"/usr/local/bin/gpushare-runc\"\nruntime_type = \"oci\"\n",
        ),
    ];
    for (engine, expected) in cases {
        assert_eq!(configured(engine, ""), expected, "{engine}");
        // A file setup created and nothing else wrote to: undo removes it.
        assert_eq!(
            undo(engine, expected, None, &programs()).unwrap(),
            None,
            "{engine}"
        );
    }
}

/// The runtime table setup writes, at containerd's CRI path for `version`.
fn gpushare_runtime(out: &str, plugin: &str) -> toml::Value {
    toml(out)["plugins"][plugin]["containerd"]["runtimes"]["gpushare"].clone()
}

/// config/containerd/config-v3.toml's runtime (gpushare-runc as runc's BinaryName), with
/// runc's cgroup driver `systemd`.
fn shipped_v3_runtime(systemd: bool) -> toml::Value {
    let shipped = toml(include_str!("../../../config/containerd/config-v3.toml"));
    let mut runtime = shipped["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
        ["gpushare"]
        .clone();
    runtime["options"]["SystemdCgroup"] = toml::Value::Boolean(systemd);
    runtime
}

#[test]
fn containerd_v2_gets_the_shipped_runtime_and_keeps_comments() {
    let out = configured(Engine::Containerd, CONTAINERD_V2);
    // Everything that was there, comments and indentation included, is still there as it was.
    for line in CONTAINERD_V2.lines() {
        assert!(out.contains(line), "lost {line:?}:\n{out}");
    }
    // Exactly the shipped config-v2.toml's runtime: gpushare-runc as runc's binary, at
    // version 2's path, with runc's cgroup driver systemd as there.
    let shipped_v2 = toml(include_str!("../../../config/containerd/config-v2.toml"));
    let shipped_v2 =
        &shipped_v2["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
    assert_eq!(
        &gpushare_runtime(&out, "io.containerd.grpc.v1.cri"),
        shipped_v2,
        "{out}"
    );
    // And the same table as version 3's, where only the plugin path differs.
    assert_eq!(shipped_v2, &shipped_v3_runtime(true));
}

#[test]
fn containerd_v3_gets_the_shipped_runtime_with_runc_s_cgroup_driver() {
    let out = configured(Engine::Containerd, CONTAINERD_V3);
    // runc here runs on cgroupfs: the copy follows it, not the example's systemd.
    assert_eq!(
        gpushare_runtime(&out, "io.containerd.cri.v1.runtime"),
        shipped_v3_runtime(false),
        "{out}"
    );
    assert!(
        out.starts_with(CONTAINERD_V3),
        "the original stays first, untouched:\n{out}"
    );
}

/// What containerd 2.3.4's `containerd config default` writes (version 4).
const CONTAINERD_V4: &str = include_str!("testdata/containerd-2.3.4-config-default.toml");

#[test]
fn containerd_v4_gets_the_runtime_at_version_3_s_path() {
    assert!(CONTAINERD_V4.starts_with("version = 4\n"));
    let out = configured(Engine::Containerd, CONTAINERD_V4);
    assert_eq!(
        gpushare_runtime(&out, "io.containerd.cri.v1.runtime"),
        shipped_v3_runtime(false),
        "{out}"
    );
    for line in CONTAINERD_V4.lines() {
        assert!(out.contains(line), "lost {line:?}:\n{out}");
    }
    assert_eq!(toml(&out)["version"], toml::Value::Integer(4));
}

/// A drop-in an operator already has (CRI-O merges every `crio.conf.d/*.conf` over
/// crio.conf), here naming another runtime of its own.
const CRIO_DROP_IN: &str = "# site settings\n[crio.runtime]\ndefault_runtime = \"runc\"\n\n[crio.runtime.runtimes.crun]\nruntime_path = \"/usr/bin/crun\"\n";

#[test]
fn crio_gains_the_runtime_in_its_drop_in_beside_the_others() {
    let out = configured(Engine::Crio, CRIO_DROP_IN);
    for line in CRIO_DROP_IN.lines() {
        assert!(out.contains(line), "lost {line:?}:\n{out}");
    }
    // Read back as CRI-O reads it (TOML; CRI-O is not packaged for this machine).
    let doc = toml(&out);
    let gpushare = &doc["crio"]["runtime"]["runtimes"]["gpushare"];
    assert_eq!(
        gpushare["runtime_path"].as_str(),
        Some("/usr/local/bin/gpushare-runc")
    );
    assert_eq!(gpushare["runtime_type"].as_str(), Some("oci"));
    assert_eq!(
        doc["crio"]["runtime"]["default_runtime"].as_str(),
        Some("runc")
    );
    assert_eq!(
        Engine::Crio.default_config(),
        Path::new("/etc/crio/crio.conf.d/50-gpushare.conf")
    );
}

#[test]
fn podman_gains_the_runtime_beside_the_others() {
    let out = configured(Engine::Podman, PODMAN_IN_USE);
    for line in PODMAN_IN_USE.lines() {
        assert!(out.contains(line), "lost {line:?}:\n{out}");
    }
    let doc = toml(&out);
    assert_eq!(
        doc["engine"]["runtimes"]["gpushare"],
        toml::Value::Array(vec!["/usr/local/bin/gpushare-runc".into()])
    );
    assert_eq!(
        doc["engine"]["runtimes"]["crun"].as_array().unwrap().len(),
        2
    );
}

#[test]
fn a_second_run_changes_nothing() {
    for (engine, text) in [
        (Engine::Docker, ""),
        (Engine::Docker, DOCKER_IN_USE),
        (Engine::Containerd, ""),
        (Engine::Containerd, CONTAINERD_V2),
        (Engine::Containerd, CONTAINERD_V3),
        (Engine::Containerd, CONTAINERD_V4),
        (Engine::Podman, ""),
        (Engine::Podman, PODMAN_IN_USE),
        (Engine::Crio, ""),
        (Engine::Crio, CRIO_DROP_IN),
    ] {
        let once = configured(engine, text);
        assert_ne!(once, text, "{engine}: the first run adds the runtime");
        assert_eq!(
            configured(engine, &once),
            once,
            "{engine}: the second changes nothing"
        );
        assert!(is_configured(engine, &once).unwrap(), "{engine}");
        assert!(!is_configured(engine, text).unwrap(), "{engine}");
    }
}

#[test]
fn a_runtime_entry_naming_other_programs_is_corrected() {
    let elsewhere = Programs::in_dir(Path::new("/opt/gpushare/bin"));
    for (engine, text) in [
        (Engine::Docker, DOCKER_IN_USE),
        (Engine::Containerd, CONTAINERD_V2),
        (Engine::Containerd, CONTAINERD_V3),
        (Engine::Containerd, CONTAINERD_V4),
        (Engine::Podman, PODMAN_IN_USE),
        (Engine::Crio, CRIO_DROP_IN),
    ] {
        let old = configured(engine, text);
        let new = configure(engine, &old, &elsewhere).unwrap();
        assert!(new.contains("/opt/gpushare/bin/"), "{engine}:\n{new}");
        assert!(!new.contains("/usr/local/bin/gpushare"), "{engine}:\n{new}");
        assert_eq!(
            configure(engine, text, &elsewhere).unwrap(),
            new,
            "{engine}"
        );
    }
}

#[test]
fn undo_with_the_backup_gives_back_the_file_byte_for_byte() {
    for (engine, text) in [
        (Engine::Docker, DOCKER_IN_USE),
        (Engine::Containerd, CONTAINERD_V2),
        (Engine::Containerd, CONTAINERD_V3),
        (Engine::Containerd, CONTAINERD_V4),
        (Engine::Podman, PODMAN_IN_USE),
        (Engine::Crio, CRIO_DROP_IN),
    ] {
        let once = configured(engine, text);
        assert_eq!(
            undo(engine, &once, Some(text), &programs())
                .unwrap()
                .as_deref(),
            Some(text),
            "{engine}"
        );
    }
}

#[test]
fn undo_after_a_later_edit_removes_only_the_runtime() {
    // docker: the file is rewritten (JSON has one layout), every other key kept.
    let once = configured(Engine::Docker, DOCKER_IN_USE);
    let mut later = json(&once);
    later["debug"] = Value::Bool(true);
    let later = render_json(later.as_object().unwrap());
    let undone = undo(Engine::Docker, &later, Some(DOCKER_IN_USE), &programs())
        .unwrap()
        .unwrap();
    let mut expected = json(DOCKER_IN_USE);
    expected["debug"] = Value::Bool(true);
    assert_eq!(json(&undone), expected);

    // TOML: the edit stays where it was made; the tables setup created go.
    for (engine, text, edit) in [
        (
            Engine::Containerd,
            CONTAINERD_V2,
            "[debug]\nlevel = \"info\"\n",
        ),
        (
            Engine::Podman,
            PODMAN_IN_USE,
            "[network]\nnetwork_backend = \"netavark\"\n",
        ),
        (
            Engine::Podman,
            "",
            "[network]\nnetwork_backend = \"netavark\"\n",
        ),
    ] {
        let later = configured(engine, text) + edit;
        let backup = (!text.is_empty()).then_some(text);
        let undone = undo(engine, &later, backup, &programs()).unwrap();
        assert_eq!(undone, Some(format!("{text}{edit}")), "{engine}");
    }
}

#[test]
fn undo_of_a_file_without_the_runtime_changes_nothing() {
    for (engine, text) in [
        (Engine::Docker, DOCKER_IN_USE),
        (Engine::Containerd, CONTAINERD_V2),
        (Engine::Podman, PODMAN_IN_USE),
    ] {
        assert_eq!(
            undo(engine, text, None, &programs()).unwrap().as_deref(),
            Some(text),
            "{engine}"
        );
    }
}

#[test]
fn files_it_cannot_edit_are_refused_naming_what_is_wrong() {
    let cases: [(Engine, &str, &str); 7] = [
        (Engine::Docker, "{\"runtimes\": ", "not valid JSON"),
        (Engine::Docker, "[1]", "the top level is an array"),
        (
            Engine::Docker,
            "{\"runtimes\": \"runc\"}",
            "runtimes is a string",
        ),
        (
            Engine::Containerd,
            "version = 2\n[plugins\n",
            "not valid TOML",
        ),
        (
            Engine::Containerd,
            "version = 5\n",
            "version = 5 is not supported; accepted: 2",
        ),
        (
            Engine::Containerd,
            "root = \"/var/lib/containerd\"\n",
            "containerd config migrate",
        ),
        (
            Engine::Podman,
            "[engine]\nruntimes = 1\n",
            "engine.runtimes is a value",
        ),
    ];
    for (engine, text, expected) in cases {
        let error = configure(engine, text, &programs())
            .unwrap_err()
            .to_string();
        assert!(error.contains(expected), "{engine} {text:?}: {error}");
    }
}

#[test]
fn apply_backs_up_once_and_undo_restores_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("daemon.json");
    std::fs::write(&path, DOCKER_IN_USE).unwrap();
    let backup = dir.path().join("daemon.json.gpushare-backup");

    let dry = apply(Engine::Docker, &path, &programs(), false, true).unwrap();
    assert_eq!(dry.action, Action::Written);
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        DOCKER_IN_USE,
        "a dry run writes nothing"
    );
    assert!(!backup.exists());

    let first = apply(Engine::Docker, &path, &programs(), false, false).unwrap();
    assert_eq!(first.action, Action::Written);
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), DOCKER_IN_USE);
    let written = std::fs::read(&path).unwrap();
    let second = apply(Engine::Docker, &path, &programs(), false, false).unwrap();
    assert_eq!(second.action, Action::Unchanged);
    assert_eq!(std::fs::read(&path).unwrap(), written);

    let undone = apply(Engine::Docker, &path, &programs(), true, false).unwrap();
    assert_eq!(undone.action, Action::Restored);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), DOCKER_IN_USE);
    assert!(!backup.exists(), "the backup goes with the undo");
    let again = apply(Engine::Docker, &path, &programs(), true, false).unwrap();
    assert_eq!(again.action, Action::Unchanged);

    // No file before: setup creates it, undo removes it.
    let fresh = dir.path().join("containers.conf");
    apply(Engine::Podman, &fresh, &programs(), false, false).unwrap();
    assert!(fresh.exists());
    let removed = apply(Engine::Podman, &fresh, &programs(), true, false).unwrap();
    assert_eq!(removed.action, Action::Removed);
    assert!(!fresh.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only daemon.json left"
    );
}

fn json_object() -> impl Strategy<Value = Map<String, Value>> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(Value::from),
        "[a-z/ ]{0,8}".prop_map(Value::String),
    ];
    prop::collection::btree_map("[a-z-]{1,8}", leaf, 0..6).prop_map(|m| m.into_iter().collect())
}

proptest! {
    #[test]
    fn any_daemon_json_round_trips(mut config in json_object(), runtimes in json_object()) {
        if !runtimes.is_empty() {
            config.insert("runtimes".into(), Value::Object(runtimes));
        }
        if config.get("runtimes").is_some_and(|r| !r.is_object()) {
            config.remove("runtimes");
        }
        let text = serde_json::to_string(&config).unwrap();
        let once = configured(Engine::Docker, &text);
        prop_assert_eq!(configured(Engine::Docker, &once), once.clone());
        prop_assert_eq!(undo(Engine::Docker, &once, Some(&text), &programs()).unwrap(), Some(text.clone()));
        // Without the backup: the same settings, in the same order.
        let undone = undo(Engine::Docker, &once, None, &programs()).unwrap();
        if let Some(undone) = undone {
            prop_assert_eq!(json(&undone), Value::Object(config));
        } else {
            prop_assert!(config.is_empty());
        }
    }

    #[test]
    fn any_containers_conf_round_trips(tables in prop::collection::btree_map("[a-z]{1,6}", prop::collection::btree_map("[a-z_]{1,6}", "[a-z]{0,5}", 0..4), 0..4)) {
        prop_assume!(!tables.contains_key("engine"));
        let mut text = String::new();
        for (table, keys) in &tables {
            text += &format!("[{table}]\n# about {table}\n");
            for (key, value) in keys {
                text += &format!("{key} = \"{value}\"\n");
            }
        }
        let once = configured(Engine::Podman, &text);
        prop_assert_eq!(configured(Engine::Podman, &once), once.clone());
        let backup = (!text.is_empty()).then_some(text.as_str());
        let undone = undo(Engine::Podman, &once, backup, &programs()).unwrap();
        prop_assert_eq!(undone, (!text.is_empty()).then(|| text.clone()));
        // Without the backup, only what setup added goes.
        let structural = undo(Engine::Podman, &once, Some("# something else\n"), &programs()).unwrap();
        prop_assert_eq!(structural, Some(text.clone()));
    }
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Engine configs are often symlinks into a managed tree (NixOS, config
/// management): the edit lands in the file the link names, the link stays a link.
#[test]
fn a_symlinked_config_is_edited_where_it_points_and_stays_a_link() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let managed = dir.path().join("managed");
    std::fs::create_dir(&managed).unwrap();
    let real = managed.join("daemon.json");
    std::fs::write(&real, DOCKER_IN_USE).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
    let link = dir.path().join("daemon.json");
    std::os::unix::fs::symlink("managed/daemon.json", &link).unwrap();

    apply(Engine::Docker, &link, &programs(), false, false).unwrap();
    assert!(
        std::fs::symlink_metadata(&link).unwrap().is_symlink(),
        "the link was replaced by a file"
    );
    let written = std::fs::read_to_string(&real).unwrap();
    assert!(written.contains(RUNTIME_NAME), "{written}");
    assert_eq!(mode_of(&real), 0o640, "the file keeps its mode");
    assert_eq!(
        std::fs::read_to_string(managed.join("daemon.json.gpushare-backup")).unwrap(),
        DOCKER_IN_USE
    );

    let undone = apply(Engine::Docker, &link, &programs(), true, false).unwrap();
    assert_eq!(undone.action, Action::Restored);
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(std::fs::read_to_string(&real).unwrap(), DOCKER_IN_USE);
    let left: Vec<_> = std::fs::read_dir(&managed).unwrap().collect();
    assert_eq!(left.len(), 1, "no temporary file or backup left: {left:?}");
}

/// Setup runs as root in a directory someone else may write (a rootless engine's
/// config directory): a link planted where it writes its temporary file or its
/// backup must not make it write or chmod the file the link names.
#[test]
fn links_planted_at_the_temporary_and_backup_paths_are_never_followed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let absent_victim = dir.path().join("created-by-root");
    let path = dir.path().join("daemon.json");
    std::fs::write(&path, DOCKER_IN_USE).unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("daemon.json.gpushare-tmp")).unwrap();
    let backup = dir.path().join("daemon.json.gpushare-backup");
    std::os::unix::fs::symlink(&absent_victim, &backup).unwrap();

    let result = apply(Engine::Docker, &path, &programs(), false, false);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(mode_of(&victim), 0o600, "the victim was chmodded");
    assert!(
        !absent_victim.exists(),
        "a file was created through the backup link"
    );
    let err = result.unwrap_err().to_string();
    assert!(err.contains("daemon.json.gpushare-backup"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        DOCKER_IN_USE,
        "nothing is written without its backup"
    );

    // Without the backup link the edit goes through, the tmp link untouched.
    std::fs::remove_file(&backup).unwrap();
    apply(Engine::Docker, &path, &programs(), false, false).unwrap();
    assert!(!std::fs::symlink_metadata(&path).unwrap().is_symlink());
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains(RUNTIME_NAME));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(mode_of(&victim), 0o600);
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), DOCKER_IN_USE);
}

#[test]
fn a_docker_profile_gets_a_runtime_entry_of_its_own_and_undo_takes_it_out() {
    let with_high = programs().with_docker_profiles(vec!["high".into()]);
    let once = configure(Engine::Docker, DOCKER_IN_USE, &with_high).unwrap();
    let mut expected = json(DOCKER_IN_USE);
    expected["runtimes"]["gpushare"] = serde_json::json!({"path": "/usr/local/bin/gpushare-runc"});
    expected["runtimes"]["gpushare-high"] = serde_json::json!({
        "path": "/usr/local/bin/gpushare-runc",
        "runtimeArgs": ["--gpushare-profile=high"],
    });
    assert_eq!(json(&once), expected);
    // Twice: nothing changes; without the profile: the profile's entry stays.
    assert_eq!(configure(Engine::Docker, &once, &with_high).unwrap(), once);
    assert_eq!(configure(Engine::Docker, &once, &programs()).unwrap(), once);
    // A second profile is added beside the first.
    let both = configure(
        Engine::Docker,
        &once,
        &programs().with_docker_profiles(vec!["batch".into()]),
    )
    .unwrap();
    assert_eq!(
        json(&both)["runtimes"]["gpushare-batch"]["runtimeArgs"],
        serde_json::json!(["--gpushare-profile=batch"])
    );
    // Undo, with or without --profile: the file as it was, byte for byte, from the
    // backup; without the backup every entry setup wrote goes and the rest stays.
    for undoing in [programs(), with_high.clone()] {
        assert_eq!(
            undo(Engine::Docker, &once, Some(DOCKER_IN_USE), &undoing)
                .unwrap()
                .as_deref(),
            Some(DOCKER_IN_USE)
        );
        let removed = undo(Engine::Docker, &both, None, &undoing)
            .unwrap()
            .unwrap();
        assert_eq!(json(&removed), json(DOCKER_IN_USE));
    }
    // An operator's own entry named like a profile, running something else, is kept.
    let mut theirs = json(&once);
    theirs["runtimes"]["gpushare-mine"] = serde_json::json!({"path": "/opt/other-runtime"});
    let removed = undo(Engine::Docker, &theirs.to_string(), None, &programs())
        .unwrap()
        .unwrap();
    assert_eq!(
        json(&removed)["runtimes"],
        serde_json::json!({
            "nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []},
            "gpushare-mine": {"path": "/opt/other-runtime"},
        })
    );
}

#[test]
fn set_as_default_makes_gpushare_the_default_runtime_and_undo_takes_it_out() {
    let default = programs().as_default(true);
    // docker: default-runtime, beside the runtime entry.
    let out = configure(Engine::Docker, DOCKER_IN_USE, &default).unwrap();
    assert_eq!(json(&out)["default-runtime"], "gpushare", "{out}");
    assert!(is_default(Engine::Docker, &out).unwrap());
    assert!(!is_default(Engine::Docker, &configured(Engine::Docker, DOCKER_IN_USE)).unwrap());
    // containerd: the CRI plugin's default_runtime_name, at each version's path.
    for (text, plugin) in [
        (CONTAINERD_V2, "io.containerd.grpc.v1.cri"),
        (CONTAINERD_V3, "io.containerd.cri.v1.runtime"),
        (CONTAINERD_V4, "io.containerd.cri.v1.runtime"),
    ] {
        let out = configure(Engine::Containerd, text, &default).unwrap();
        assert_eq!(
            toml(&out)["plugins"][plugin]["containerd"]["default_runtime_name"].as_str(),
            Some("gpushare"),
            "{out}"
        );
        assert!(is_default(Engine::Containerd, &out).unwrap());
        assert_eq!(
            configure(Engine::Containerd, &out, &default).unwrap(),
            out,
            "twice"
        );
    }
    for (engine, text) in [
        (Engine::Docker, DOCKER_IN_USE),
        (Engine::Docker, ""),
        (Engine::Containerd, CONTAINERD_V2),
        (Engine::Containerd, CONTAINERD_V3),
        (Engine::Containerd, CONTAINERD_V4),
        (Engine::Containerd, ""),
    ] {
        let out = configure(engine, text, &default).unwrap();
        // Undone without saying --set-as-default again: the file tells.
        let backup = (!text.is_empty()).then_some(text);
        let undone = undo(engine, &out, backup, &programs()).unwrap();
        assert_eq!(undone.as_deref(), backup, "{engine}: byte for byte");
        // Edited since: the default goes with the runtime; the engine's own applies.
        let edited = if engine == Engine::Docker {
            out.replacen('{', "{\n  \"debug\": true,", 1)
        } else {
            format!("# edited since\n{out}")
        };
        let undone = undo(engine, &edited, backup, &programs())
            .unwrap()
            .expect("the later edit is kept");
        assert!(!is_default(engine, &undone).unwrap(), "{engine}:\n{undone}");
        assert!(
            !is_configured(engine, &undone).unwrap(),
            "{engine}:\n{undone}"
        );
        assert!(!undone.contains("gpushare\""), "{engine}:\n{undone}");
    }
}
