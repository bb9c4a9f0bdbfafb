//! gpushare-bench: runs the compute-isolation experiments on the simulated GPU and writes
//! `compute-isolation.json` and `compute-isolation.md`. Builds nothing: see `Binaries::locate`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpushare_bench::experiment::{run_case, ExperimentError, LowKernels, Mode, Parameters};
use gpushare_bench::metrics;
use gpushare_bench::report;
use gpushare_bench::setup::{self, Binaries, SetupError};
use serde_json::{json, Map, Value};

const SCENARIOS: [&str; 11] = [
    "priority", "shares", "kernels", "e1", "e2", "e2-mixed", "e3", "e5", "cluster", "liars",
    "reclaim",
];
/// The kernel-length sweep of what the low-priority job launches: kernels of 100 µs (what every
/// other scenario uses), 1–20 ms (real GEMMs, convolutions and attention), and a real CUDA
/// graph of ten 5 ms kernels, captured once and launched as one 50 ms unit per iteration.
const KERNEL_SWEEP: [LowKernels; 5] = [
    LowKernels::Plain { kernel_us: 100 },
    LowKernels::Plain { kernel_us: 1_000 },
    LowKernels::Plain { kernel_us: 5_000 },
    LowKernels::Plain { kernel_us: 20_000 },
    LowKernels::Graph {
        kernels: 10,
        kernel_us: 5_000,
    },
];
/// `--quick`'s sweep: the shortest and longest plain kernels and the graph (it checks the
/// harness; 2 CPUs must run the whole quick run in a few minutes).
const QUICK_KERNEL_SWEEP: [LowKernels; 3] = [KERNEL_SWEEP[0], KERNEL_SWEEP[3], KERNEL_SWEEP[4]];
/// The modes every scenario runs unless `--modes` says otherwise.
const DEFAULT_MODES: &str = "alone,uncontrolled,round-robin,gpushare,tgs";
/// The kernels scenario's default adds `gpushare-before` (gpushare without
/// duration-aware admission); the other scenarios run it only when `--modes` names it.
const KERNELS_DEFAULT_MODES: &str = "alone,uncontrolled,round-robin,tgs,gpushare-before,gpushare";
/// Exit status when the arbiter refuses its configuration (a `[scheduler]` table it predates),
/// or a `--gpushare-set` line names a key or value the `[scheduler]` table does not take.
const EXIT_CONFIG_REFUSED: u8 = 3;

#[derive(Parser, Debug)]
#[command(about = "Compute-isolation experiments on the simulated GPU (every figure simulated)")]
struct Args {
    /// Each case briefly (about 1.5 s of workload), to check the harness rather than measure.
    #[arg(long)]
    quick: bool,
    /// Seconds each case's workloads run (default 10, or 1.5 with --quick).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Results directory.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out: PathBuf,
    /// Only this scenario: priority, shares, kernels (low kernel lengths), e1 (training
    /// pairs), e2 (jobs arriving on 4 GPUs), e2-mixed (mixed priorities arriving on 4 GPUs), e3 (inference latency), e5 (scaling) or cluster
    /// (the cluster simulation of kube-scheduler on 1,000 nodes: its files go straight into
    /// --out, or into --out/cluster-issue-17 when every scenario runs) or liars (low jobs
    /// that lie to the interposer beside the high job: their files go into --out/liars) or
    /// reclaim (memory reclaim: latency against bytes and a bursty inference job beside
    /// training jobs; only when named; its files go into --out/reclaim).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SCENARIOS))]
    scenario: Option<String>,
    /// Modes, comma-separated: alone, uncontrolled, round-robin, tgs, gpushare-before,
    /// gpushare. Default: all but gpushare-before, which the kernels scenario adds
    /// (gpushare with `admit_by_duration = false`).
    #[arg(long)]
    modes: Option<String>,
    /// The round-robin slices (ms), one round-robin mode each (250: a Gemini-like quota).
    #[arg(long, value_delimiter = ',', default_value = "1,10,250")]
    round_robin_slices_ms: Vec<u64>,
    /// Seed of the first job's kernel durations (the others take the next ones); the same in
    /// every mode, so modes differ only in how the GPU is shared.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// An extra `key = value` setting of the gpushare mode's `[scheduler]` table (repeatable),
    /// to measure other settings than the defaults (e.g. `--gpushare-set 'idle_us = 100'`).
    /// The results record them; an unknown key stops the run (exit status 3).
    #[arg(long = "gpushare-set")]
    gpushare_set: Vec<String>,
    /// Seconds each case of e1 and e3 runs (default 10, or 1 with --quick: they have the
    /// most cases).
    #[arg(long)]
    e_duration_s: Option<f64>,
    /// Run nothing: re-write the Markdown and the charts of the results in `--out` from
    /// their JSON, which stays as it is (after the report or the charts changed); the cluster
    /// simulation's too (in --out/cluster-issue-17, or in --out with --scenario cluster);
    /// with --scenario reclaim, only --out/reclaim's.
    #[arg(long)]
    rerender: bool,
    /// e2-mixed: multiply each job shape's CPU gap by this (1: E2's shapes; 3: lighter jobs).
    #[arg(long, default_value_t = 1.0)]
    e2_mixed_gap_scale: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-bench: {e}");
            match e {
                ExperimentError::Setup(
                    SetupError::ConfigRefused { .. } | SetupError::BadSetting(_),
                ) => ExitCode::from(EXIT_CONFIG_REFUSED),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn run(args: &Args) -> Result<(), ExperimentError> {
    if args.rerender {
        let io = |what: String| move |source| ExperimentError::Io { what, source };
        use gpushare_bench::kube_sim;
        if args.scenario.as_deref() == Some("reclaim") {
            use gpushare_bench::reclaim;
            let dir = args.out.join(reclaim::RESULTS_SUBDIR);
            let path = dir.join(reclaim::JSON_FILE);
            let text = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
            let results: Value = serde_json::from_slice(&text).map_err(|e| {
                ExperimentError::Usage(format!("{} is not a results document: {e}", path.display()))
            })?;
            return reclaim::write_rendered(&dir, &results)
                .map_err(io(format!("re-rendering {}", dir.display())));
        }
        if args.scenario.as_deref() == Some("cluster") {
            return kube_sim::rerender(&args.out)
                .map_err(io(format!("re-rendering {}", args.out.display())));
        }
        let cluster = args.out.join(kube_sim::RESULTS_SUBDIR);
        if cluster.join(kube_sim::JSON_FILE).exists() {
            kube_sim::rerender(&cluster)
                .map_err(io(format!("re-rendering {}", cluster.display())))?;
        }
        let path = args.out.join(report::JSON_FILE);
        let text = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        let results: Value = serde_json::from_slice(&text).map_err(|e| {
            ExperimentError::Usage(format!("{} is not a results document: {e}", path.display()))
        })?;
        // The JSON itself is left as measured (a parse and re-print would round floats).
        let md = args.out.join(report::MARKDOWN_FILE);
        std::fs::write(&md, report::markdown(&results))
            .map_err(io(format!("writing {}", md.display())))?;
        return gpushare_bench::plot::write_all(&args.out, &results)
            .map(drop)
            .map_err(io(format!(
                "writing the charts into {}",
                args.out.display()
            )));
    }
    let parse_modes = |text: &str| {
        Mode::parse_list(text, &args.round_robin_slices_ms).map_err(ExperimentError::Usage)
    };
    let modes = parse_modes(args.modes.as_deref().unwrap_or(DEFAULT_MODES))?;
    let kernel_modes = parse_modes(args.modes.as_deref().unwrap_or(KERNELS_DEFAULT_MODES))?;
    let duration_s = args
        .duration_s
        .unwrap_or(if args.quick { 1.5 } else { 10.0 });
    let parameters = Parameters::new(
        duration_s,
        args.seed,
        args.round_robin_slices_ms.clone(),
        args.gpushare_set.clone(),
    );
    if args.scenario.as_deref().is_none_or(|s| s == "cluster") {
        // A simulation of its own (no binaries, no simulated GPU), in its own files.
        use gpushare_bench::kube_sim::{self, ClusterParameters};
        let dir = match args.scenario {
            Some(_) => args.out.clone(),
            None => args.out.join(kube_sim::RESULTS_SUBDIR),
        };
        kube_sim::run_and_write(&dir, &ClusterParameters::new(args.quick, args.seed)).map_err(
            |source| ExperimentError::Io {
                what: format!("writing the cluster simulation into {}", dir.display()),
                source,
            },
        )?;
        eprintln!(
            "gpushare-bench: wrote the cluster simulation into {}",
            dir.display()
        );
        if args.scenario.is_some() {
            return Ok(());
        }
    }
    // A setting the `[scheduler]` table refuses stops the run before any case has run.
    Mode::GpushareBefore.scheduler(&parameters.gpushare_settings)?;
    let binaries = Binaries::locate()?;
    let libs = setup::simgpu_libs()?;
    let wanted = |name: &str| args.scenario.as_deref().is_none_or(|s| s == name);
    let case = |mode: Mode, jobs: &[gpushare_bench::experiment::Job]| {
        eprintln!(
            "gpushare-bench: {} with {} ({} s, simulated)",
            jobs.iter()
                .map(|j| j.name.as_str())
                .collect::<Vec<_>>()
                .join(" + "),
            mode.name(),
            duration_s
        );
        run_case(&binaries, libs, &parameters, mode, jobs)
    };

    if args.scenario.as_deref() == Some("reclaim") {
        return run_reclaim(args, &binaries, libs);
    }
    if wanted("liars") {
        use gpushare_bench::liars::{self, Variant};
        let dir = args.out.join(liars::RESULTS_SUBDIR);
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        let mut results = results_header(
            "Every figure is simulated: GPU time is the simgpu model's, not a device's.",
            &command,
            &binaries,
        );
        results["parameters"] = json!(parameters);
        results["scenarios"] =
            json!({"liars": liars::run(&binaries, libs, &parameters, &Variant::ALL)?});
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(&dir)?;
            let text = serde_json::to_string_pretty(&results).map_err(std::io::Error::other)?;
            std::fs::write(dir.join(liars::JSON_FILE), text + "\n")?;
            std::fs::write(
                dir.join(liars::MARKDOWN_FILE),
                liars::markdown(&results, &command),
            )
        };
        write().map_err(|source| ExperimentError::Io {
            what: format!("writing the liars' results into {}", dir.display()),
            source,
        })?;
        eprintln!(
            "gpushare-bench: wrote the liars' results into {}",
            dir.display()
        );
        if args.scenario.is_some() {
            return Ok(());
        }
    }
    let mut scenarios = Map::new();
    if wanted("priority") {
        let mut by_mode = Map::new();
        // The baseline every shared case is set against, whatever modes were asked for.
        let alone = case(Mode::Alone, &[parameters.high_job()])?.remove(0);
        let mut alone_cases = Map::new();
        alone_cases.insert(
            "0".into(),
            json!({"metrics": metrics::alone_case(&alone)?, "jobs": [alone.clone()]}),
        );
        by_mode.insert(Mode::Alone.name(), Value::Object(alone_cases));
        for &mode in modes.iter().filter(|&&m| m != Mode::Alone) {
            let mut cases = Map::new();
            for &n in &parameters.low_job_counts {
                let mut jobs = vec![parameters.high_job()];
                jobs.extend((0..n).map(|i| parameters.low_job(i, 0.0, 1.0)));
                let reports = case(mode, &jobs)?;
                let figures = metrics::priority_case(&alone, &reports[0], &reports[1..])?;
                cases.insert(n.to_string(), json!({"metrics": figures, "jobs": reports}));
            }
            by_mode.insert(mode.name(), Value::Object(cases));
        }
        scenarios.insert("priority".into(), Value::Object(by_mode));
    }
    if wanted("kernels") {
        // Beside one saturating low job of each launch length, the priority scenario's high
        // job (how much of the GPU it finds taken when it comes back) and E3's inference job
        // (request latency). Each high job alone is measured once, whatever the length.
        let sweep: &[LowKernels] = if args.quick {
            &QUICK_KERNEL_SWEEP
        } else {
            &KERNEL_SWEEP
        };
        let duration_ms = (parameters.duration_s * 1e3).round() as u64;
        let inference = || gpushare_bench::e3::inference_job(parameters.seed, duration_ms);
        let alone = case(Mode::Alone, &[parameters.high_job()])?.remove(0);
        let inference_alone = case(Mode::Alone, &[inference()])?.remove(0);
        let (mut by_length, mut inference_by_length, mut lows) =
            (Map::new(), Map::new(), Map::new());
        for &low in sweep {
            let (mut by_mode, mut inference_by_mode) = (Map::new(), Map::new());
            for &mode in kernel_modes.iter().filter(|&&m| m != Mode::Alone) {
                let reports = case(mode, &[parameters.high_job(), parameters.low_job_for(low)])?;
                let figures = metrics::priority_case(&alone, &reports[0], &reports[1..])?;
                by_mode.insert(mode.name(), json!({"metrics": figures, "jobs": reports}));
                let reports = case(mode, &[inference(), parameters.low_job_for(low)])?;
                let figures = gpushare_bench::e3::latency_metrics(
                    &inference_alone,
                    &reports[0],
                    Some(&reports[1]),
                )?;
                inference_by_mode.insert(mode.name(), json!({"metrics": figures, "jobs": reports}));
            }
            by_length.insert(low.key(), Value::Object(by_mode));
            inference_by_length.insert(low.key(), Value::Object(inference_by_mode));
            lows.insert(low.key(), low.describe());
        }
        let inference_alone_metrics =
            gpushare_bench::e3::latency_metrics(&inference_alone, &inference_alone, None)?;
        scenarios.insert(
            "kernels".into(),
            json!({
                "modes": kernel_modes.iter().map(|m| m.name()).collect::<Vec<_>>(),
                "lows": lows,
                "alone": {"metrics": metrics::alone_case(&alone)?, "jobs": [alone]},
                "low_kernel_us": by_length,
                "inference": {
                    "alone": {"metrics": inference_alone_metrics, "jobs": [inference_alone]},
                    "low_kernel_us": inference_by_length,
                },
            }),
        );
    }
    if wanted("shares") {
        let mut by_mode = Map::new();
        // Shares need neighbours: the `alone` mode has no case here.
        for &mode in modes.iter().filter(|&&m| m != Mode::Alone) {
            let pair = case(
                mode,
                &[
                    parameters.low_job(0, 0.3, 1.0),
                    parameters.low_job(1, 0.6, 1.0),
                ],
            )?;
            let limited = case(mode, &[parameters.low_job(0, 0.0, 0.5)])?;
            let share = metrics::gpu_fraction("limited", &limited[0])?;
            by_mode.insert(
                mode.name(),
                json!({
                    "pair": {
                        "metrics": metrics::share_pair(&pair[0], &pair[1])?,
                        "jobs": pair,
                    },
                    "limited": {"metrics": {"share": share, "limit": 0.5}, "jobs": limited},
                }),
            );
        }
        scenarios.insert("shares".into(), Value::Object(by_mode));
    }
    let e_duration_ms = (args
        .e_duration_s
        .unwrap_or(if args.quick { 1.0 } else { 10.0 })
        * 1e3)
        .round() as u64;
    if wanted("e1") {
        let e1 = gpushare_bench::e1::run(&modes, args.seed, e_duration_ms, &case)?;
        scenarios.insert("e1".into(), e1);
    }
    if wanted("e3") {
        let e3 = gpushare_bench::e3::run(&modes, &parameters, e_duration_ms, &case)?;
        scenarios.insert("e3".into(), e3);
    }
    if wanted("e2") {
        use gpushare_bench::cluster::{self, E2Mode, E2Parameters};
        let p = E2Parameters::new(args.quick, args.seed);
        let e2 = cluster::run_all(&binaries, libs, &p, &E2Mode::ALL)?;
        scenarios.insert("e2".into(), e2);
    }
    if wanted(gpushare_bench::e2_mixed::SCENARIO) {
        use gpushare_bench::cluster::E2Mode;
        use gpushare_bench::e2_mixed::{self, MixedParameters};
        let p = MixedParameters::new(args.quick, args.seed, args.e2_mixed_gap_scale);
        let mixed = e2_mixed::run_all(&binaries, libs, &p, &E2Mode::ALL)?;
        scenarios.insert(e2_mixed::SCENARIO.into(), mixed);
    }
    if wanted("e5") {
        use gpushare_bench::scaling::{self, E5Parameters};
        let e5 = scaling::run_all(&binaries, libs, &parameters, &E5Parameters::new(args.quick))?;
        scenarios.insert("e5".into(), e5);
    }

    let results = json!({
        "simulated": true,
        "note": "Every figure is simulated: GPU time is the simgpu model's, not a device's.",
        "machine": report::machine(),
        "binaries": {"dir": binaries.dir, "preload": binaries.preload, "profile": binaries.profile},
        "parameters": parameters,
        "modes": modes.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "scenarios": scenarios,
        "control_path": gpushare_bench::control_path::gather(&args.out),
    });
    report::write(&args.out, &results).map_err(|source| ExperimentError::Io {
        what: format!("writing the results into {}", args.out.display()),
        source,
    })?;
    eprintln!(
        "gpushare-bench: wrote {} and {}",
        args.out.join(report::JSON_FILE).display(),
        args.out.join(report::MARKDOWN_FILE).display()
    );
    Ok(())
}

/// `--scenario reclaim`: the latency benchmark and the scenario, into `--out/reclaim`.
fn run_reclaim(
    args: &Args,
    binaries: &Binaries,
    libs: &std::path::Path,
) -> Result<(), ExperimentError> {
    use gpushare_bench::reclaim::{self, LatencyParameters, ScenarioParameters};
    let dir = args.out.join(reclaim::RESULTS_SUBDIR);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let latency = reclaim::run_latency(binaries, libs, &LatencyParameters::new(args.quick))?;
    let scenario = reclaim::run_scenario(
        binaries,
        libs,
        &ScenarioParameters::new(args.quick, args.seed, args.duration_s),
    )?;
    let mut results = results_header(
        "Every figure is simulated: the checkpoint copy is simgpu's model, not a device's.",
        &command,
        binaries,
    );
    results["latency"] = latency;
    results["scenario"] = scenario;
    reclaim::write(&dir, &results).map_err(|source| ExperimentError::Io {
        what: format!("writing the reclaim results into {}", dir.display()),
        source,
    })?;
    eprintln!(
        "gpushare-bench: wrote the reclaim results into {}",
        dir.display()
    );
    Ok(())
}

/// What every scenario's own results document starts with: simulated, why, the command, the
/// machine and the binaries.
fn results_header(note: &str, command: &str, binaries: &Binaries) -> Value {
    json!({
        "simulated": true,
        "note": note,
        "command": command,
        "machine": report::machine(),
        "binaries": {"dir": binaries.dir, "preload": binaries.preload, "profile": binaries.profile},
    })
}
