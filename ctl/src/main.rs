//! gpusharectl: look at and act on the node's gpushare arbiter.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use gpushare_config::Config;
use gpushare_ctl::cli::{CtlArgs, CtlCommand as Command};
use gpushare_ctl::setup::{self, Engine, Programs};
use gpushare_ctl::terminal::shown_name;
use gpushare_proto::grant::{Grant, GrantAmount};
use gpushare_proto::{ByteSize, ControlClient, Lease, LeaseId, Priority, StatusReport};

fn main() -> ExitCode {
    let args = CtlArgs::parse();
    // Before any configuration is loaded: the file to check may be the broken one.
    if let Command::CheckConfig(check) = &args.command {
        return check.run(args.config.as_deref());
    }
    let result = run(args).and_then(|out| emit(&out));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: it panics when stderr is closed too.
            let _ = writeln!(std::io::stderr(), "gpusharectl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Writes the whole output at once. println! would panic when the reader has
/// gone (`gpusharectl list | head -1`: Rust ignores SIGPIPE, so the write fails
/// with EPIPE instead of killing us).
fn emit(out: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// The reader of our output went away: it took what it wanted (`| head`), so
/// this is a quiet, successful exit, not an error.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Runs the command; returns what to print.
fn run(args: CtlArgs) -> anyhow::Result<String> {
    // Needs no arbiter, and --config names the engine's file, not gpushare's.
    if let Command::Setup {
        engine,
        undo,
        dry_run,
        bin_dir,
        profile,
        set_as_default,
    } = &args.command
    {
        if *set_as_default && !matches!(engine, Engine::Docker | Engine::Containerd) {
            anyhow::bail!(
                "--set-as-default is for docker and containerd; {engine}'s default runtime is \
                 left to its own configuration (podman: engine.runtime in containers.conf; \
                 CRI-O: crio.runtime.default_runtime)"
            );
        }
        let programs = setup_programs(bin_dir.as_deref(), *engine, profile, *undo)?
            .as_default(*set_as_default);
        return setup(*engine, args.config.as_deref(), programs, *undo, *dry_run);
    }
    let loaded = match &args.config {
        Some(path) => Config::load(path),
        None => Config::load_default().map(|(config, _)| config),
    };
    // A refused file must not also hide the node: the arbiter keeps running on the
    // last file it read, and status is what an operator fixing the file wants.
    let (config, socket_from_file) = match loaded {
        Ok(config) => {
            let socket = config.arbiter.control_socket();
            (config, socket)
        }
        Err(error) => {
            let socket = gpushare_config::ArbiterConfig::control_socket_despite(&error);
            let _ = writeln!(
                std::io::stderr(),
                "gpusharectl: warning: {error:#}\ngpusharectl: warning: going on with the defaults and control socket {} (gpusharectl check-config says what to fix)",
                socket.display()
            );
            (Config::default(), socket)
        }
    };
    let socket = args.socket.unwrap_or(socket_from_file);
    let mut client = ControlClient::connect(&socket, config.arbiter.client_timeout())?;
    Ok(match args.command {
        Command::Status { json: true } => {
            serde_json::to_string_pretty(&client.status()?).context("encoding status")? + "\n"
        }
        Command::Status { json: false } => render_status(&client.status()?),
        Command::List { json: true } => {
            serde_json::to_string_pretty(&client.list()?).context("encoding leases")? + "\n"
        }
        Command::List { json: false } => render_list(&client.list()?),
        Command::CheckConfig(_) => unreachable!("answered before any configuration is read"),
        Command::Release { lease } => {
            if client.release(LeaseId(lease.clone()))? {
                format!("released {lease}\n")
            } else {
                format!("no lease {lease}\n")
            }
        }
        Command::Drain { gpu } => format!("drained {}\n", client.drain(gpu, true)?),
        Command::Undrain { gpu } => format!("undrained {}\n", client.drain(gpu, false)?),
        Command::Setup { .. } => unreachable!("setup returns before connecting"),
        Command::Timeline { since, json, svg } => {
            let report = client.timeline(since.map(|s| s.saturating_mul(1000)))?;
            let mut out = if json {
                serde_json::to_string_pretty(&report).context("encoding the timeline")? + "\n"
            } else {
                gpushare_ctl::timeline::render_text(&report)
            };
            if let Some(path) = svg {
                let chart = gpushare_ctl::timeline::render_svg(&report)?;
                std::fs::write(&path, chart)
                    .with_context(|| format!("writing the timeline chart to {}", path.display()))?;
                if !json {
                    out += &format!("chart written to {}\n", path.display());
                }
            }
            out
        }
        Command::Top { once } => {
            // Not a terminal (a pipe, a file, a test): one frame, no control codes.
            if once || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                gpushare_ctl::top::render_frame(&client.status()?)
            } else {
                loop {
                    let frame = gpushare_ctl::top::render_frame(&client.status()?);
                    // Home the cursor and clear the screen, then the frame.
                    emit(&format!("\x1b[H\x1b[2J{frame}"))?;
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
        }
    })
}

/// `gpusharectl setup`: the edit is gpushare_ctl::setup's; this finds the programs
/// and says what happened (with --dry-run, the content it would write).
fn setup(
    engine: Engine,
    file: Option<&std::path::Path>,
    programs: Programs,
    undo: bool,
    dry_run: bool,
) -> anyhow::Result<String> {
    // An engine pointed at a missing program fails every gpushare container start later,
    // far from this command.
    if !undo && !programs.runc.is_file() {
        anyhow::bail!(
            "{} does not exist: name the directory of gpushare-runc with --bin-dir",
            programs.runc.display()
        );
    }
    let path = file.unwrap_or_else(|| engine.default_config());
    let outcome = setup::apply(engine, path, &programs, undo, dry_run)?;
    Ok(match (dry_run, &outcome.content) {
        (true, Some(content)) if outcome.action != setup::Action::Unchanged => {
            format!("{content}(dry run: {outcome})\n")
        }
        (true, _) => format!("(dry run) {outcome}\n"),
        (false, _) => format!("{outcome}\n"),
    })
}

/// The programs `setup` points the engine at, and the docker runtime entries of the
/// runtime profiles named with --profile, each of which gpushare's configuration
/// must define (an entry naming an undefined profile would fail every container
/// started through it).
fn setup_programs(
    bin_dir: Option<&std::path::Path>,
    engine: Engine,
    profiles: &[String],
    undo: bool,
) -> anyhow::Result<Programs> {
    if !profiles.is_empty() && engine != Engine::Docker {
        anyhow::bail!(
            "--profile is for docker, whose runtime entries are the only way its users can \
             be granted more than their environment may ask; {engine}'s users set \
             gpushare.io/* annotations, which the container's creator sets and its image cannot"
        );
    }
    if !profiles.is_empty() && !undo {
        let (config, path) = Config::load_default()?;
        let file = path.map_or_else(
            || format!("{} (absent)", gpushare_config::DEFAULT_PATH),
            |p| p.display().to_string(),
        );
        for profile in profiles {
            if !config.runtime.profiles.contains_key(profile) {
                let defined: Vec<&str> =
                    config.runtime.profiles.keys().map(String::as_str).collect();
                anyhow::bail!(
                    "--profile {profile:?}: gpushare's configuration {file} defines no \
                     [runtime.profiles.{profile}] (defined: {}); define it there first",
                    if defined.is_empty() {
                        "none".to_owned()
                    } else {
                        defined.join(", ")
                    }
                );
            }
        }
    }
    let bin_dir = match bin_dir {
        Some(dir) => dir.to_owned(),
        None => std::env::current_exe()
            .context("finding gpusharectl's own directory (name one with --bin-dir)")?
            .parent()
            .context("gpusharectl's path has no directory (name one with --bin-dir)")?
            .to_owned(),
    };
    Ok(Programs::in_dir(&bin_dir).with_docker_profiles(profiles.to_vec()))
}

/// One line a lease; an empty table says so, since a blank answer reads as a
/// hung or broken command.
fn render_list(leases: &[Lease]) -> String {
    if leases.is_empty() {
        return "no leases\n".into();
    }
    let mut out = String::new();
    for l in leases {
        let _ = writeln!(
            out,
            "{} container={} gpus={} priority={} memory={} state={:?}{}",
            l.id,
            shown_name(&l.display_name()),
            l.gpus.join(","),
            l.priority,
            ByteSize(l.memory_bytes),
            l.state,
            pod_of(l)
        );
    }
    out
}

/// " pod=namespace/name/container grants=…" for a Kubernetes container's lease;
/// "-" stands for what the runtime did not know.
fn pod_of(lease: &Lease) -> String {
    let Some(pod) = &lease.pod else {
        return String::new();
    };
    let part = |p: &Option<String>| p.as_deref().map_or_else(|| "-".into(), shown_name);
    let mut out = format!(
        " pod={}/{}/{}",
        part(&pod.namespace),
        part(&pod.name),
        part(&pod.container)
    );
    if !pod.grants.is_empty() {
        let ids: Vec<&str> = pod.grants.iter().map(|g| g.0.as_str()).collect();
        out += &format!(" grants={}", ids.join(","));
    }
    out
}

/// ", GPU time 12.3 s, 10 s share 61 %, 1 min 48 %" for a lease that had token
/// clients; nothing for one that never had (or an older arbiter's report).
fn gpu_time_of(usage: &gpushare_proto::LeaseUsage) -> String {
    let (Some(short), Some(long)) = (usage.token_share_10s, usage.token_share_1m) else {
        return String::new();
    };
    format!(
        ", GPU time {}, 10 s share {:.0} %, 1 min {:.0} %",
        gpushare_ctl::top::gpu_time(usage.token_time_ms),
        short * 100.0,
        long * 100.0
    )
}

fn render_grant(g: &Grant) -> String {
    let amount = match g.amount {
        GrantAmount::Memory { bytes } => format!("memory {}", ByteSize(bytes)),
        GrantAmount::High => "high".into(),
        GrantAmount::Compute { percent } => format!("compute {percent}%"),
    };
    let gpu = match (&g.gpu, g.amount) {
        (Some(gpu), _) => gpu.clone(),
        (None, GrantAmount::Memory { .. }) => "waiting".into(),
        (None, _) => "-".into(),
    };
    format!(
        "  {} {amount} gpu={gpu} lease={} devices={}\n",
        g.id,
        g.lease.as_ref().map(|l| l.0.as_str()).unwrap_or("-"),
        g.device_ids.join(",")
    )
}

/// What leases are placed within, with NVML's total beside it where the driver reserves
/// part of it ("79.1 GiB allocatable of 79.6 GiB").
fn capacity(g: &gpushare_proto::GpuStatus) -> String {
    match g.memory_allocatable {
        0 => ByteSize(g.memory_total).to_string(),
        a if a == g.memory_total => ByteSize(a).to_string(),
        a => format!(
            "{} allocatable of {}",
            ByteSize(a),
            ByteSize(g.memory_total)
        ),
    }
}

fn percent(x: Option<f64>) -> String {
    x.map(|u| format!("{:.0}%", u * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// Memory reclaim: the leases checkpointed off their GPU, the bound, the last reclaims.
fn render_reclaim(r: &gpushare_proto::ReclaimStatus) -> String {
    let mut out = format!(
        "MEMORY RECLAIM on: low-priority quotas up to {:.2}x what guaranteed leases leave; bound max({} ms, 1.5 x bytes / {} GB/s)\n",
        r.low_overcommit, r.floor_ms, r.checkpoint_gbps
    );
    out += &format!(
        "  reclaims {} ({} failed), freed {}, restores {}\n",
        r.reclaims,
        r.reclaims_failed,
        ByteSize(r.reclaimed_bytes),
        r.restores
    );
    for s in &r.suspended {
        out += &format!(
            "  {} {} on {}: {} off the GPU until it fits back (oldest first)\n",
            s.phase,
            if s.name.is_empty() { &s.lease } else { &s.name },
            s.gpu,
            ByteSize(s.bytes),
        );
    }
    for (lease, why) in &r.never_again {
        out += &format!("  never reclaimed: {lease}: {why}\n");
    }
    if let Some(last) = r.recent.last() {
        out += &format!(
            "  last: {} needed {} more on {}: {} from {} lease(s) in {:.0} ms (lock {:.0} ms, checkpoint {:.0} ms; bound {:.0} ms){}\n",
            last.lease,
            ByteSize(last.shortfall),
            last.gpu,
            ByteSize(last.bytes),
            last.victims.len(),
            last.total_ms,
            last.lock_ms,
            last.checkpoint_ms,
            last.bound_ms,
            if last.succeeded { "" } else { ", refused" }
        );
    }
    out
}

fn render_status(report: &StatusReport) -> String {
    let mut out = format!(
        "INVENTORY {}  driver CUDA {}\n",
        if report.inventory_source.is_empty() {
            "?"
        } else {
            &report.inventory_source
        },
        report
            .driver_cuda_version
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_else(|| "-".into())
    );
    if let Some(why) = &report.store_failure {
        out += &format!(
            "STORE FAILING: {why}\n  new reserves and releases are refused until the lease store can be written again (free space in arbiter.state_dir); it retries every second\n"
        );
    }
    out += "GPUS\n";
    for g in &report.gpus {
        let mut flags = String::new();
        if g.drained {
            flags += " drained";
        }
        if let Some(t) = &g.reserved_for {
            flags += &format!(" reserved-for={t}");
        }
        // Rebalancing hints (balanced placement): absent from an older arbiter's report.
        let hint = report
            .placement
            .iter()
            .find(|h| h.uuid == g.uuid)
            .map(|h| {
                format!(
                    "  demand {:.2} GPU  largest hole {}",
                    h.expected_demand,
                    ByteSize(h.largest_free_hole)
                )
            })
            .unwrap_or_default();
        out += &format!(
            "  {} {} {}  leased {} of {}  used {}  util(10s) {} util(1m) {}{}{}\n",
            g.index,
            g.uuid,
            g.name,
            ByteSize(g.memory_leased),
            capacity(g),
            g.memory_used
                .map(|b| ByteSize(b).to_string())
                .unwrap_or_else(|| "-".into()),
            percent(
                report
                    .gpu_utilization
                    .iter()
                    .find(|u| u.uuid == g.uuid)
                    .and_then(|u| u.last_10s)
            ),
            percent(g.utilization_last_minute),
            hint,
            flags
        );
    }
    if report.placement_waits_fragmented > 0 {
        out += &format!(
            "  {} reserve(s) waited although the GPUs' free memory added up would have held them (fragmented: moving a lease would open a hole)\n",
            report.placement_waits_fragmented
        );
    }
    for (what, h) in [
        ("decisions", &report.placement_times.decisions),
        ("batch searches", &report.placement_times.batch_searches),
    ] {
        if let (Some(mean), Some(p99)) = (h.mean(), h.quantile_bound(0.99)) {
            out += &format!(
                "  placement: {} {what}, mean {mean:.1?}, p99 ≤ {p99:.1?}, max {:.1?}\n",
                h.count,
                std::time::Duration::from_nanos(h.max_ns)
            );
        }
    }
    if !report.unshareable.is_empty() {
        out += &format!(
            "UNSHAREABLE ({}): no leases are placed on these GPUs\n",
            report.unshareable.len()
        );
        for u in &report.unshareable {
            out += &format!(
                "  {} {} {} {}  {}\n",
                u.index,
                u.uuid,
                u.name,
                ByteSize(u.memory_total),
                u.reason
            );
        }
    }
    for priority in [Priority::High, Priority::Low] {
        let leases: Vec<_> = report
            .leases
            .iter()
            .filter(|l| l.priority == priority)
            .collect();
        out += &format!("LEASES {priority} ({})\n", leases.len());
        for l in leases {
            let usage = report.usage.iter().find(|u| u.lease == l.id);
            out += &format!(
                "  {} container={} gpus={} memory used {} of {} state={:?} pid={} clients={}{}{}\n",
                l.id,
                gpushare_ctl::top::container_of(l, usage),
                l.gpus.join(","),
                ByteSize(usage.map(|u| u.memory_used).unwrap_or(0)),
                ByteSize(usage.map(|u| u.memory_quota).unwrap_or(l.memory_bytes)),
                l.state,
                l.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                usage
                    .map(|u| u
                        .clients
                        .iter()
                        .map(|c| c.pid.to_string())
                        .collect::<Vec<_>>()
                        .join(","))
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "-".into()),
                pod_of(l),
                usage.map(gpu_time_of).unwrap_or_default(),
            );
        }
    }
    if !report.grants.is_empty() {
        out += &format!("GRANTS ({})\n", report.grants.len());
        for g in &report.grants {
            out += &render_grant(g);
        }
    }
    out += &format!("QUEUE ({})\n", report.queue.len());
    for q in &report.queue {
        out += &format!(
            "  {}. container={} priority={} memory={} gpu={} waited {}s\n",
            q.position,
            shown_name(&q.container_id),
            q.priority,
            q.memory
                .map(|m| m.to_string())
                .unwrap_or_else(|| "default".into()),
            q.gpu,
            q.waited_ms / 1000
        );
    }
    if let Some(r) = &report.reclaim {
        out += &render_reclaim(r);
    }
    out += &format!("VIOLATIONS ({})\n", report.violations.len());
    for v in &report.violations {
        out += &format!(
            "  {:?} gpu={} pid={} lease={} memory={}{}{}\n",
            v.kind,
            v.gpu,
            v.pid,
            v.lease.as_ref().map(|l| l.0.as_str()).unwrap_or("-"),
            ByteSize(v.memory_used),
            v.memory_quota
                .map(|q| format!(" quota={}", ByteSize(q)))
                .unwrap_or_default(),
            if v.killed { " killed" } else { "" }
        );
    }
    if !report.tokens.is_empty() {
        out += &format!("TOKENS ({})\n", report.tokens.len());
    }
    for t in &report.tokens {
        let holders: Vec<String> = t
            .holders
            .iter()
            .map(|h| {
                let pid = h.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                format!("{}/{pid}({})", h.lease, h.priority)
            })
            .collect();
        out +=
            &format!(
            "  {} policy={} holder={} clients={} waiting={} grants={} revocations={} overdue={}\n",
            t.gpu,
            t.policy,
            if holders.is_empty() { "-".into() } else { holders.join(",") },
            t.clients,
            t.waiting,
            t.grants,
            t.revocations,
            t.overdue
        );
        if !t.overdue_clients.is_empty() {
            // Revoked and still draining past scheduler.revoke_grace_ms: a long kernel
            // or graph, or a stuck agent. Not waited for; scheduled again once released.
            let overdue: Vec<String> = t
                .overdue_clients
                .iter()
                .map(|h| {
                    let pid = h.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                    format!("{}/{pid}", h.lease)
                })
                .collect();
            out += &format!("    overdue: {}\n", overdue.join(","));
        }
        let a = &t.admission;
        if a.windows > 0 || a.launches.fitted > 0 || !a.waiting_for_window.is_empty() {
            // Duration-aware admission: low work admitted only when it fits before the
            // high-priority job is expected back; mis-predictions counted both ways.
            out += &format!(
                "    admission: windows={} early_returns={} fitted={} held_back={} overran={} ({} µs)\n",
                a.windows,
                a.early_returns,
                a.launches.fitted,
                a.launches.held_back,
                a.launches.overran,
                a.launches.overran_ns / 1_000
            );
            for w in &a.waiting_for_window {
                let pid = w.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                out += &format!(
                    "    waiting for a window: {}/{pid} needs {} µs\n",
                    w.lease, w.need_us
                );
            }
        }
        if a.measured_overruns > 0 {
            // Measured by the arbiter, whatever the interposers reported above.
            out += &format!(
                "    overruns: {} ({} ms past the grace); penalised now: {}\n",
                a.measured_overruns,
                a.measured_overrun_ms,
                if a.penalized_leases.is_empty() {
                    "-".to_string()
                } else {
                    a.penalized_leases
                        .iter()
                        .map(|l| l.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{AdmissionStatus, FitCounts, LeaseId, TokenStatus, WindowWaiter};

    #[test]
    fn capacity_shows_the_allocatable_memory_beside_nvml_s_total_when_they_differ() {
        const MI: u64 = 1 << 20;
        let gpu = |total, allocatable| gpushare_proto::GpuStatus {
            memory_total: total,
            memory_allocatable: allocatable,
            ..Default::default()
        };
        for (g, want) in [
            (
                gpu(81559 * MI, 81008 * MI),
                "81008Mi allocatable of 81559Mi",
            ),
            (gpu(16 << 30, 16 << 30), "16Gi"),
            (gpu(16 << 30, 0), "16Gi"),
        ] {
            assert_eq!(capacity(&g), want);
        }
    }

    #[test]
    fn status_shows_admission_windows_and_who_waits_for_one() {
        let token = |admission| TokenStatus {
            gpu: "GPU-0".into(),
            policy: "priority".into(),
            admission,
            ..Default::default()
        };
        let report = |admission| StatusReport {
            tokens: vec![token(admission)],
            ..Default::default()
        };
        let quiet = render_status(&report(AdmissionStatus::default()));
        assert!(!quiet.contains("admission:"), "{quiet}");
        let busy = render_status(&report(AdmissionStatus {
            windows: 12,
            early_returns: 1,
            launches: FitCounts {
                fitted: 40,
                held_back: 3,
                overran: 2,
                overran_ns: 1_500_000,
                ..Default::default()
            },
            waiting_for_window: vec![WindowWaiter {
                lease: LeaseId("l1".into()),
                pid: Some(7),
                need_us: 5_000,
            }],
            ..Default::default()
        }));
        assert!(!busy.contains("STORE FAILING"), "{busy}");
        for line in [
            "admission: windows=12 early_returns=1 fitted=40 held_back=3 overran=2 (1500 µs)",
            "waiting for a window: l1/7 needs 5000 µs",
        ] {
            assert!(busy.contains(line), "{line} in\n{busy}");
        }
    }

    #[test]
    fn status_shows_grants_and_the_pod_of_each_lease() {
        use gpushare_proto::grant::{GrantId, PodBinding};
        use gpushare_proto::{Fraction, LeaseState};
        let grant = |id: &str, amount, gpu: Option<&str>, lease: Option<&str>| Grant {
            id: GrantId(id.into()),
            amount,
            device_ids: vec![format!("d-{id}")],
            gpu: gpu.map(str::to_owned),
            lease: lease.map(|l| LeaseId(l.into())),
            created_unix_ms: 0,
        };
        let report = StatusReport {
            leases: vec![Lease {
                id: LeaseId("l1".into()),
                container_id: "abc".into(),
                namespace: Some("k8s.io".into()),
                sandbox_id: None,
                gpus: vec!["GPU-0".into()],
                priority: Priority::Low,
                memory_bytes: 4 << 30,
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                tenant: None,
                state: LeaseState::Confirmed,
                pid: Some(7),
                created_unix_ms: 0,
                pod: Some(PodBinding {
                    namespace: Some("team-a".into()),
                    name: Some("trainer".into()),
                    container: Some("main".into()),
                    grants: vec![GrantId("g-1".into())],
                }),
            }],
            grants: vec![
                grant(
                    "g-1",
                    GrantAmount::Memory { bytes: 4 << 30 },
                    Some("GPU-0"),
                    Some("l1"),
                ),
                grant("g-2", GrantAmount::Memory { bytes: 2 << 30 }, None, None),
                grant("g-3", GrantAmount::Compute { percent: 30 }, None, None),
            ],
            ..Default::default()
        };
        let text = render_status(&report);
        for line in [
            "clients=- pod=team-a/trainer/main grants=g-1\n",
            "GRANTS (3)\n",
            "  g-1 memory 4Gi gpu=GPU-0 lease=l1 devices=d-g-1\n",
            "  g-2 memory 2Gi gpu=waiting lease=- devices=d-g-2\n",
            "  g-3 compute 30% gpu=- lease=- devices=d-g-3\n",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
        assert!(!render_status(&StatusReport::default()).contains("GRANTS"));
    }

    #[test]
    fn status_shows_each_gpus_expected_demand_largest_hole_and_fragmented_waits() {
        let gpu = |i: u32| gpushare_proto::GpuStatus {
            index: i,
            uuid: format!("GPU-{i}"),
            memory_total: 16 << 30,
            ..Default::default()
        };
        let report = StatusReport {
            gpus: vec![gpu(0), gpu(1)],
            placement: vec![gpushare_proto::message::GpuPlacementHint {
                uuid: "GPU-1".into(),
                expected_demand: 1.25,
                largest_free_hole: 3 << 30,
            }],
            placement_waits_fragmented: 2,
            ..Default::default()
        };
        let text = render_status(&report);
        let line = |uuid: &str| text.lines().find(|l| l.contains(uuid)).unwrap().to_owned();
        assert!(
            line("GPU-1").contains("demand 1.25 GPU  largest hole 3Gi"),
            "{text}"
        );
        assert!(
            !line("GPU-0").contains("demand"),
            "no hint, none shown: {text}"
        );
        assert!(text.contains("2 reserve(s) waited"), "{text}");
        assert!(!render_status(&StatusReport::default()).contains("fragmented"));
        assert!(!render_status(&StatusReport::default()).contains("placement:"));
        let mut timed = StatusReport::default();
        timed
            .placement_times
            .decisions
            .record(std::time::Duration::from_micros(4));
        timed
            .placement_times
            .decisions
            .record(std::time::Duration::from_micros(8));
        let text = render_status(&timed);
        assert!(
            text.contains("placement: 2 decisions, mean 6.0µs, p99 ≤ 8.0µs, max 8.0µs"),
            "{text}"
        );
        assert!(!text.contains("batch searches"), "{text}");
    }

    #[test]
    fn status_shows_suspended_leases_and_the_last_reclaim_beside_its_bound_only_when_on() {
        assert!(!render_status(&StatusReport::default()).contains("MEMORY RECLAIM"));
        let report = StatusReport {
            reclaim: Some(Box::new(gpushare_proto::ReclaimStatus {
                low_overcommit: 1.5,
                floor_ms: 250,
                checkpoint_gbps: 25.0,
                suspended: vec![gpushare_proto::SuspendedLease {
                    lease: "l1".into(),
                    name: "trainer".into(),
                    gpu: "GPU-0".into(),
                    bytes: 3 << 30,
                    phase: "suspended".into(),
                    since_unix_ms: 1,
                }],
                recent: vec![gpushare_proto::ReclaimReport {
                    lease: "h1".into(),
                    gpu: "GPU-0".into(),
                    shortfall: 2 << 30,
                    bytes: 3 << 30,
                    victims: vec!["l1".into()],
                    succeeded: true,
                    lock_ms: 4.0,
                    checkpoint_ms: 120.0,
                    total_ms: 130.0,
                    bound_ms: 250.0,
                    at_unix_ms: 2,
                }],
                reclaims: 1,
                reclaimed_bytes: 3 << 30,
                ..Default::default()
            })),
            ..Default::default()
        };
        let text = render_status(&report);
        assert!(text.contains("MEMORY RECLAIM on"), "{text}");
        assert!(text.contains("suspended trainer on GPU-0: 3Gi"), "{text}");
        assert!(
            text.contains("in 130 ms (lock 4 ms, checkpoint 120 ms; bound 250 ms)"),
            "{text}"
        );
    }

    #[test]
    fn list_says_when_there_are_no_leases_and_else_one_line_a_lease() {
        use gpushare_proto::{Fraction, LeaseState};
        assert_eq!(render_list(&[]), "no leases\n");
        let lease = |id: &str| Lease {
            id: LeaseId(id.into()),
            container_id: format!("c-{id}"),
            namespace: None,
            sandbox_id: None,
            gpus: vec!["GPU-0".into()],
            priority: Priority::High,
            memory_bytes: 1 << 30,
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            tenant: None,
            state: LeaseState::Confirmed,
            pid: None,
            created_unix_ms: 0,
            pod: None,
        };
        let text = render_list(&[lease("l1"), lease("l2")]);
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(
            text.starts_with(
                "l1 container=c-l1 gpus=GPU-0 priority=high memory=1Gi state=Confirmed\n"
            ),
            "{text}"
        );
        assert!(!text.contains("no leases"), "{text}");
        // Pod names come from annotations the pod's creator wrote.
        let mut hostile = lease("l3");
        hostile.pod = Some(gpushare_proto::grant::PodBinding {
            namespace: Some("ns\x1b[2J".into()),
            name: Some("evil\x1b]0;owned\x07\r\nl9 container=fake".into()),
            container: Some("main\u{9b}31m".into()),
            grants: vec![],
        });
        let text = render_list(&[hostile]);
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
    }

    #[test]
    fn status_says_when_the_lease_store_cannot_be_written() {
        let report = StatusReport {
            store_failure: Some("writing leases.log: No space left on device".into()),
            ..Default::default()
        };
        let text = render_status(&report);
        assert!(
            text.contains("STORE FAILING: writing leases.log: No space left on device"),
            "{text}"
        );
        assert!(text.contains("arbiter.state_dir"), "{text}");
    }
}
