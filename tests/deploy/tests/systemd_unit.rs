//! The installed layout and the arbiter's systemd unit: `make install`'s file script
//! (scripts/install-files.sh) for a prefix of its own, `systemd-analyze verify` and
//! `security` on the unit it writes, the arbiter run with only the unit's capabilities,
//! and `make uninstall`'s script.
//!
//! systemd is not PID 1 where these tests run, so the unit itself is never started: what
//! the unit's sandbox would add beyond the capability bounding set and no_new_privs
//! (ProtectSystem, DevicePolicy, the system-call filter, MemoryDenyWriteExecute) is
//! checked by systemd-analyze only.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use gpushare_testkit::{binaries, wait_until, Arbiter};

const UNIT: &str = "gpushare-arbiter.service";
/// The issue's bar for `systemd-analyze security` (0 safe … 10 exposed).
const MAX_EXPOSURE: f64 = 3.0;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `command`; a missing program fails the test naming the package that has it.
fn run(command: &mut Command) -> Output {
    command.output().unwrap_or_else(|e| {
        panic!("{command:?}: {e} (systemd-analyze: package systemd; setpriv, unshare: util-linux; readelf: binutils)")
    })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// An installation under a private prefix, installed as `make install` would with
/// PREFIX=<dir>/prefix SYSCONFDIR=<dir>/etc, from this build (man pages and completions
/// written by this build's gpushare-docgen).
struct Installed {
    dir: tempfile::TempDir,
}

impl Installed {
    fn new() -> Installed {
        binaries::require(&binaries::SHIPPED_PROGRAMS);
        binaries::require(&["gpushare-docgen"]);
        let dir = tempfile::Builder::new()
            .prefix("gs-inst-")
            .tempdir_in("/tmp")
            .unwrap();
        let docs = dir.path().join("docgen");
        let out = run(Command::new(binaries::program("gpushare-docgen"))
            .arg("--man-dir")
            .arg(docs.join("man"))
            .arg("--completions-dir")
            .arg(docs.join("completions")));
        assert!(out.status.success(), "gpushare-docgen: {}", text(&out));
        let installed = Installed { dir };
        let out = run(installed
            .script("install-files.sh")
            .env("BUILD_DIR", binaries::bin_dir())
            .env("LIBRARY", binaries::preload_library())
            .env("MAN_DIR", docs.join("man"))
            .env("COMPLETIONS_DIR", docs.join("completions")));
        assert!(out.status.success(), "install-files.sh: {}", text(&out));
        installed
    }

    fn script(&self, name: &str) -> Command {
        let mut command = Command::new(repo().join("scripts").join(name));
        command
            .env("PREFIX", self.prefix())
            .env("SYSCONFDIR", self.etc())
            .env_remove("DESTDIR");
        command
    }

    fn prefix(&self) -> PathBuf {
        self.dir.path().join("prefix")
    }

    fn etc(&self) -> PathBuf {
        self.dir.path().join("etc")
    }

    fn unit(&self) -> PathBuf {
        self.etc().join("systemd/system").join(UNIT)
    }

    fn config(&self) -> PathBuf {
        self.etc().join("gpushare/config.toml")
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.prefix().join("bin").join(name)
    }

    /// Every file under the installation, relative to it.
    fn files(&self) -> Vec<String> {
        let out = run(Command::new("find")
            .arg(".")
            .arg("-type")
            .arg("f")
            .current_dir(self.dir.path()));
        let mut files: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|f| !f.starts_with("./docgen/"))
            .map(str::to_owned)
            .collect();
        files.sort();
        files
    }
}

/// `systemd-analyze security --offline=true`'s overall exposure for `unit`.
fn exposure(unit: &Path) -> f64 {
    let out = run(Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(unit));
    let report = text(&out);
    let line = report
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no overall exposure in:\n{report}"));
    line.split(": ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number in {line:?}"))
}

/// The unit's CapabilityBoundingSet as setpriv's --bounding-set argument.
fn bounding_set(unit_text: &str) -> String {
    let caps: Vec<String> = unit_text
        .lines()
        .filter_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .flat_map(str::split_whitespace)
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_ascii_lowercase()))
        .collect();
    assert!(!caps.is_empty(), "the unit names its capabilities");
    format!("-all,{}", caps.join(","))
}

/// Runs `program args` as root with only `bounding` capabilities and no_new_privs, as
/// the unit starts the arbiter.
fn confined(bounding: &str, program: &Path) -> Command {
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--bounding-set={bounding}"))
        .arg("--inh-caps=-all")
        .arg("--no-new-privs")
        .arg(program);
    command
}

#[test]
fn the_shipped_unit_scores_at_most_3_0() {
    let unit = repo().join("config/systemd").join(UNIT);
    let score = exposure(&unit);
    assert!(
        score <= MAX_EXPOSURE,
        "systemd-analyze security: {score} > {MAX_EXPOSURE}"
    );
}

#[test]
fn an_installation_under_any_prefix_names_its_own_paths_and_verifies() {
    let installed = Installed::new();
    let prefix = installed.prefix();
    let unit = std::fs::read_to_string(installed.unit()).unwrap();
    assert!(
        unit.contains(&format!(
            "ExecStart={}",
            installed.bin("gpushare-arbiter").display()
        )),
        "{unit}"
    );
    assert!(
        unit.contains(&format!(
            "file://{}/share/doc/gpushare/README.md",
            prefix.display()
        )),
        "{unit}"
    );
    assert!(
        prefix.join("share/doc/gpushare/README.md").exists(),
        "the Documentation link is not dangling"
    );
    // Each man: page the unit names is installed under this prefix.
    let pages: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("Documentation="))
        .flat_map(str::split_whitespace)
        .filter_map(|link| link.strip_prefix("man:"))
        .collect();
    assert!(pages.contains(&"gpushare.toml(5)"), "{unit}");
    for page in pages {
        let (name, section) = page.trim_end_matches(')').split_once('(').unwrap();
        let file = prefix.join(format!("share/man/man{section}/{name}.{section}"));
        assert!(
            file.exists(),
            "Documentation names {page}: {} is missing",
            file.display()
        );
    }
    let mut settings = unit.lines().filter(|l| !l.starts_with('#'));
    assert!(settings.all(|l| !l.contains("/usr/local")), "{unit}");
    // podman's hook where podman looks for the administrator's (SYSCONFDIR), naming this
    // prefix's hook; the dashboard beside the other data.
    let hook =
        std::fs::read_to_string(installed.etc().join("containers/oci/hooks.d/gpushare.json"))
            .unwrap();
    assert!(
        hook.contains(&format!("\"{}\"", installed.bin("gpushare-hook").display())),
        "{hook}"
    );
    assert!(prefix
        .join("share/gpushare/grafana/gpushare.json")
        .is_file());
    // The engines ordered after it wait for its readiness, not for a fork (the arbiter's
    // READY=1: arbiter/tests/daemon.rs).
    assert!(
        unit.lines().any(|l| l == "Type=notify") && unit.lines().any(|l| l == "NotifyAccess=main"),
        "{unit}"
    );
    // The man: link resolves through MANPATH; ExecStart must exist and be executable.
    let out = run(Command::new("systemd-analyze")
        .args(["verify", "--no-pager"])
        .arg(installed.unit())
        .env("MANPATH", prefix.join("share/man")));
    assert!(
        out.status.success(),
        "systemd-analyze verify: {}",
        text(&out)
    );
    assert!(
        exposure(&installed.unit()) <= MAX_EXPOSURE,
        "the installed unit scores as the shipped one"
    );

    let config = std::fs::read_to_string(installed.config()).unwrap();
    let parsed: toml::Table = config.parse().unwrap();
    let runtime = &parsed["runtime"];
    assert_eq!(
        runtime["library"].as_str().map(PathBuf::from),
        Some(prefix.join("lib/gpushare/libgpushare.so"))
    );
    assert_eq!(
        runtime["hook"].as_str().map(PathBuf::from),
        Some(installed.bin("gpushare-hook"))
    );
    assert_eq!(
        runtime["container_library"].as_str(),
        Some("/usr/local/gpushare/libgpushare.so"),
        "the path inside containers is not the host's prefix"
    );

    // Stripped: no symbol table, no DWARF.
    for file in [
        installed.bin("gpushare-arbiter"),
        installed.bin("gpushare-runc"),
        prefix.join("lib/gpushare/libgpushare.so"),
    ] {
        let out = run(Command::new("readelf").arg("-S").arg(&file));
        let sections = text(&out);
        assert!(out.status.success(), "{sections}");
        for section in [".symtab", ".debug_info", ".debug_line"] {
            assert!(
                !sections.contains(section),
                "{} keeps {section}",
                file.display()
            );
        }
    }
    let version = run(Command::new(installed.bin("gpusharectl")).arg("--version"));
    assert!(
        text(&version).starts_with("gpusharectl "),
        "{}",
        text(&version)
    );

    let files = installed.files();
    for expected in [
        "./prefix/share/man/man1/gpusharectl.1",
        "./prefix/share/man/man1/gpushare-arbiter.1",
        "./prefix/share/man/man5/gpushare.toml.5",
        "./prefix/share/bash-completion/completions/gpusharectl",
        "./prefix/share/zsh/site-functions/_gpusharectl",
        "./prefix/share/fish/vendor_completions.d/gpusharectl.fish",
        "./prefix/share/doc/gpushare/examples/docker/daemon-20.10.json",
    ] {
        assert!(
            files.iter().any(|f| f == expected),
            "{expected} in {files:#?}"
        );
    }
    let example = std::fs::read_to_string(
        prefix.join("share/doc/gpushare/examples/docker/daemon-20.10.json"),
    )
    .unwrap();
    assert!(
        example.contains(&installed.bin("gpushare-runc").display().to_string()),
        "{example}"
    );
}

#[test]
fn uninstall_refuses_while_an_engine_names_gpushare_then_removes_all_but_an_edited_config() {
    let installed = Installed::new();
    let before = installed.files();

    let daemon_json = installed.etc().join("docker/daemon.json");
    std::fs::create_dir_all(daemon_json.parent().unwrap()).unwrap();
    std::fs::write(
        &daemon_json,
        r#"{"runtimes":{"gpushare":{"path":"/x/gpushare-runc"}}}"#,
    )
    .unwrap();
    let out = run(&mut installed.script("uninstall.sh"));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("run 'gpusharectl setup --undo docker' first"),
        "{}",
        text(&out)
    );
    let mut still = installed.files();
    still.retain(|f| !f.ends_with("daemon.json"));
    assert_eq!(still, before, "nothing removed");
    std::fs::remove_file(&daemon_json).unwrap();

    let mut config = std::fs::read_to_string(installed.config()).unwrap();
    config += "# edited by the operator\n";
    std::fs::write(installed.config(), &config).unwrap();
    let out = run(&mut installed.script("uninstall.sh"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("kept {}", installed.config().display())),
        "{}",
        text(&out)
    );
    assert_eq!(installed.files(), ["./etc/gpushare/config.toml"]);
    assert_eq!(std::fs::read_to_string(installed.config()).unwrap(), config);
}

#[test]
fn uninstall_removes_an_unedited_config_and_the_units_enablement() {
    let installed = Installed::new();
    // Enabled where systemd does not run (an image being built, a chroot): `systemctl
    // enable` then only makes the link, and no running systemd will remove it.
    let wants = installed
        .etc()
        .join("systemd/system/multi-user.target.wants")
        .join(UNIT);
    std::fs::create_dir_all(wants.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(installed.unit(), &wants).unwrap();
    let out = run(&mut installed.script("uninstall.sh"));
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(installed.files(), Vec::<String>::new());
    assert!(
        std::fs::symlink_metadata(&wants).is_err(),
        "{} is left dangling",
        wants.display()
    );
}

/// The unit keeps CAP_KILL and CAP_SYS_PTRACE and nothing else: the arbiter runs with
/// them alone, and they are what its checks on other users' processes need (and drop
/// either and that check fails).
#[test]
fn the_arbiter_runs_with_the_unit_s_capabilities_and_they_are_what_its_peer_checks_need() {
    let installed = Installed::new();
    let unit = std::fs::read_to_string(installed.unit()).unwrap();
    let bounding = bounding_set(&unit);
    assert_eq!(bounding, "-all,+kill,+sys_ptrace");

    // The installed arbiter, confined as the unit confines it, answers.
    let arbiter = Arbiter::builder()
        .declared_gpus(1, "16Gi")
        .program(repo().join("tests/deploy/tests/confined-arbiter.sh"))
        .env(
            "GPUSHARE_CONFINED_PROGRAM",
            installed.bin("gpushare-arbiter"),
        )
        .env("GPUSHARE_CONFINED_BOUNDING_SET", &bounding)
        .start();
    let status = arbiter.status_json();
    assert_eq!(status["gpus"].as_array().map(Vec::len), Some(1), "{status}");
    let caps = std::fs::read_to_string(format!("/proc/{}/status", arbiter.pid())).unwrap();
    let effective = caps
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim()
        .to_owned();
    // CAP_KILL is bit 5, CAP_SYS_PTRACE bit 19.
    assert_eq!(
        u64::from_str_radix(&effective, 16).unwrap(),
        (1 << 5) | (1 << 19),
        "{caps}"
    );

    // A container's process: another user, in a pid namespace of its own.
    let mut container = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
        ])
        .args(["--clear-groups", "sleep", "60"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut peer = None;
    wait_until("the container's process", Duration::from_secs(10), || {
        let children =
            std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", container.id()))
                .unwrap_or_default();
        peer = children.split_whitespace().next().map(str::to_owned);
        peer.as_deref().is_some_and(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe.ends_with("sleep"))
        })
    });
    let peer = peer.unwrap();
    let ns = format!("/proc/{peer}/ns/pid");
    let can = |bounding: &str, program: &str, args: &[&str]| {
        run(confined(bounding, Path::new(program)).args(args))
            .status
            .success()
    };
    // What ProcFs::pid_namespace reads, and what the watchdog's kill needs (signal 0).
    assert!(
        can(&bounding, "readlink", &[&ns]),
        "the unit's set reads it"
    );
    assert!(
        !can("-all,+kill", "readlink", &[&ns]),
        "without CAP_SYS_PTRACE"
    );
    assert!(
        can(&bounding, "kill", &["-0", &peer]),
        "the unit's set signals it"
    );
    assert!(
        !can("-all,+sys_ptrace", "kill", &["-0", &peer]),
        "without CAP_KILL"
    );
    let _ = container.kill();
    let _ = container.wait();
}
