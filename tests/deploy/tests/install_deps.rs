//! scripts/install-deps.sh's plan (`--plan`) on simulated machines: a private root of stub
//! programs (GPUSHARE_DEPS_ROOT) and a stub dpkg-query first on PATH. The point of the plan is
//! that a node's container engine is never replaced: with Docker CE's packages installed
//! (docker-ce, containerd.io, which ships containerd, ctr and runc), Debian's docker.io,
//! containerd and runc conflict with them and must never be planned.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

const DEBIAN_ENGINE: [&str; 3] = ["docker.io", "containerd", "runc"];

/// What a simulated machine has: programs (paths under its root), packages dpkg calls
/// installed, which package owns which file, and running processes' names.
#[derive(Default, Clone)]
struct Machine {
    programs: Vec<&'static str>,
    packages: Vec<&'static str>,
    owners: Vec<(&'static str, &'static str)>,
    running: Vec<&'static str>,
}

/// Docker CE from Docker's repository: /usr/bin/dockerd and the docker CLI, and containerd.io's
/// /usr/bin/containerd, ctr and runc.
fn docker_ce() -> Machine {
    Machine {
        programs: vec![
            "usr/bin/dockerd",
            "usr/bin/docker",
            "usr/bin/containerd",
            "usr/bin/ctr",
            "usr/bin/runc",
        ],
        packages: vec!["docker-ce", "docker-ce-cli", "containerd.io"],
        owners: vec![
            ("/usr/bin/dockerd", "docker-ce"),
            ("/usr/bin/docker", "docker-ce-cli"),
            ("/usr/bin/containerd", "containerd.io"),
            ("/usr/bin/ctr", "containerd.io"),
            ("/usr/bin/runc", "containerd.io"),
        ],
        running: vec![],
    }
}

/// Everything the tests use, from Debian's packages (this project's test machines).
fn debian_complete() -> Machine {
    Machine {
        programs: vec![
            "usr/sbin/dockerd",
            "usr/bin/docker",
            "usr/bin/containerd",
            "usr/bin/ctr",
            "usr/sbin/runc",
            "usr/bin/podman",
            "usr/bin/tar",
            "usr/bin/faketime",
            "usr/bin/groff",
            "usr/bin/systemd-analyze",
            "usr/bin/kill",
            "usr/bin/readelf",
            "usr/bin/lintian",
            "usr/bin/promtool",
            "usr/bin/man",
            "usr/bin/objdump",
            "usr/bin/zig",
            "usr/bin/cargo-zigbuild",
            "bin/busybox",
        ],
        packages: vec![
            "docker.io",
            "containerd",
            "runc",
            "podman",
            "busybox-static",
        ],
        ..Machine::default()
    }
}

struct Plan {
    status: i32,
    stdout: String,
    stderr: String,
    apt: BTreeSet<String>,
    venv: Vec<String>,
}

impl Plan {
    fn line(&self, need: &str) -> &str {
        self.stdout
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(need))
            .unwrap_or_else(|| panic!("no line for {need} in:\n{}", self.stdout))
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "gpushare-install-deps-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_executable(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// dpkg-query answering `-W` (installed packages, `name<TAB>install ok installed`) and `-S`
/// (`package: path`) as the machine says; anything else it does not know, as dpkg does.
fn stub_dpkg_query(machine: &Machine) -> String {
    let installed = machine.packages.join(" ");
    let owners: String = machine
        .owners
        .iter()
        .map(|(path, package)| format!("    {path}) echo '{package}: {path}'; exit 0 ;;\n"))
        .collect();
    format!(
        r#"#!/bin/sh
if [ "$1" = -S ]; then
  case "$2" in
{owners}  esac
  echo "dpkg-query: no path found matching pattern $2" >&2; exit 1
fi
shift 2 # -W -f=FORMAT
status=0
for p in "$@"; do
  case " {installed} " in
    *" $p "*) printf '%s\tinstall ok installed\n' "$p" ;;
    *) echo "dpkg-query: no packages found matching $p" >&2; status=1 ;;
  esac
done
exit $status
"#
    )
}

fn plan(machine: &Machine, args: &[&str]) -> Plan {
    let dir = scratch();
    let root = dir.join("root");
    fs::create_dir_all(root.join("proc")).unwrap();
    for program in &machine.programs {
        write_executable(&root.join(program), "#!/bin/sh\nexit 0\n");
    }
    for (pid, name) in machine.running.iter().enumerate() {
        let proc = root.join(format!("proc/{}", 100 + pid));
        fs::create_dir_all(&proc).unwrap();
        fs::write(proc.join("comm"), format!("{name}\n")).unwrap();
    }
    let stubs = dir.join("stubs");
    write_executable(&stubs.join("dpkg-query"), &stub_dpkg_query(machine));
    let path = format!("{}:/usr/bin:/bin", stubs.display());
    let out: Output = Command::new(repo().join("scripts/install-deps.sh"))
        .args(args)
        .arg("--plan")
        .env("PATH", path)
        .env("GPUSHARE_DEPS_ROOT", &root)
        .env("GPUSHARE_TOOLS_DIR", dir.join("tools"))
        .output()
        .expect("run scripts/install-deps.sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let field = |prefix: &str| -> Vec<String> {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split_once(": "))
            .map(|(_, list)| list.split_whitespace().map(String::from).collect())
            .or_else(|| stdout.lines().any(|l| l.starts_with(prefix)).then(Vec::new))
            .unwrap_or_else(|| panic!("no '{prefix}' line in:\n{stdout}\n{stderr}"))
    };
    let apt = field("apt-get install").into_iter().collect();
    let venv = field("python venv ");
    let _ = fs::remove_dir_all(&dir);
    Plan {
        status: out.status.code().unwrap_or(-1),
        stdout,
        stderr,
        apt,
        venv,
    }
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn docker_ce_is_never_joined_by_debians_engine_packages() {
    for mode in ["demo", "test"] {
        let plan = plan(&docker_ce(), &[mode]);
        assert_eq!(plan.status, 0, "{mode}: {}{}", plan.stdout, plan.stderr);
        for package in DEBIAN_ENGINE {
            assert!(
                !plan.apt.contains(package),
                "{mode} plans {package} beside Docker CE:\n{}",
                plan.stdout
            );
        }
        assert!(plan
            .line("containerd")
            .contains("/usr/bin/containerd (containerd.io)"));
        assert!(plan.line("runc").contains("/usr/bin/runc (containerd.io)"));
    }
    let test = plan(&docker_ce(), &["test"]);
    assert!(test
        .line("dockerd")
        .contains("/usr/bin/dockerd (docker-ce)"));
    // podman does not conflict (containerd.io provides runc, which podman depends on).
    assert!(test.apt.contains("podman"), "{}", test.stdout);
}

#[test]
fn a_missing_piece_beside_docker_ce_is_reported_not_installed() {
    // Docker CE's packages without the docker CLI (docker-ce-cli removed), and a containerd.io
    // machine without any dockerd: Debian's docker.io would pull in containerd and runc.
    let mut no_cli = docker_ce();
    no_cli.programs.retain(|p| *p != "usr/bin/docker");
    no_cli.packages.retain(|p| *p != "docker-ce-cli");
    let mut containerd_io_only = docker_ce();
    containerd_io_only
        .programs
        .retain(|p| !p.ends_with("docker") && !p.ends_with("dockerd"));
    containerd_io_only.packages = vec!["containerd.io"];
    for (machine, absent, vendor_package) in [
        (no_cli, "docker", "docker-ce-cli"),
        (containerd_io_only, "dockerd", "docker-ce"),
    ] {
        let plan = plan(&machine, &["test"]);
        assert_eq!(plan.status, 0, "{}", plan.stderr);
        assert!(
            plan.apt.is_disjoint(&set(&DEBIAN_ENGINE)),
            "{}",
            plan.stdout
        );
        let line = plan.line(absent);
        assert!(line.trim_start().starts_with("MISSING"), "{line}");
        assert!(line.contains(vendor_package), "{line}");
    }
}

#[test]
fn a_running_engine_counts_as_present() {
    // A dockerd running from somewhere the probes do not look (a snap, a tarball in /opt).
    let mut machine = debian_complete();
    machine.programs.retain(|p| !p.ends_with("dockerd"));
    machine.packages.retain(|p| *p != "docker.io");
    machine.running = vec!["dockerd"];
    let plan = plan(&machine, &["test"]);
    assert!(plan.apt.is_empty(), "{}", plan.stdout);
    assert!(plan.line("dockerd").contains("running (pid 100)"));
}

#[test]
fn each_command_plans_only_what_it_needs_on_a_bare_machine() {
    let bare = Machine::default();
    let build = ["binutils", "python3", "python3-venv"];
    let demo = [&build[..], &["containerd", "runc", "busybox-static"]].concat();
    let test = [
        &demo[..],
        &[
            "docker.io",
            "podman",
            "tar",
            "faketime",
            "groff-base",
            "systemd",
            "procps",
            "lintian",
            "prometheus",
            "man-db",
        ],
    ]
    .concat();
    let cases: [(&str, &[&str]); 3] = [("demo", &demo), ("test", &test), ("build", &build)];
    for (mode, expected) in cases {
        let plan = plan(&bare, &[mode]);
        assert_eq!(plan.status, 0, "{mode}: {}", plan.stderr);
        assert_eq!(plan.apt, set(expected), "{mode}:\n{}", plan.stdout);
        assert_eq!(
            plan.venv,
            ["ziglang==0.17.1", "cargo-zigbuild==0.24.0"],
            "{mode}: the zig toolchain goes into the project's venv:\n{}",
            plan.stdout
        );
    }
    // `--build` is the spelling `make install` uses.
    assert_eq!(
        plan(&bare, &["--build"]).apt,
        set(&["binutils", "python3", "python3-venv"])
    );
}

#[test]
fn a_machine_with_everything_plans_nothing() {
    for mode in ["demo", "test", "build"] {
        let plan = plan(&debian_complete(), &[mode]);
        assert_eq!(plan.status, 0, "{}", plan.stderr);
        assert!(plan.apt.is_empty(), "{mode}:\n{}", plan.stdout);
        assert!(plan.venv.is_empty(), "{mode}:\n{}", plan.stdout);
    }
}

#[test]
fn an_unknown_argument_names_the_accepted_ones() {
    let plan_out = Command::new(repo().join("scripts/install-deps.sh"))
        .args(["tset", "--plan"])
        .output()
        .unwrap();
    assert_eq!(plan_out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&plan_out.stderr);
    assert!(
        stderr.contains("'tset'") && stderr.contains("demo, test, build"),
        "{stderr}"
    );
}
