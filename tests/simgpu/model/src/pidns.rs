//! Process identity across PID namespaces.
//!
//! A process inside a container knows only its namespace's pid. NVML on the host must report
//! host pids (the arbiter's watchdog compares them with its clients), so each process records
//! its PID namespace (the inode of `/proc/self/ns/pid`) and its pid there, and the host side
//! finds the matching `/proc/<pid>` whose namespace is the same and whose `NSpid` ends with it.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A PID namespace, named by the device and inode of its `/proc/<pid>/ns/pid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PidNamespace {
    pub dev: u64,
    pub ino: u64,
}

impl PidNamespace {
    pub fn of_self() -> Option<PidNamespace> {
        Self::of_path(Path::new("/proc/self/ns/pid"))
    }

    fn of_path(path: &Path) -> Option<PidNamespace> {
        let meta = std::fs::metadata(path).ok()?;
        Some(PidNamespace {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// The pid, in the caller's namespace, of the process that is `pid` in namespace `ns`.
///
/// Returns `None` when no such process is visible (it exited, or lives in a namespace the
/// caller's `/proc` does not show).
pub fn resolve_pid(ns: PidNamespace, pid: u32) -> Option<u32> {
    if PidNamespace::of_self() == Some(ns) {
        return Some(pid);
    }
    resolve_in_proc(Path::new("/proc"), ns, pid)
}

fn resolve_in_proc(proc_root: &Path, ns: PidNamespace, pid: u32) -> Option<u32> {
    for entry in std::fs::read_dir(proc_root).ok()?.flatten() {
        let Some(candidate) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if PidNamespace::of_path(&entry.path().join("ns/pid")) != Some(ns) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        if innermost_nspid(&status) == Some(pid) {
            return Some(candidate);
        }
    }
    None
}

/// The last field of the `NSpid:` line: the pid in the process's own (innermost) namespace.
pub fn innermost_nspid(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line["NSpid:".len()..]
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nspid_innermost_field() {
        assert_eq!(
            innermost_nspid("Name:\tx\nNSpid:\t4242\t17\t1\nVmRSS: 1\n"),
            Some(1)
        );
        assert_eq!(innermost_nspid("NSpid:\t99\n"), Some(99));
        assert_eq!(innermost_nspid("Name:\tx\n"), None);
    }

    #[test]
    fn own_pid_resolves_to_itself() {
        let ns = PidNamespace::of_self().expect("procfs mounted");
        assert_eq!(
            resolve_pid(ns, std::process::id()),
            Some(std::process::id())
        );
    }

    #[test]
    fn scanning_proc_finds_a_process_by_namespace_and_pid() {
        // Through the scan itself (not the same-namespace shortcut): our own entry must match.
        let ns = PidNamespace::of_self().unwrap();
        assert_eq!(
            resolve_in_proc(Path::new("/proc"), ns, std::process::id()),
            Some(std::process::id())
        );
        let other_ns = PidNamespace {
            dev: ns.dev,
            ino: ns.ino.wrapping_add(12345),
        };
        assert_eq!(
            resolve_in_proc(Path::new("/proc"), other_ns, std::process::id()),
            None
        );
    }
}
