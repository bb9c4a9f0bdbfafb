//! Command-line options (parsed by hand: the program must stay small and quick to build).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OptionsError {
    #[error("{0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> OptionsError {
    OptionsError::Invalid(msg.into())
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    Fixed(u64),
    Uniform {
        low: u64,
        high: u64,
    },
    /// Lognormal with the given median (ns) and sigma of the underlying normal.
    LogNormal {
        median: u64,
        sigma: f64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncStyle {
    Context,
    Stream,
    Event,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub device: i32,
    pub memory: u64,
    pub memory_growth: u64,
    /// Allocate managed (unified) memory (`cuMemAllocManaged`) rather than device memory.
    pub managed: bool,
    pub kernels: u32,
    pub distribution: Distribution,
    pub gap_ns: u64,
    pub sync: SyncStyle,
    pub iterations: Option<u64>,
    pub duration_ns: Option<u64>,
    /// Kernels queued before the program synchronises inside an iteration (0: the whole burst).
    pub launch_ahead: u32,
    /// Iterations in flight before waiting for the oldest (needs `--sync event` to overlap).
    pub pipeline: u32,
    pub per_thread_default_stream: bool,
    pub seed: u64,
    pub start_barrier: Option<PathBuf>,
    /// Report how long each iteration's first kernel waited to start running (needs the
    /// simulated driver's `simgpuEventTimestampNs`).
    pub report_start: bool,
    /// Inference mode: requests arrive as a Poisson process of this rate (per second); each
    /// is `kernels` kernels then a synchronisation, served one at a time, its latency taken
    /// from its scheduled arrival (queueing counts). `iterations` counts requests; `gap`
    /// and `pipeline` do not apply.
    pub requests_per_s: Option<f64>,
    /// Each iteration's `kernels` launches are captured once, at start, into a CUDA graph on
    /// a created stream (durations drawn then, parameters copied at capture as CUDA does);
    /// every iteration is then one `cuGraphLaunch` into that stream, which the sync style and
    /// the pipeline apply to. Not with `--launch-ahead` or `--requests-per-s`.
    pub graph: bool,
    /// Kernel lengths that change mid-run: from this long after the start barrier on,
    /// plain kernels follow this distribution instead (`--then-kernel AFTER:DIST`).
    pub then_kernel: Option<(u64, Distribution)>,
    /// Inference mode: each request allocates this many bytes before its kernels (drawn
    /// uniformly from the range, in whole MiB, from a stream of its own seeded by `seed`) and
    /// frees them after its synchronisation (`--request-memory MIN[:MAX]`).
    pub request_memory: Option<(u64, u64)>,
}

pub const USAGE: &str = "simgpu-workload [--device N] [--memory BYTES] [--memory-growth BYTES] [--managed] \
[--kernels N] [--kernel DIST] [--gap DURATION] [--sync context|stream|event] \
[--iterations N | --duration DURATION] [--launch-ahead N] [--pipeline N] [--ptds] [--seed N] \
[--start-barrier FILE] [--report-start] [--requests-per-s R [--request-memory MIN[:MAX]]] [--graph] \
[--then-kernel AFTER:DIST]\n  DIST: fixed:1ms | uniform:200us:2ms | lognormal:1ms:0.5 (median, sigma)";

fn duration(text: &str) -> Result<u64, OptionsError> {
    if text == "0" {
        return Ok(0);
    }
    simgpu_model_duration(text)
        .ok_or_else(|| invalid(format!("bad duration {text:?} (e.g. 250us, 2ms, 1s)")))
}

/// Same units as kernel names: ns, us, ms, s.
fn simgpu_model_duration(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().ok()?;
    n.checked_mul(match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return None,
    })
}

/// A size in bytes: a number, or with a unit (`Ki Mi Gi`, `K M G`).
pub fn bytes(text: &str) -> Result<u64, OptionsError> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| invalid(format!("bad size {text:?}")))?;
    let mult = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return Err(invalid(format!("bad size unit in {text:?}"))),
    };
    n.checked_mul(mult).ok_or_else(|| invalid("size too large"))
}

/// `MIN[:MAX]` sizes (`2Gi:6Gi`; one size: every request the same), MIN no more than MAX.
fn byte_range(text: &str) -> Result<(u64, u64), OptionsError> {
    let (low, high) = match text.split_once(':') {
        Some((a, b)) => (bytes(a)?, bytes(b)?),
        None => (bytes(text)?, bytes(text)?),
    };
    if low > high {
        return Err(invalid(format!(
            "--request-memory {text:?}: the smallest size is above the largest (MIN[:MAX])"
        )));
    }
    Ok((low, high))
}

fn distribution(text: &str) -> Result<Distribution, OptionsError> {
    let parts: Vec<&str> = text.split(':').collect();
    match parts.as_slice() {
        ["fixed", d] => Ok(Distribution::Fixed(duration(d)?)),
        ["uniform", a, b] => {
            let (low, high) = (duration(a)?, duration(b)?);
            if low > high {
                return Err(invalid("uniform: low > high"));
            }
            Ok(Distribution::Uniform { low, high })
        }
        ["lognormal", m, s] => {
            let sigma: f64 = s.parse().map_err(|_| invalid(format!("bad sigma {s:?}")))?;
            if !(0.0..=5.0).contains(&sigma) {
                return Err(invalid("sigma must be in [0, 5]"));
            }
            Ok(Distribution::LogNormal {
                median: duration(m)?,
                sigma,
            })
        }
        _ => Err(invalid(format!("bad distribution {text:?}"))),
    }
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Options, OptionsError> {
        let mut o = Options {
            device: 0,
            memory: 0,
            memory_growth: 0,
            managed: false,
            kernels: 10,
            distribution: Distribution::Fixed(1_000_000),
            gap_ns: 0,
            sync: SyncStyle::Stream,
            iterations: None,
            duration_ns: None,
            launch_ahead: 0,
            pipeline: 1,
            per_thread_default_stream: false,
            seed: 1,
            start_barrier: None,
            report_start: false,
            requests_per_s: None,
            graph: false,
            then_kernel: None,
            request_memory: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            match flag.as_str() {
                "--ptds" => {
                    o.per_thread_default_stream = true;
                    continue;
                }
                "--report-start" => {
                    o.report_start = true;
                    continue;
                }
                "--graph" => {
                    o.graph = true;
                    continue;
                }
                "--managed" => {
                    o.managed = true;
                    continue;
                }
                _ => {}
            }
            let value = it
                .next()
                .ok_or_else(|| invalid(format!("{flag} needs a value")))?;
            let int = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| invalid(format!("{flag}: bad number {v:?}")))
            };
            match flag.as_str() {
                "--device" => o.device = int(value)? as i32,
                "--memory" => o.memory = bytes(value)?,
                "--memory-growth" => o.memory_growth = bytes(value)?,
                "--kernels" => o.kernels = int(value)?.max(1) as u32,
                "--kernel" => o.distribution = distribution(value)?,
                "--then-kernel" => {
                    let (after, dist) = value
                        .split_once(':')
                        .ok_or_else(|| invalid("--then-kernel: AFTER:DIST, e.g. 2s:fixed:5ms"))?;
                    o.then_kernel = Some((duration(after)?, distribution(dist)?));
                }
                "--gap" => o.gap_ns = duration(value)?,
                "--sync" => {
                    o.sync = match value.as_str() {
                        "context" => SyncStyle::Context,
                        "stream" => SyncStyle::Stream,
                        "event" => SyncStyle::Event,
                        _ => return Err(invalid("--sync: context, stream or event")),
                    }
                }
                "--iterations" => o.iterations = Some(int(value)?),
                "--duration" => o.duration_ns = Some(duration(value)?),
                "--launch-ahead" => o.launch_ahead = int(value)? as u32,
                "--pipeline" => o.pipeline = int(value)?.max(1) as u32,
                "--seed" => o.seed = int(value)?,
                "--start-barrier" => o.start_barrier = Some(PathBuf::from(value)),
                "--requests-per-s" => {
                    let rate: f64 = value
                        .parse()
                        .map_err(|_| invalid(format!("{flag}: bad rate {value:?}")))?;
                    if !(rate.is_finite() && rate > 0.0) {
                        return Err(invalid("--requests-per-s must be a positive rate"));
                    }
                    o.requests_per_s = Some(rate);
                }
                "--request-memory" => o.request_memory = Some(byte_range(value)?),
                _ => return Err(invalid(format!("unknown option {flag}\n{USAGE}"))),
            }
        }
        if o.graph && o.launch_ahead > 0 {
            return Err(invalid(
                "--graph launches an iteration at once: no --launch-ahead",
            ));
        }
        if o.then_kernel.is_some() && (o.graph || o.requests_per_s.is_some()) {
            return Err(invalid(
                "--then-kernel changes plain kernels: not with --graph or --requests-per-s",
            ));
        }
        if o.graph && o.requests_per_s.is_some() {
            return Err(invalid(
                "--graph applies to the training mode, not --requests-per-s",
            ));
        }
        if o.request_memory.is_some() && o.requests_per_s.is_none() {
            return Err(invalid(
                "--request-memory is per request: it needs --requests-per-s",
            ));
        }
        if o.iterations.is_none() && o.duration_ns.is_none() {
            o.iterations = Some(100);
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Options, OptionsError> {
        Options::parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn kernel_lengths_may_change_mid_run() {
        let o = parse("--kernel fixed:1ms --then-kernel 2s:fixed:5ms").unwrap();
        assert_eq!(
            o.then_kernel,
            Some((2_000_000_000, Distribution::Fixed(5_000_000)))
        );
    }

    #[test]
    fn parses_every_option() {
        let o = parse("--device 1 --memory 2Gi --memory-growth 1Mi --kernels 4 --kernel lognormal:1ms:0.5 \
                       --gap 200us --sync event --duration 2s --launch-ahead 8 --pipeline 2 --ptds --seed 7 --report-start \
                       --managed")
        .unwrap();
        assert!(o.managed);
        assert_eq!(
            (o.device, o.memory, o.memory_growth, o.kernels),
            (1, 2 << 30, 1 << 20, 4)
        );
        assert_eq!(
            o.distribution,
            Distribution::LogNormal {
                median: 1_000_000,
                sigma: 0.5
            }
        );
        assert_eq!(
            (o.gap_ns, o.sync, o.duration_ns),
            (200_000, SyncStyle::Event, Some(2_000_000_000))
        );
        assert_eq!(
            (
                o.launch_ahead,
                o.pipeline,
                o.per_thread_default_stream,
                o.seed
            ),
            (8, 2, true, 7)
        );
        assert!(o.report_start);
        assert_eq!(o.requests_per_s, None);
        assert_eq!(
            parse("--requests-per-s 12.5").unwrap().requests_per_s,
            Some(12.5)
        );
        assert!(!parse("").unwrap().report_start);
        assert!(!parse("").unwrap().graph);
        let graph =
            parse("--graph --kernels 10 --kernel fixed:5ms --sync event --pipeline 2").unwrap();
        assert!(graph.graph);
        assert_eq!(
            (graph.kernels, graph.distribution, graph.pipeline),
            (10, Distribution::Fixed(5_000_000), 2)
        );
        assert_eq!(parse("").unwrap().iterations, Some(100));
        assert_eq!(
            parse("--kernel uniform:1ms:2ms").unwrap().distribution,
            Distribution::Uniform {
                low: 1_000_000,
                high: 2_000_000
            }
        );
    }

    #[test]
    fn request_memory_is_a_size_or_a_range() {
        let o = parse("--requests-per-s 2 --request-memory 2Gi:6Gi").unwrap();
        assert_eq!(o.request_memory, Some((2 << 30, 6 << 30)));
        let o = parse("--requests-per-s 2 --request-memory 512Mi").unwrap();
        assert_eq!(o.request_memory, Some((512 << 20, 512 << 20)));
        assert_eq!(parse("").unwrap().request_memory, None);
    }

    #[test]
    fn rejects_nonsense() {
        for bad in [
            "--kernel fixed:5h",
            "--sync never",
            "--memory 3Q",
            "--bogus 1",
            "--kernels",
            "--kernel uniform:2ms:1ms",
            "--requests-per-s 0",
            "--requests-per-s -3",
            "--requests-per-s fast",
            "--graph --launch-ahead 2",
            "--requests-per-s 10 --graph",
            "--graph 1",
            "--then-kernel 5ms",
            "--then-kernel 1s:fixed:5h",
            "--then-kernel 1s:fixed:5ms --graph",
            "--request-memory 1Gi",
            "--requests-per-s 1 --request-memory 6Gi:2Gi",
            "--requests-per-s 1 --request-memory 2Q",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
