//! What the arbiter can learn about a host process: alive or not (and the same
//! process, not a reused pid), its pid namespace and its cgroup. Behind a trait
//! so reconciliation and peer checks are tested with made-up processes.

use procfs_core::process::Stat;
use procfs_core::{FromRead, ProcessCGroups};
use std::fs;

pub trait ProcessProbe: Send + Sync {
    /// The process's start time (clock ticks since boot); None when it does not
    /// exist or is a zombie (it has exited; only its parent has not reaped it).
    fn start_time(&self, pid: u32) -> Option<u64>;
    /// `pid:[4026531836]`: equal strings mean the same pid namespace.
    fn pid_namespace(&self, pid: u32) -> Option<String>;
    /// The cgroup path (v2 unified line, or the first v1 line).
    fn cgroup(&self, pid: u32) -> Option<String>;
}

/// The host's /proc.
pub struct ProcFs;

impl ProcessProbe for ProcFs {
    fn start_time(&self, pid: u32) -> Option<u64> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        parse_stat(&stat)
    }

    fn pid_namespace(&self, pid: u32) -> Option<String> {
        fs::read_link(format!("/proc/{pid}/ns/pid"))
            .ok()
            .map(|p| p.to_string_lossy().into_owned())
    }

    fn cgroup(&self, pid: u32) -> Option<String> {
        let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        parse_cgroup(&text)
    }
}

/// Start time from `/proc/<pid>/stat`, None for zombies and dead processes. procfs-core
/// splits after the last `)`, so a command name with spaces or parentheses is no trouble.
/// procfs-core trims the text, then slices one byte before its first `(` and two after
/// its last `)` unchecked: it panics on `(x) S …`, `1 (x)` or a non-ASCII byte there,
/// which /proc never writes. A panic in the arbiter costs more than checking that
/// shape (`pid (comm) state…`) before handing the text over.
pub fn parse_stat(stat: &str) -> Option<u64> {
    let trimmed = stat.trim().as_bytes();
    let (open, close) = (stat.trim().find('(')?, stat.trim().rfind(')')?);
    let well_formed = open >= 2
        && trimmed[open - 1] == b' '
        && close > open
        && trimmed.get(close + 1) == Some(&b' ')
        && close + 2 < trimmed.len();
    if !well_formed {
        return None;
    }
    let stat = Stat::from_read(stat.as_bytes()).ok()?;
    (stat.state != 'Z' && stat.state != 'X').then_some(stat.starttime)
}

/// The cgroup path from `/proc/<pid>/cgroup`: the unified (v2) line, hierarchy 0 with
/// no controllers, else the first line (v1).
pub fn parse_cgroup(text: &str) -> Option<String> {
    let ProcessCGroups(groups) = ProcessCGroups::from_read(text.as_bytes()).ok()?;
    groups
        .iter()
        .find(|g| g.hierarchy == 0 && g.controllers.is_empty())
        .or_else(|| groups.first())
        .map(|g| g.pathname.trim().to_owned())
}

/// Whether a peer on a lease's socket is plausibly inside that lease's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerCheck {
    Accepted,
    /// Nothing to compare with (lease not confirmed yet, or /proc unreadable): the
    /// socket is mounted into that container only, so accept, but say so.
    Unverified(String),
    Refused(String),
}

/// Compares the peer's pid namespace and cgroup with the container's init
/// process (`container_pid`, recorded at confirmation).
pub fn check_peer(
    probe: &dyn ProcessProbe,
    peer_pid: u32,
    container_pid: Option<u32>,
    container_cgroup: Option<&str>,
) -> PeerCheck {
    let Some(init) = container_pid else {
        return PeerCheck::Unverified("the lease is not confirmed yet".into());
    };
    match (probe.pid_namespace(peer_pid), probe.pid_namespace(init)) {
        (Some(peer), Some(container)) if peer != container => {
            return PeerCheck::Refused(format!(
            "pid {peer_pid} is in pid namespace {peer}, the container's init {init} in {container}"
        ))
        }
        (Some(_), Some(_)) => {}
        _ => {
            return PeerCheck::Unverified(format!(
                "cannot read the pid namespaces of {peer_pid} and {init}"
            ))
        }
    }
    let container_cgroup = container_cgroup
        .map(str::to_owned)
        .or_else(|| probe.cgroup(init));
    match (probe.cgroup(peer_pid), container_cgroup) {
        (Some(peer), Some(container)) if !is_within(&peer, &container) => PeerCheck::Refused(
            format!("pid {peer_pid} is in cgroup {peer}, outside the container's {container}"),
        ),
        (Some(_), Some(_)) => PeerCheck::Accepted,
        _ => PeerCheck::Unverified(format!("cannot read the cgroup of {peer_pid}")),
    }
}

fn is_within(path: &str, root: &str) -> bool {
    let root = root.trim_end_matches('/');
    root.is_empty()
        || path == root
        || path
            .strip_prefix(root)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// Made-up processes: pid → (start time, pid namespace, cgroup).
    #[derive(Default)]
    pub struct FakeProcs(pub Mutex<BTreeMap<u32, (u64, String, String)>>);

    impl FakeProcs {
        pub fn with(self, pid: u32, start: u64, ns: &str, cgroup: &str) -> Self {
            self.0
                .lock()
                .unwrap()
                .insert(pid, (start, ns.into(), cgroup.into()));
            self
        }
        pub fn kill(&self, pid: u32) {
            self.0.lock().unwrap().remove(&pid);
        }
    }

    impl ProcessProbe for FakeProcs {
        fn start_time(&self, pid: u32) -> Option<u64> {
            self.0.lock().unwrap().get(&pid).map(|p| p.0)
        }
        fn pid_namespace(&self, pid: u32) -> Option<String> {
            self.0.lock().unwrap().get(&pid).map(|p| p.1.clone())
        }
        fn cgroup(&self, pid: u32) -> Option<String> {
            self.0.lock().unwrap().get(&pid).map(|p| p.2.clone())
        }
    }

    /// A `/proc/<pid>/stat` line as Linux 5.15 writes it (52 fields), with `comm`,
    /// `state` and `starttime` (field 22) put in.
    fn stat_line(comm: &str, state: &str, starttime: &str) -> String {
        format!(
            "42 ({comm}) {state} 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 {starttime} \
             3133440 416 18446744073709551615 94603064848384 94603064868265 140724422764624 \
             0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 94603064884272 94603064885888 94603224301568 \
             140724422773396 140724422773416 140724422773416 140724422774763 0\n"
        )
    }

    #[test]
    fn stat_parsing_handles_odd_names_and_zombies() {
        for (comm, state, starttime, want) in [
            ("a", "S", "987654", Some(987654)),
            // The name is the process's to choose: spaces and parentheses in it.
            ("a) b) c", "S", "987654", Some(987654)),
            ("x (y) ", "R", "5", Some(5)),
            ("x", "Z", "987654", None),
            ("x", "X", "987654", None),
            ("x", "S", "soon", None),
        ] {
            let line = stat_line(comm, state, starttime);
            assert_eq!(parse_stat(&line), want, "{line}");
        }
        // Shapes /proc never writes, on which procfs-core alone would panic.
        for odd in [
            "garbage",
            "",
            "(x) S 1 2 3",
            "1 (x)",
            "1 (x) ",
            "1 (x) S",
            ") (",
            "1 ) (x",
        ] {
            assert_eq!(parse_stat(odd), None, "{odd:?}");
        }
        // Cut short after starttime: procfs-core wants every field up to cnswap (37).
        let short = "42 (a) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_stat(short), None);
        let me = ProcFs.start_time(std::process::id());
        assert!(me.is_some(), "this test process is alive");
    }

    #[test]
    fn cgroup_parsing() {
        assert_eq!(
            parse_cgroup("0::/system.slice/docker-abc.scope\n").as_deref(),
            Some("/system.slice/docker-abc.scope")
        );
        assert_eq!(
            parse_cgroup("12:pids:/docker/abc\n11:cpu:/docker/abc\n").as_deref(),
            Some("/docker/abc")
        );
        // Hybrid (v1 controllers and the unified hierarchy): the unified line wins.
        assert_eq!(
            parse_cgroup("9:name=systemd:/a\n4:memory:/b\n0::/c\n").as_deref(),
            Some("/c")
        );
        // A path with ':' in it is kept whole.
        assert_eq!(parse_cgroup("0::/a:b\n").as_deref(), Some("/a:b"));
        assert_eq!(parse_cgroup(""), None);
        // A line that is not `hierarchy:controllers:path` spoils the file.
        assert_eq!(parse_cgroup("0::/a\nnonsense\n"), None);
    }

    #[test]
    fn peer_checks() {
        let procs = FakeProcs::default()
            .with(100, 1, "pid:[1]", "/ctr/a")
            .with(101, 1, "pid:[1]", "/ctr/a/sub")
            .with(102, 1, "pid:[2]", "/ctr/a")
            .with(103, 1, "pid:[1]", "/ctr/ab")
            .with(104, 1, "pid:[1]", "/other");
        let check = |peer| check_peer(&procs, peer, Some(100), Some("/ctr/a"));
        assert_eq!(check(100), PeerCheck::Accepted);
        assert_eq!(check(101), PeerCheck::Accepted, "a child cgroup is inside");
        assert!(matches!(check(102), PeerCheck::Refused(r) if r.contains("namespace")));
        assert!(
            matches!(check(103), PeerCheck::Refused(r) if r.contains("cgroup")),
            "prefix is not containment"
        );
        assert!(matches!(check(104), PeerCheck::Refused(_)));
        assert!(matches!(
            check_peer(&procs, 100, None, None),
            PeerCheck::Unverified(_)
        ));
        assert!(matches!(check(999), PeerCheck::Unverified(_)));
    }
}
