//! The hardware's time slice and context-switch cost, from two kernels' own traces.
//!
//! Two bare probes run `timeslice-trace` at once (tests/simgpu/ptx/trace.ptx): each kernel
//! records the stretches in which it was not running, on `%globaltimer`, which every context
//! shares. Between two contexts with work the GPU alternates at its time slice, so each
//! kernel's running stretches (inside the run, not its first or last) are slices, and the
//! time between one kernel's stretch ending and the other's starting is a context switch.
//! As root the slice can be changed (`nvidia-smi compute-policy --set-timeslice`, device
//! wide): short, medium and long are measured too, and the default is restored after.

use crate::gpu_check::jobs::probe;
use crate::gpu_check::{StepEnv, Verdict};
use std::process::{Command, Output};

/// How long each traced kernel runs: many slices of any length the driver offers.
const TRACE_MS: &str = "2000";

/// One kernel's trace: its start and end and the gaps in which it did not run (ns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub start: u64,
    pub end: u64,
    pub gaps: Vec<(u64, u64)>,
}

impl Trace {
    /// From the probe's `timeslice-trace CUDA_SUCCESS start=… end=… gaps=N gap_list=A-B,…`.
    pub fn parse(line: &str) -> Option<Trace> {
        let value = |key: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        };
        let gaps = value("gap_list")?
            .split(',')
            .filter(|g| !g.is_empty())
            .map(|g| {
                let (from, to) = g.split_once('-')?;
                Some((from.parse().ok()?, to.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Trace {
            start: value("start")?.parse().ok()?,
            end: value("end")?.parse().ok()?,
            gaps,
        })
    }

    /// The stretches in which the kernel ran, in order.
    fn running(&self) -> Vec<(u64, u64)> {
        let mut from = self.start;
        let mut stretches = Vec::new();
        for &(gap_from, gap_to) in &self.gaps {
            stretches.push((from, gap_from));
            from = gap_to;
        }
        stretches.push((from, self.end));
        stretches
    }
}

/// What two traces say about the hardware (µs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SliceFacts {
    /// Median length of a running stretch between two gaps.
    pub slice_us: f64,
    /// Median time from one kernel's stretch ending to the other's beginning.
    pub switch_us: f64,
    /// How many slices the median is over.
    pub slices: usize,
}

fn median(mut values: Vec<u64>) -> Option<f64> {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2] as f64),
        _ => Some((values[n / 2 - 1] + values[n / 2]) as f64 / 2.0),
    }
}

/// The facts, or None when the kernels never alternated (no interior slice on either side).
pub fn slice_facts(a: &Trace, b: &Trace) -> Option<SliceFacts> {
    let interior = |t: &Trace| {
        let running = t.running();
        let n = running.len();
        running
            .into_iter()
            .skip(1)
            .take(n.saturating_sub(2))
            .map(|(from, to)| to.saturating_sub(from))
            .collect::<Vec<_>>()
    };
    let slices: Vec<u64> = interior(a).into_iter().chain(interior(b)).collect();
    let mut all: Vec<(u64, u64, bool)> = a
        .running()
        .into_iter()
        .map(|(f, t)| (f, t, true))
        .chain(b.running().into_iter().map(|(f, t)| (f, t, false)))
        .collect();
    all.sort_unstable();
    let switches: Vec<u64> = all
        .windows(2)
        .filter(|w| w[0].2 != w[1].2 && w[1].0 >= w[0].1)
        .map(|w| w[1].0 - w[0].1)
        .collect();
    Some(SliceFacts {
        slices: slices.len(),
        slice_us: median(slices)? / 1000.0,
        switch_us: median(switches)? / 1000.0,
    })
}

/// Two traced kernels at once; their facts, or why there are none.
fn measure(env: &StepEnv, round: &str) -> Result<SliceFacts, String> {
    let go = env.work.join(format!("go-{round}"));
    let go = go.to_str().unwrap_or_default();
    let args = ["wait", go, "timeslice-trace", TRACE_MS];
    let spawn = || {
        probe(env, None, &args)
            .spawn()
            .map_err(|e| format!("starting a probe: {e}"))
    };
    let (a, b) = (spawn()?, spawn()?);
    std::fs::write(go, "").map_err(|e| e.to_string())?;
    let outputs = [a, b].map(|c| c.wait_with_output());
    let traces = outputs
        .iter()
        .map(|out| {
            let out = out.as_ref().map_err(|e| e.to_string())?;
            trace_of(out)
        })
        .collect::<Result<Vec<_>, String>>()?;
    slice_facts(&traces[0], &traces[1]).ok_or_else(|| {
        format!(
            "the two kernels never took turns ({} and {} gaps)",
            traces[0].gaps.len(),
            traces[1].gaps.len()
        )
    })
}

fn trace_of(out: &Output) -> Result<Trace, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find(|l| l.starts_with("timeslice-trace CUDA_SUCCESS "))
        .and_then(Trace::parse)
        .ok_or_else(|| {
            let mut text = format!(
                "{} {}",
                stdout.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
            text.truncate(300);
            format!("no trace: {text}")
        })
}

/// `nvidia-smi compute-policy --set-timeslice LEVEL` on GPU 0 (0 default, 1 short,
/// 2 medium, 3 long); root only.
fn set_timeslice(level: u8) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    let level = level.to_string();
    let out = Command::new("nvidia-smi")
        .args(["compute-policy", "-i", "0", "--set-timeslice", &level])
        .output()
        .map_err(|e| format!("nvidia-smi: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nvidia-smi compute-policy --set-timeslice {level}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn describe(facts: &SliceFacts) -> String {
    format!(
        "slice {:.0} µs (median of {}), context switch {:.1} µs",
        facts.slice_us, facts.slices, facts.switch_us
    )
}

/// The default slice, then short, medium and long where this process may set them.
pub fn timeslice(env: &StepEnv) -> Verdict {
    if env.simulated {
        // simgpu runs no kernel code: its traces are empty. Its own figures are what it
        // simulates, and the traces are still run so the probe step is exercised.
        let traced = measure(env, "default");
        let config = simgpu_model::SimConfig::from_lookup(|k| std::env::var(k).ok());
        return match (traced, config) {
            (Err(e), Ok(config)) if e.starts_with("the two kernels never took turns") => {
                Verdict::pass(format!(
                    "(simulated) slice {} µs, context switch {} µs: simgpu's SIMGPU_SLICE_US and SIMGPU_SWITCH_US (it runs no kernel code, so the traces are empty)",
                    config.slice_ns / 1000,
                    config.switch_ns / 1000
                ))
            }
            (Ok(facts), _) => Verdict::pass(format!("(simulated) {}", describe(&facts))),
            (Err(e), _) => Verdict::fail(e),
        };
    }
    let default = match measure(env, "default") {
        Ok(f) => f,
        Err(e) => return Verdict::fail(format!("default: {e}")),
    };
    let mut seen = vec![format!("default: {}", describe(&default))];
    let mut changed = false;
    for (level, name) in [(1, "short"), (2, "medium"), (3, "long")] {
        match set_timeslice(level) {
            Ok(()) => {
                changed = true;
                seen.push(match measure(env, name) {
                    Ok(f) => format!("{name}: {}", describe(&f)),
                    Err(e) => format!("{name}: not measured ({e})"),
                });
            }
            Err(why) => {
                seen.push(format!("short/medium/long: not measured ({why})"));
                break;
            }
        }
    }
    if changed {
        if let Err(e) = set_timeslice(0) {
            return Verdict::fail(format!(
                "{}; restoring the default time slice FAILED: {e}",
                seen.join("; ")
            ));
        }
    }
    Verdict::pass(seen.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_parse() {
        let line = "timeslice-trace CUDA_SUCCESS start=100 end=900 gaps=2 gap_list=200-300,500-650";
        assert_eq!(
            Trace::parse(line),
            Some(Trace {
                start: 100,
                end: 900,
                gaps: vec![(200, 300), (500, 650)]
            })
        );
        let empty = "timeslice-trace CUDA_SUCCESS start=0 end=0 gaps=0 gap_list=";
        assert_eq!(
            Trace::parse(empty),
            Some(Trace {
                start: 0,
                end: 0,
                gaps: vec![]
            })
        );
        assert_eq!(
            Trace::parse("timeslice-trace CUDA_SUCCESS start=1 end=2 gap_list=5"),
            None
        );
        assert_eq!(
            Trace::parse("timeslice-trace CUDA_SUCCESS end=2 gap_list="),
            None
        );
    }

    #[test]
    fn two_kernels_taking_turns() {
        // a runs 0-1000, 1100-2100, 2200-3000; b runs 1020-1080, 2120-2180 (ns).
        let a = Trace {
            start: 0,
            end: 3000,
            gaps: vec![(1000, 1100), (2100, 2200)],
        };
        let b = Trace {
            start: 1020,
            end: 2180,
            gaps: vec![(1080, 2120)],
        };
        let facts = slice_facts(&a, &b).unwrap();
        // Interior slices: a's 1100-2100 (1000 ns); b has none (two stretches only).
        assert_eq!(facts.slices, 1);
        assert_eq!(facts.slice_us, 1.0);
        // a→b at 1000→1020, b→a at 1080→1100, a→b 2100→2120, b→a 2180→2200: all 20 ns.
        assert_eq!(facts.switch_us, 0.02);
        let alone = Trace {
            start: 0,
            end: 100,
            gaps: vec![],
        };
        assert_eq!(
            slice_facts(&alone, &alone.clone()),
            None,
            "never took turns"
        );
    }
}
