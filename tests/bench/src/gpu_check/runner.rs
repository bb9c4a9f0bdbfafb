//! Each step in a process of its own, in a process group of its own, within its budget.
//!
//! A step runs a private arbiter, jobs under the interposer and frameworks, any of which can
//! hang on a driver nobody has tried yet. The step process is the leader of a new process
//! group, which its arbiter and jobs join (none of them starts a session of its own): at the
//! budget the whole group is killed, and after a step ends the group is killed anyway, so
//! nothing of one step runs into the next. The step process writes its [`Verdict`] to
//! `result.json` in its directory; its output goes to `step.log` beside it.

use super::{bins::Bins, Step, StepEnv, Verdict, DRIVER_VAR, HANG_STEP_VAR, SIMULATED_VAR, STEPS};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const RESULT_FILE: &str = "result.json";
const LOG_FILE: &str = "step.log";

/// How the step process ended, as the runner saw it.
#[derive(Debug)]
pub enum Ending {
    Exited(ExitStatus),
    TimedOut(Duration),
    NotStarted(String),
}

/// The step's verdict from how its process ended, what it wrote, and its log's last line.
pub fn verdict_of(ending: &Ending, written: Option<&str>, log_tail: &str) -> Verdict {
    let tail = if log_tail.is_empty() {
        String::new()
    } else {
        format!("; last output: {log_tail}")
    };
    match ending {
        Ending::TimedOut(budget) => Verdict::fail(format!(
            "timed out after {} s (process group killed){tail}",
            budget.as_secs()
        )),
        Ending::NotStarted(why) => Verdict::fail(format!("the step process did not start: {why}")),
        Ending::Exited(status) => match written.map(serde_json::from_str::<Verdict>) {
            Some(Ok(verdict)) if status.success() => verdict,
            Some(Err(e)) => Verdict::fail(format!("its result is not readable ({e}){tail}")),
            _ => Verdict::fail(format!(
                "the step process ended ({status}) without a result{tail}"
            )),
        },
    }
}

/// Runs `step` as `gpushare-gpu-check --run-step NAME --work DIR`; its verdict and how long
/// it took.
pub fn run_in_child(
    step: &Step,
    dir: &Path,
    budget: Duration,
    bins: &Bins,
    driver: &str,
) -> (Verdict, Duration) {
    let start = Instant::now();
    let ending = spawn_and_wait(step, dir, budget, bins, driver);
    let written = std::fs::read_to_string(dir.join(RESULT_FILE)).ok();
    let log = std::fs::read_to_string(dir.join(LOG_FILE)).unwrap_or_default();
    let tail = log
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    (
        verdict_of(&ending, written.as_deref(), tail.trim()),
        start.elapsed(),
    )
}

fn spawn_and_wait(step: &Step, dir: &Path, budget: Duration, bins: &Bins, driver: &str) -> Ending {
    let started = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::File::create(dir.join(LOG_FILE)))
        .and_then(|log| Ok((log.try_clone()?, log)))
        .and_then(|(out, err)| {
            let exe = std::env::current_exe()?;
            Command::new(exe)
                .args(["--run-step", step.name, "--work"])
                .arg(dir)
                .envs(bins.env())
                .env(DRIVER_VAR, driver)
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .process_group(0)
                .spawn()
        });
    let mut child = match started {
        Ok(c) => c,
        Err(e) => return Ending::NotStarted(e.to_string()),
    };
    let group = child.id() as libc::pid_t;
    let deadline = Instant::now() + budget;
    let ending = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ending::Exited(status),
            Ok(None) if Instant::now() >= deadline => {
                kill_group(group);
                let _ = child.wait();
                break Ending::TimedOut(budget);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Ending::NotStarted(e.to_string()),
        }
    };
    // Whatever of the step is left (a job it did not wait for, an arbiter of a crashed step).
    kill_group(group);
    ending
}

fn kill_group(group: libc::pid_t) {
    // SAFETY: kill(2) with a negative pid signals the process group this runner created
    // for the step; ESRCH (nothing left) is the usual answer and harmless.
    unsafe { libc::kill(-group, libc::SIGKILL) };
}

/// The step process: runs one step, writes its verdict to `work/result.json`.
pub fn step_process(name: &str, work: &Path) -> ExitCode {
    let step = STEPS.iter().find(|s| s.name == name).expect("parsed names");
    if std::env::var(HANG_STEP_VAR).is_ok_and(|n| n == name) {
        eprintln!("{HANG_STEP_VAR}={name}: hanging on purpose");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    let bins = match Bins::resolve() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpu-check step {name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let env = StepEnv {
        bins,
        work: work.to_path_buf(),
        simulated: std::env::var_os(SIMULATED_VAR).is_some(),
        driver: std::env::var(DRIVER_VAR).unwrap_or_else(|_| "an unknown driver".into()),
    };
    let verdict = (step.run)(&env);
    let written = serde_json::to_string(&verdict)
        .map_err(std::io::Error::other)
        .and_then(|json| std::fs::write(work.join(RESULT_FILE), json));
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-check step {name}: writing its result: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn verdicts_from_endings() {
        let ok = ExitStatus::from_raw(0);
        let crashed = ExitStatus::from_raw(libc::SIGSEGV);
        let pass = r#"{"outcome":"PASS","detail":"fine"}"#;
        let skip = r#"{"outcome":"SKIP","detail":"torch not installed"}"#;
        let table: [(Ending, Option<&str>, &str, Verdict); 6] = [
            (Ending::Exited(ok), Some(pass), "", Verdict::pass("fine")),
            (
                Ending::Exited(ok),
                Some(skip),
                "x",
                Verdict::skip("torch not installed"),
            ),
            (
                Ending::TimedOut(Duration::from_secs(30)),
                Some(pass),
                "waiting",
                Verdict::fail("timed out after 30 s (process group killed); last output: waiting"),
            ),
            (
                Ending::Exited(crashed),
                None,
                "",
                Verdict::fail("the step process ended (signal: 11 (SIGSEGV)) without a result"),
            ),
            (
                Ending::Exited(ok),
                Some("{"),
                "",
                Verdict::fail(
                    "its result is not readable (EOF while parsing an object at line 1 column 1)",
                ),
            ),
            (
                Ending::NotStarted("no such file".into()),
                None,
                "",
                Verdict::fail("the step process did not start: no such file"),
            ),
        ];
        for (ending, written, tail, want) in table {
            assert_eq!(verdict_of(&ending, written, tail), want, "{ending:?}");
        }
    }
}
