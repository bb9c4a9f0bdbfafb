//! The guard of a create: a forked process that outlives a wrapper killed mid-create.
//!
//! The wrapper holds the write end of a pipe (close-on-exec, so the runtime and the
//! container never hold it) and tells the guard, one line each, the runtime's pid once
//! it runs and that it finished. A SIGKILL runs no code, but the kernel closes the
//! pipe: the guard reads end of file without "finished" and knows the wrapper died,
//! and whether the runtime had started. The guard leaves the wrapper's process group
//! and session and holds none of its descriptors, so neither a group kill nor an
//! engine waiting for the runtime's output pipes waits for it.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const RUNTIME: &str = "runtime ";
const FINISHED: &str = "finished";

/// What the wrapper's lines say of its end. Pure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrapperFate {
    /// It finished (and undid a failed create itself).
    Finished,
    /// It died before the runtime ran: nothing can have been created.
    KilledBeforeRuntime,
    /// It died while the runtime (this pid) was creating the container.
    KilledWhileRuntimeRan(u32),
}

pub fn wrapper_fate(said: &[u8]) -> WrapperFate {
    let text = String::from_utf8_lossy(said);
    // Only whole lines count: a line cut short by the kill is not a message.
    let lines: Vec<&str> = match text.rsplit_once('\n') {
        Some((whole, _)) => whole.lines().collect(),
        None => Vec::new(),
    };
    if lines.contains(&FINISHED) {
        return WrapperFate::Finished;
    }
    lines
        .iter()
        .find_map(|l| l.strip_prefix(RUNTIME)?.parse().ok())
        .map_or(
            WrapperFate::KilledBeforeRuntime,
            WrapperFate::KilledWhileRuntimeRan,
        )
}

/// The wrapper's end of the pipe.
pub struct Watch {
    /// None where the guard could not be started: the create runs unguarded, as
    /// before, rather than failing.
    pipe: Option<File>,
}

impl Watch {
    fn say(&mut self, line: &str) {
        if let Some(pipe) = &mut self.pipe {
            let _ = pipe.write_all(format!("{line}\n").as_bytes());
        }
    }

    pub fn runtime_started(&mut self, pid: u32) {
        self.say(&format!("{RUNTIME}{pid}"));
    }

    pub fn finished(&mut self) {
        self.say(FINISHED);
        self.pipe = None;
    }
}

pub enum Started {
    Wrapper(Watch),
    /// In the guard: what the wrapper said before its end of the pipe closed.
    Guard(Vec<u8>),
}

/// Forks the guard. Returns in both processes: the wrapper gets its [`Watch`], the
/// guard (once the wrapper is gone) what the wrapper said.
pub fn start() -> Started {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into a live array of two.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Started::Wrapper(Watch { pipe: None });
    }
    // SAFETY: the descriptors were just created and are owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: gpushare-runc is single-threaded (no runtime, no thread is spawned), so
    // the child may go on running ordinary code after the fork.
    match unsafe { libc::fork() } {
        -1 => Started::Wrapper(Watch { pipe: None }),
        0 => {
            drop(write);
            detach(read.as_raw_fd());
            let mut said = Vec::new();
            let _ = File::from(read).read_to_end(&mut said);
            Started::Guard(said)
        }
        _ => {
            drop(read);
            Started::Wrapper(Watch {
                pipe: Some(File::from(write)),
            })
        }
    }
}

/// Leaves the wrapper's session and process group, points stdio at /dev/null and
/// closes every other inherited descriptor but `keep`.
fn detach(keep: i32) {
    // SAFETY: setsid takes no pointers; failing (already a leader) changes nothing.
    unsafe { libc::setsid() };
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..=2 {
            // SAFETY: dup2 onto a standard descriptor of this process.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
    let inherited: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter(|&fd| fd > 2 && fd != keep)
                .collect()
        })
        .unwrap_or_default();
    for fd in inherited {
        // SAFETY: closes a descriptor this process inherited and does not use; the
        // directory listing it came from is closed already.
        unsafe { libc::close(fd) };
    }
}

/// Waits until process `pid` (the runtime, orphaned by the wrapper's death) is gone.
pub fn wait_for_exit(pid: u32) {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd >= 0 {
        // SAFETY: the descriptor was just returned to this process.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        let mut poll = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: polls one live pollfd; readable once the process has exited.
            if unsafe { libc::poll(&mut poll, 1, -1) } >= 0 {
                return;
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                break;
            }
        }
    }
    // No pidfd (a kernel before 5.3), already gone, or poll failed: ask until it is.
    // SAFETY: signal 0 only checks that the process exists.
    while unsafe { libc::kill(pid as libc::pid_t, 0) } == 0 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Ends the guard without running the wrapper's exit path (its stdout flush).
pub fn exit() -> ! {
    // SAFETY: _exit ends this process at once; nothing is left to run.
    unsafe { libc::_exit(0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wrappers_lines_tell_how_it_ended() {
        use WrapperFate::*;
        for (said, want) in [
            ("", KilledBeforeRuntime),
            ("runtime 42\n", KilledWhileRuntimeRan(42)),
            ("runtime 42\nfinished\n", Finished),
            ("finished\n", Finished),
            // Cut short by the kill: not a whole line.
            ("runtime 4", KilledBeforeRuntime),
            ("runtime 42\nfinis", KilledWhileRuntimeRan(42)),
            ("runtime x\n", KilledBeforeRuntime),
            ("runtime 99999999999\n", KilledBeforeRuntime),
        ] {
            assert_eq!(wrapper_fate(said.as_bytes()), want, "{said:?}");
        }
    }
}
