//! What the arbiter can learn about a host process: alive or not (and the same
//! process, not a reused pid), its pid namespace and its cgroup. Behind a trait
//! so reconciliation and peer checks are tested with made-up processes.

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

/// Start time from `/proc/<pid>/stat`, None for zombies and dead processes.
/// The command name (field 2) may hold spaces and parentheses: split after the last `)`.
pub fn parse_stat(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); starttime is field 22.
    let state = *fields.first()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.get(22 - 3)?.parse().ok()
}

pub fn parse_cgroup(text: &str) -> Option<String> {
    let unified = text.lines().find_map(|l| l.strip_prefix("0::"));
    unified
        .or_else(|| text.lines().next().and_then(|l| l.splitn(3, ':').nth(2)))
        .map(|p| p.trim().to_owned())
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

    #[test]
    fn stat_parsing_handles_odd_names_and_zombies() {
        let alive = "42 (a) b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_stat(alive), Some(987654));
        let zombie = "42 (x) Z 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 0 0";
        assert_eq!(parse_stat(zombie), None);
        assert_eq!(parse_stat("garbage"), None);
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
