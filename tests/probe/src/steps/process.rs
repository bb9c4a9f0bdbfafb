//! Steps that pace the probe and coordinate it with the tests and other processes: files,
//! sleeps, timestamps, threads and forks (`chaos`), checkpoints of another process.

use crate::{entry, fatal, num, Launch11, Probe, Ptr, H, R};
use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

pub(crate) fn wait(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let file = args.next().unwrap_or_else(|| fatal("wait FILE"));
    let start = Instant::now();
    while !std::path::Path::new(&file).exists() {
        if start.elapsed() > Duration::from_secs(60) {
            fatal(&format!("{file} never appeared"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    p.report("wait", 0, "");
}

pub(crate) fn touch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let file = args.next().unwrap_or_else(|| fatal("touch FILE"));
    std::fs::write(&file, b"").unwrap_or_else(|e| fatal(&format!("{file}: {e}")));
    p.report("touch", 0, "");
}

pub(crate) fn sleep(args: &mut impl Iterator<Item = String>) {
    std::thread::sleep(Duration::from_millis(num(args)))
}

pub(crate) fn stamp(p: &mut Probe) {
    // Wall-clock microseconds, to order steps of different processes.
    let us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    p.report("stamp", 0, &format!("unix_us={us}"));
}

pub(crate) fn checkpoint(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} (r570+, CUDA 12.8) on
    // process PID: how long each took. Each takes an optional 64-byte argument
    // block, zeroed here except the lock's timeoutMs (its first 32 bits).
    let c = &p.cuda;
    let pid = num(args) as c_int;
    type Operation = unsafe extern "C" fn(c_int, *mut [u64; 8]) -> R;
    let mut seen = Vec::new();
    let mut rc = 0;
    for (name, label) in [
        ("cuCheckpointProcessLock", "lock"),
        ("cuCheckpointProcessCheckpoint", "checkpoint"),
        ("cuCheckpointProcessRestore", "restore"),
        ("cuCheckpointProcessUnlock", "unlock"),
    ] {
        let (found, ptr) = c.lookup(name, 12080, 0);
        if found != 0 || ptr.is_null() {
            rc = if found != 0 { found } else { 500 };
            seen.push(format!("missing={name}"));
            break;
        }
        // SAFETY: the cuda.h signature of every cuCheckpointProcess* operation
        // (int pid, a pointer to its 64-byte argument struct); `ptr` is non-null.
        let operation: Operation = unsafe { entry(ptr, name) };
        let mut block = [0u64; 8];
        if label == "lock" {
            block[0] = 10_000;
        }
        let start = Instant::now();
        // SAFETY: a pid and a live, zeroed 64-byte argument block.
        rc = unsafe { operation(pid, &mut block) };
        seen.push(format!("{label}_us={}", start.elapsed().as_micros()));
        if rc != 0 {
            break;
        }
    }
    p.report("checkpoint", rc, &seen.join(" "));
}

/// Threads that allocate and launch, forks (the children use the library's dlsym
/// and spawn a thread), then the process exits with a long kernel in flight and its
/// threads still running.
pub(crate) fn chaos(p: &mut Probe, ctx: H) {
    let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = p.cuda.get("cuMemAlloc");
    let free: unsafe extern "C" fn(Ptr) -> R = p.cuda.get("cuMemFree");
    let launch: Launch11 = p.cuda.get("cuLaunchKernel");
    let set_current: unsafe extern "C" fn(H) -> R = p.cuda.get("cuCtxSetCurrent");
    let function = p.function;
    let handle = p.cuda.handle as usize;
    for t in 0..4 {
        std::thread::spawn(move || {
            // SAFETY: cuCtxSetCurrent of the primary context main retained (a value the
            // driver checks); the driver's calls are thread-safe.
            unsafe { set_current(ctx) };
            loop {
                let mut ptr = 0;
                // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr to write.
                if unsafe { alloc(&mut ptr, 1 << 20) } == 0 {
                    // SAFETY: cuMemFree_v2 of the buffer just allocated, once.
                    unsafe { free(ptr) };
                }
                let mut ns = 20_000u64 + t;
                let mut params = [&mut ns as *mut u64 as *mut c_void];
                // SAFETY: cuLaunchKernel of the probe's kernel, whose one parameter
                // points at the live local `ns`; `extra` is null.
                unsafe {
                    launch(
                        function,
                        1,
                        1,
                        1,
                        32,
                        1,
                        1,
                        0,
                        0,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                };
            }
        });
    }
    std::thread::sleep(Duration::from_millis(50));
    let mut children = 0;
    for _ in 0..20 {
        // SAFETY: fork itself has no preconditions. The child, a copy of this threaded
        // process, calls dlsym (through the interposer) and spawns a thread, which POSIX
        // does not promise to work after fork (a lock another thread held stays held):
        // that is what this step tests the interposer survives. At worst the child hangs,
        // and the parent gives up after 10 s; it leaves by _exit, running no destructors.
        match unsafe { libc::fork() } {
            0 => {
                // SAFETY: `handle` is libcuda's dlopen handle, never closed (the child
                // has the parent's copy), and the name is NUL-terminated.
                let ok = unsafe {
                    !libc::dlsym(handle as *mut c_void, c"cuMemAlloc_v2".as_ptr()).is_null()
                };
                let joined = std::thread::spawn(|| 7).join().is_ok_and(|v| v == 7);
                // SAFETY: _exit has no preconditions; it ends the child without running
                // the parent's atexit handlers or flushing its copied buffers.
                unsafe { libc::_exit(if ok && joined { 0 } else { 1 }) };
            }
            pid if pid > 0 => {
                let mut status = 0;
                let start = Instant::now();
                loop {
                    // SAFETY: waitpid of this process's own child, given a live c_int.
                    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                    if r == pid {
                        break;
                    }
                    if start.elapsed() > Duration::from_secs(10) {
                        fatal("a fork child hung");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                    children += 1;
                }
            }
            _ => fatal("fork failed"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // A long kernel in flight and the threads busy: exit now.
    let rc = p.kernel(launch, 30_000_000_000);
    p.report("chaos", rc, &format!("children_ok={children}"));
    std::process::exit(0);
}
