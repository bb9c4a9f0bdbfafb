//! `make gpu-check`: the interposer and the arbiter on a real NVIDIA GPU, as one
//! compatibility matrix.
//!
//! Everything else in the repository runs on the simulated GPU (tests/simgpu). This program
//! runs the probe, the workload and the frameworks a container really runs (PyTorch, CuPy,
//! Triton, where installed) against the machine's own `libcuda.so.1` and NVML, each under a
//! lease of a private arbiter, and writes what it saw to a results file (Markdown and JSON).
//! It needs nothing from a package registry: only binaries built elsewhere
//! (`GPUSHARE_BIN_DIR`) and a system `python3` for the framework steps.
//!
//! - **Driver detection** ([`driver`]): `libcuda.so.1` loads, `cuInit(0)` succeeds and a
//!   device is counted, and NVML initialises. Without a driver it says why in one line and
//!   exits 0 (CI and development machines have no GPU); a driver that is there but broken
//!   is a failure.
//! - **Each step in its own process** ([`runner`]), in its own process group, with its own
//!   time budget: a step that hangs is killed (the whole group, its arbiter and jobs too) and
//!   FAILs "timed out after N s", and the run goes on.
//! - **Results after each step** ([`report`]): the Markdown and JSON files are rewritten as
//!   every step ends, so a run that is killed loses nothing it had measured.
//! - **Binaries** ([`bins`]): `GPUSHARE_BIN_DIR`, else the release build next to this
//!   program (built with cargo when cargo is there); never a debug build silently. The
//!   report names them and their git revision.
//!
//! With a driver present, any failed step makes it exit non-zero, its last line naming the
//! failed steps. `GPUSHARE_GPU_CHECK_ON_SIMGPU=1` (with `LD_LIBRARY_PATH` at the simulated
//! driver) labels the run *simulated*: how this program is tested here.

pub mod bins;
pub mod driver;
pub mod jobs;
pub mod report;
pub mod runner;
mod steps;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

pub use steps::STEPS;

/// What a step found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Outcome {
    Pass,
    Fail,
    /// Its framework or driver feature is absent; the detail says which.
    Skip,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
        }
    }
}

/// A step's outcome and what it saw, as its process reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Verdict {
    pub outcome: Outcome,
    pub detail: String,
}

impl Verdict {
    pub fn pass(detail: impl Into<String>) -> Verdict {
        Verdict {
            outcome: Outcome::Pass,
            detail: detail.into(),
        }
    }
    pub fn fail(detail: impl Into<String>) -> Verdict {
        Verdict {
            outcome: Outcome::Fail,
            detail: detail.into(),
        }
    }
    pub fn skip(detail: impl Into<String>) -> Verdict {
        Verdict {
            outcome: Outcome::Skip,
            detail: detail.into(),
        }
    }
    /// PASS with `detail` when `ok`, else FAIL with it.
    pub fn judged(ok: bool, detail: impl Into<String>) -> Verdict {
        if ok {
            Verdict::pass(detail)
        } else {
            Verdict::fail(detail)
        }
    }
}

/// Where a step runs: the binaries, a private directory, and whether the GPU is simgpu.
pub struct StepEnv {
    pub bins: bins::Bins,
    pub work: PathBuf,
    pub simulated: bool,
    /// The GPU and driver the run found ([`driver::Gpu::summary`]), for reasons to skip.
    pub driver: String,
}

/// One row of the matrix: run in its own process within `budget`.
pub struct Step {
    /// Its name on the command line (`--steps`) and in the results.
    pub name: &'static str,
    /// What it checks, for the report.
    pub what: &'static str,
    pub budget: Duration,
    pub run: fn(&StepEnv) -> Verdict,
}

/// A finished step, as the report lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepResult {
    pub name: &'static str,
    pub what: &'static str,
    pub outcome: Outcome,
    pub detail: String,
    pub seconds: f64,
}

/// Test-only: the step named here sleeps instead of running, so that the per-step timeout
/// can be shown to kill it and the run to go on.
pub const HANG_STEP_VAR: &str = "GPUSHARE_GPU_CHECK_HANG_STEP";
/// `name=seconds,...`: budgets other than the built-in ones (a slow machine, a test).
pub const TIMEOUTS_VAR: &str = "GPUSHARE_GPU_CHECK_TIMEOUTS";
/// Set: the GPU is the simulated one; the report says so.
pub const SIMULATED_VAR: &str = "GPUSHARE_GPU_CHECK_ON_SIMGPU";
/// How the run hands the driver it found to each step process.
const DRIVER_VAR: &str = "GPUSHARE_GPU_CHECK_DRIVER";

/// The command line: `[--steps a,b,...] [RESULTS.md]`, or the step-process form
/// `--run-step NAME --work DIR` the runner uses.
#[derive(Debug, PartialEq, Eq)]
pub enum Invocation {
    Matrix {
        results: Option<PathBuf>,
        steps: Vec<&'static str>,
    },
    Step {
        name: &'static str,
        work: PathBuf,
    },
}

fn step_named(name: &str) -> Result<&'static Step, String> {
    STEPS.iter().find(|s| s.name == name).ok_or_else(|| {
        format!(
            "unknown step '{name}'; the steps are: {}",
            STEPS.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
        )
    })
}

/// Parses the command line (without the program name).
pub fn parse_args(args: &[String]) -> Result<Invocation, String> {
    let mut results = None;
    let mut steps: Vec<&'static str> = STEPS.iter().map(|s| s.name).collect();
    let (mut run_step, mut work) = (None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |key: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{key} needs a value"))
        };
        match arg.as_str() {
            "--steps" => {
                let list = value("--steps")?;
                steps = list
                    .split(',')
                    .map(|n| step_named(n.trim()).map(|s| s.name))
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("--steps '{list}': {e}"))?;
            }
            "--run-step" => run_step = Some(step_named(&value("--run-step")?)?.name),
            "--work" => work = Some(PathBuf::from(value("--work")?)),
            other if other.starts_with('-') => {
                return Err(format!(
                    "unknown option '{other}'; accepted: --steps NAME,..., a results path"
                ))
            }
            path if results.is_none() => results = Some(PathBuf::from(path)),
            extra => {
                return Err(format!(
                    "unexpected argument '{extra}' after the results path"
                ))
            }
        }
    }
    match (run_step, work) {
        (Some(name), Some(work)) => Ok(Invocation::Step { name, work }),
        (Some(_), None) => Err("--run-step needs --work DIR".into()),
        (None, _) => Ok(Invocation::Matrix { results, steps }),
    }
}

/// `name=seconds,...` from [`TIMEOUTS_VAR`].
pub fn parse_timeouts(text: &str) -> Result<Vec<(&'static str, Duration)>, String> {
    text.split(',')
        .filter(|item| !item.trim().is_empty())
        .map(|item| {
            let (name, secs) = item.split_once('=').ok_or_else(|| {
                format!("{TIMEOUTS_VAR}: '{item}' is not NAME=SECONDS (e.g. probe-alone=60)")
            })?;
            let step = step_named(name.trim()).map_err(|e| format!("{TIMEOUTS_VAR}: {e}"))?;
            let secs: u64 = secs.trim().parse().ok().filter(|&s| s > 0).ok_or_else(|| {
                format!(
                    "{TIMEOUTS_VAR}: '{secs}' for {name} is not a whole number of seconds above 0"
                )
            })?;
            Ok((step.name, Duration::from_secs(secs)))
        })
        .collect()
}

/// The process entry point of `gpushare-gpu-check`.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse_args(&args) {
        Err(e) => {
            eprintln!("gpu-check: {e}");
            ExitCode::from(2)
        }
        Ok(Invocation::Step { name, work }) => runner::step_process(name, &work),
        Ok(Invocation::Matrix { results, steps }) => {
            let results = results.unwrap_or_else(default_results);
            matrix(&results, &steps)
        }
    }
}

/// `tests/bench/results/gpu-check.md` of the checkout the program runs in (make gpu-check
/// runs it from the repository root), else `gpu-check.md` here: on a GPU machine the binaries
/// may come without the checkout they were built from.
fn default_results() -> PathBuf {
    let in_checkout = Path::new("tests/bench/results");
    if in_checkout.is_dir() {
        in_checkout.join("gpu-check.md")
    } else {
        PathBuf::from("gpu-check.md")
    }
}

fn matrix(results: &Path, names: &[&'static str]) -> ExitCode {
    let simulated = std::env::var_os(SIMULATED_VAR).is_some();
    let gpu = match driver::detect() {
        driver::Detection::Absent(why) => {
            println!("gpu-check: no NVIDIA driver on this machine ({why}); nothing to check");
            return ExitCode::SUCCESS;
        }
        driver::Detection::Broken(why) => {
            println!("gpu-check: FAILED: driver ({why})");
            return ExitCode::FAILURE;
        }
        driver::Detection::Present(gpu) => gpu,
    };
    let timeouts = match std::env::var(TIMEOUTS_VAR).map(|t| parse_timeouts(&t)) {
        Ok(Err(e)) => {
            println!("gpu-check: FAILED: {e}");
            return ExitCode::FAILURE;
        }
        Ok(Ok(t)) => t,
        Err(_) => Vec::new(),
    };
    let bins = match bins::Bins::resolve() {
        Ok(b) => b,
        Err(e) => {
            println!("gpu-check: FAILED: binaries ({e})");
            return ExitCode::FAILURE;
        }
    };
    let work = match tempfile::Builder::new().prefix("gpu-check-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            println!("gpu-check: FAILED: a work directory ({e})");
            return ExitCode::FAILURE;
        }
    };
    let mut report = report::Report::new(results, simulated, &gpu, &bins);
    println!("gpu-check: {} on {}", report.kind(), gpu.summary());
    for name in names {
        let step = STEPS
            .iter()
            .find(|s| s.name == *name)
            .expect("parsed names");
        let budget = timeouts
            .iter()
            .find(|(n, _)| n == name)
            .map_or(step.budget, |(_, d)| *d);
        let dir = work.path().join(step.name);
        let (verdict, took) = runner::run_in_child(step, &dir, budget, &bins, &gpu.summary());
        let result = StepResult {
            name: step.name,
            what: step.what,
            outcome: verdict.outcome,
            detail: verdict.detail,
            seconds: took.as_secs_f64(),
        };
        println!(
            "{} {} ({:.1} s): {}",
            result.outcome.label(),
            result.name,
            result.seconds,
            result.detail
        );
        report.push(result);
        if let Err(e) = report.write() {
            println!("gpu-check: FAILED: writing {} ({e})", results.display());
            return ExitCode::FAILURE;
        }
    }
    let failed = report.failed();
    if failed.is_empty() {
        println!(
            "gpu-check: every step passed or skipped ({} skipped); results in {}",
            report.skipped(),
            results.display()
        );
        ExitCode::SUCCESS
    } else {
        println!(
            "gpu-check: FAILED: {} (results in {})",
            failed.join(", "),
            results.display()
        );
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn command_lines() {
        let all: Vec<&str> = STEPS.iter().map(|s| s.name).collect();
        assert_eq!(
            parse_args(&[]),
            Ok(Invocation::Matrix {
                results: None,
                steps: all.clone()
            })
        );
        assert_eq!(
            parse_args(&args(&["--steps", "memory-quota, probe-alone", "out.md"])),
            Ok(Invocation::Matrix {
                results: Some("out.md".into()),
                steps: vec!["memory-quota", "probe-alone"]
            })
        );
        assert_eq!(
            parse_args(&args(&["--run-step", "probe-alone", "--work", "/w"])),
            Ok(Invocation::Step {
                name: "probe-alone",
                work: "/w".into()
            })
        );
        let errors = [
            (
                &["--steps", "nope"][..],
                "--steps 'nope': unknown step 'nope'; the steps are: probe-alone",
            ),
            (&["--steps"][..], "--steps needs a value"),
            (
                &["--run-step", "probe-alone"][..],
                "--run-step needs --work DIR",
            ),
            (&["--fast"][..], "unknown option '--fast'"),
            (&["a.md", "b.md"][..], "unexpected argument 'b.md'"),
        ];
        for (line, want) in errors {
            let got = parse_args(&args(line)).unwrap_err();
            assert!(got.starts_with(want), "{line:?}: {got}");
        }
    }

    #[test]
    fn timeouts() {
        assert_eq!(
            parse_timeouts("probe-alone=3, memory-quota=90"),
            Ok(vec![
                ("probe-alone", Duration::from_secs(3)),
                ("memory-quota", Duration::from_secs(90))
            ])
        );
        assert_eq!(parse_timeouts(""), Ok(vec![]));
        for (text, want) in [
            ("probe-alone", "is not NAME=SECONDS"),
            (
                "probe-alone=0",
                "'0' for probe-alone is not a whole number of seconds above 0",
            ),
            ("probe-alone=1.5", "'1.5' for probe-alone"),
            ("nope=3", "unknown step 'nope'"),
        ] {
            let got = parse_timeouts(text).unwrap_err();
            assert!(
                got.contains(want) && got.starts_with(TIMEOUTS_VAR),
                "{text}: {got}"
            );
        }
    }

    #[test]
    fn every_step_has_a_unique_name_and_the_budgets_fit_8_minutes() {
        let mut names: Vec<&str> = STEPS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), STEPS.len());
        let total: Duration = STEPS.iter().map(|s| s.budget).sum();
        assert!(total <= Duration::from_secs(8 * 60), "{total:?}");
    }
}
