//! The configuration file from the operator's side. `check-config` in
//! both binaries, and the running arbiter's reload on SIGHUP: a live key applied
//! (seen in the next lease), a key only a restart applies reported as such, and a
//! broken file refused with the running configuration kept.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use gpushare_proto::{Priority, ReserveRequest};

const GI: u64 = 1 << 30;

/// A request naming no amount: the arbiter's `default_memory` decides its quota.
fn default_sized(container: &str) -> ReserveRequest {
    ReserveRequest {
        memory: None,
        ..request(container, "1Gi", Priority::Low)
    }
}

fn hangup(arbiter: &Arbiter) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    kill(Pid::from_raw(arbiter.pid() as i32), Signal::SIGHUP).unwrap();
}

#[test]
fn sighup_applies_live_keys_reports_restart_keys_and_keeps_running_on_a_broken_file() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    // The default quota: a quarter of the GPU.
    assert_eq!(
        c.reserve(default_sized("before")).unwrap().memory_bytes,
        4 * GI
    );

    let mut changed = d.config().clone();
    changed.arbiter.default_memory = "2Gi".parse().unwrap();
    changed.arbiter.watchdog_interval_ms = 777;
    let text = changed.to_toml().unwrap();
    std::fs::write(d.config_path(), &text).unwrap();
    hangup(&d);
    wait_until("the reload", Duration::from_secs(10), || {
        d.log().contains("configuration reloaded from")
    });
    let log = d.log();
    for line in [
        "configuration reload: arbiter.default_memory applied",
        "configuration reload: arbiter.watchdog_interval_ms needs a restart of gpushare-arbiter; the running value is kept",
    ] {
        assert!(log.contains(line), "{line:?} missing:\n{}", d.log_tail(20));
    }
    assert_eq!(
        c.reserve(default_sized("after")).unwrap().memory_bytes,
        2 * GI
    );

    // A typo: refused whole, named, and nothing changes.
    let broken = text.replacen("[arbiter]\n", "[arbiter]\ndefault_memroy = \"1Gi\"\n", 1);
    assert_ne!(broken, text);
    std::fs::write(d.config_path(), broken).unwrap();
    hangup(&d);
    wait_until("the refused reload", Duration::from_secs(10), || {
        d.log().contains("configuration reload refused")
    });
    let refused = d
        .log()
        .lines()
        .find(|l| l.contains("configuration reload refused"))
        .unwrap()
        .to_owned();
    for part in [
        "the running configuration is kept",
        &d.config_path().display().to_string(),
        "arbiter.default_memroy",
        "did you mean arbiter.default_memory?",
    ] {
        assert!(refused.contains(part), "{part:?} missing: {refused}");
    }
    assert_eq!(
        c.reserve(default_sized("kept")).unwrap().memory_bytes,
        2 * GI
    );

    // gpusharectl, reading the same broken file, still shows the running arbiter
    // (through the file's own run_dir) and says what is wrong with the file.
    let ctl = Command::new(ctl())
        .args(["--config"])
        .arg(d.config_path())
        .args(["list", "--json"])
        .env_remove("GPUSHARE_CONFIG")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&ctl.stdout),
        String::from_utf8_lossy(&ctl.stderr),
    );
    assert!(ctl.status.success(), "{stderr}");
    assert!(stdout.contains("\"kept\""), "{stdout}");
    assert!(
        stderr.contains("arbiter.default_memroy") && stderr.contains("check-config"),
        "{stderr}"
    );
}

#[test]
fn check_config_in_both_binaries_says_ok_or_lists_each_problem_with_its_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    // The host-side paths it names are this build's (their defaults, make install's
    // /usr/local ones, are not on a test machine: see below).
    let library = binaries::preload_library();
    let hook = binaries::program("gpushare-hook");
    binaries::require(&["gpushare-hook"]);
    let installed = format!(
        "[runtime]\nlibrary = \"{}\"\nhook = \"{}\"\nruntimes = [\"sh\"]\n",
        library.display(),
        hook.display()
    );
    let good = dir.path().join("good.toml");
    std::fs::write(&good, format!("{installed}[scheduler]\nslice_ms = 10\n")).unwrap();
    let missing = dir.path().join("missing.toml");
    std::fs::write(
        &missing,
        installed.replace(&library.display().to_string(), "/nowhere/libgpushare.so"),
    )
    .unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[runtime]\nlibary = \"/x.so\"\n[arbiter]\ndefault_memory = \"4g\"\n",
    )
    .unwrap();
    for program in [std::path::PathBuf::from(ARBITER), ctl()] {
        let check = |file: &std::path::Path| {
            Command::new(&program)
                .arg("check-config")
                .arg(file)
                .env_remove("GPUSHARE_CONFIG")
                .output()
                .unwrap()
        };
        let ok = check(&good);
        assert_eq!(ok.status.code(), Some(0), "{}", program.display());
        assert_eq!(
            String::from_utf8_lossy(&ok.stdout),
            format!(
                "{}: ok (4 keys differ from the defaults: runtime.hook, runtime.library, \
                 runtime.runtimes, scheduler.slice_ms)\n",
                good.display()
            ),
            "{}",
            program.display()
        );
        // It reads well, but the library it names is not on this machine.
        let lacking = check(&missing);
        assert_eq!(lacking.status.code(), Some(1), "{}", program.display());
        let out = String::from_utf8_lossy(&lacking.stdout);
        assert!(
            out.starts_with(&format!(
                "{}: runtime.library = /nowhere/libgpushare.so: no such file on this machine",
                missing.display()
            )) && out.lines().count() == 2,
            "{out}"
        );
        let refused = check(&bad);
        assert_eq!(refused.status.code(), Some(1), "{}", program.display());
        let out = String::from_utf8_lossy(&refused.stdout);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].starts_with(&format!(
                "{}:2: runtime.libary = \"/x.so\": unknown key",
                bad.display()
            )) && lines[0].ends_with("did you mean runtime.library?"),
            "{out}"
        );
        assert!(
            lines[1].starts_with(&format!(
                "{}:4: arbiter.default_memory = \"4g\": ",
                bad.display()
            )) && lines[1]
                .contains("did you mean \"4Gi\" (4294967296 bytes) or \"4G\" (4000000000 bytes)?"),
            "{out}"
        );
        let absent = check(&dir.path().join("absent.toml"));
        assert_eq!(absent.status.code(), Some(2), "{}", program.display());
    }
}
