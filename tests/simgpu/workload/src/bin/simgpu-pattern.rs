//! simgpu-pattern: holds device memory with known contents while something else happens to
//! the process (a checkpoint and restore by another process), then reads it back.
//!
//! `simgpu-pattern --ready FILE --go FILE SIZE:BYTE...`: for each `SIZE:BYTE` (SIZE as the
//! workload's `--memory`: bytes, or with `Ki Mi Gi K M G`) allocates SIZE bytes with
//! `cuMemAlloc_v2` and writes the pattern `(BYTE + i) mod 256` at offset `i` with
//! `cuMemcpyHtoD_v2` (the probe's `fill`); creates the ready file; waits
//! (up to a minute) for the go file; reads every allocation back with `cuMemcpyDtoH_v2` and
//! prints a JSON report: per allocation its `ptr`, `bytes`, `first` (BYTE) and `mismatch`
//! (null, or the first wrong byte's `offset`, `found` and `expected`), and `error` (null, or
//! the driver call that failed and its result). It resolves the driver with `dlsym`, as a
//! program linked with `-lcuda` does.

// The pattern the probe's `fill` and `check` steps use.
#[path = "../../../../probe/src/pattern.rs"]
mod pattern;
use pattern::{first_mismatch, pattern};

// The workload's size syntax; the rest of its options are not this program's.
#[allow(dead_code)]
#[path = "../options.rs"]
mod options;

use libc::{c_int, c_uint, c_void};
use std::path::PathBuf;
use std::time::{Duration, Instant};

type R = c_int;

struct Cuda {
    handle: *mut c_void,
}

impl Cuda {
    fn open() -> Result<Cuda, String> {
        // SAFETY: dlopen with a NUL-terminated literal; the handle is never closed.
        let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if handle.is_null() {
            return Err("dlopen(libcuda.so.1) failed".into());
        }
        Ok(Cuda { handle })
    }

    /// The export `name` as `T`, which must be that function's C signature.
    fn f<T: Copy>(&self, name: &std::ffi::CStr) -> Result<T, String> {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        if p.is_null() {
            return Err(format!("no {}", name.to_string_lossy()));
        }
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: a non-null code address; every caller names the export's cuda.h signature.
        Ok(unsafe { std::mem::transmute_copy(&p) })
    }
}

fn parse_size(text: &str) -> Result<usize, String> {
    let n = options::bytes(text).map_err(|e| e.to_string())?;
    usize::try_from(n).map_err(|_| format!("size {text:?}: too large"))
}

struct Options {
    ready: PathBuf,
    go: PathBuf,
    allocations: Vec<(usize, u8)>,
}

fn parse_args() -> Result<Options, String> {
    let (mut ready, mut go, mut allocations) = (None, None, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ready" => ready = args.next().map(PathBuf::from),
            "--go" => go = args.next().map(PathBuf::from),
            spec => {
                let (size, byte) = spec
                    .split_once(':')
                    .ok_or(format!("{spec:?}: expected SIZE:BYTE"))?;
                let byte = byte
                    .parse()
                    .map_err(|_| format!("{spec:?}: BYTE is 0 to 255"))?;
                allocations.push((parse_size(size)?, byte));
            }
        }
    }
    Ok(Options {
        ready: ready.ok_or("--ready FILE is required")?,
        go: go.ok_or("--go FILE is required")?,
        allocations,
    })
}

/// The first byte of `found` (at offset `from` of its allocation) that breaks the pattern.
fn mismatch_report(first: u8, from: usize, found: &[u8]) -> Option<serde_json::Value> {
    first_mismatch(first, from, found).map(|(offset, found, expected)| {
        serde_json::json!({ "offset": offset, "found": found, "expected": expected })
    })
}

/// Bytes written or read per copy, so that large allocations need little host memory.
const CHUNK: usize = 4 << 20;

fn run(o: &Options, report: &mut Vec<serde_json::Value>) -> Result<(), String> {
    let cuda = Cuda::open()?;
    let call = |what: &str, rc: R| {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("{what}: CUresult {rc}"))
        }
    };
    let init: unsafe extern "C" fn(c_uint) -> R = cuda.f(c"cuInit")?;
    let retain: unsafe extern "C" fn(*mut usize, c_int) -> R =
        cuda.f(c"cuDevicePrimaryCtxRetain")?;
    let set_current: unsafe extern "C" fn(usize) -> R = cuda.f(c"cuCtxSetCurrent")?;
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> R = cuda.f(c"cuMemAlloc_v2")?;
    let htod: unsafe extern "C" fn(u64, *const c_void, usize) -> R = cuda.f(c"cuMemcpyHtoD_v2")?;
    let dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> R = cuda.f(c"cuMemcpyDtoH_v2")?;
    let mut ctx = 0;
    // SAFETY: cuInit with its only valid flags; a live out-pointer for the context of device 0.
    unsafe {
        call("cuInit", init(0))?;
        call("cuDevicePrimaryCtxRetain", retain(&mut ctx, 0))?;
        call("cuCtxSetCurrent", set_current(ctx))?;
    }
    let mut held = Vec::new();
    for &(bytes, first) in &o.allocations {
        let mut ptr = 0;
        // SAFETY: a live out-pointer.
        call("cuMemAlloc_v2", unsafe { alloc(&mut ptr, bytes) })?;
        for from in (0..bytes).step_by(CHUNK) {
            let chunk = pattern(first, from, CHUNK.min(bytes - from));
            // SAFETY: `chunk` holds the bytes copied, inside the allocation just made.
            let rc = unsafe { htod(ptr + from as u64, chunk.as_ptr().cast(), chunk.len()) };
            call("cuMemcpyHtoD_v2", rc)?;
        }
        held.push((ptr, bytes, first));
    }
    std::fs::write(&o.ready, b"").map_err(|e| format!("{}: {e}", o.ready.display()))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !o.go.exists() {
        if Instant::now() > deadline {
            return Err(format!("{} never appeared", o.go.display()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for (ptr, bytes, first) in held {
        let mut mismatch = None;
        let mut buf = vec![0u8; CHUNK.min(bytes)];
        for from in (0..bytes).step_by(CHUNK) {
            let chunk = &mut buf[..CHUNK.min(bytes - from)];
            // SAFETY: `chunk` has room for the bytes copied, from inside the allocation.
            let rc = unsafe { dtoh(chunk.as_mut_ptr().cast(), ptr + from as u64, chunk.len()) };
            call("cuMemcpyDtoH_v2", rc)?;
            mismatch = mismatch_report(first, from, chunk);
            if mismatch.is_some() {
                break;
            }
        }
        report.push(serde_json::json!({
            "ptr": ptr,
            "bytes": bytes,
            "first": first,
            "mismatch": mismatch,
        }));
    }
    Ok(())
}

fn main() {
    let o = parse_args().unwrap_or_else(|e| {
        eprintln!("simgpu-pattern: {e}");
        std::process::exit(2)
    });
    let mut allocations = Vec::new();
    let error = run(&o, &mut allocations).err();
    println!(
        "{}",
        serde_json::json!({ "allocations": allocations, "error": error })
    );
    std::process::exit(if error.is_some() { 1 } else { 0 });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_is_reported_with_its_offset_and_bytes() {
        assert_eq!(mismatch_report(1, 0, &[1, 2, 3]), None);
        assert_eq!(
            mismatch_report(1, 10, &[11, 0, 13]),
            Some(serde_json::json!({"offset": 11, "found": 0, "expected": 12}))
        );
    }

    #[test]
    fn sizes_take_the_workload_s_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("3Mi"), Ok(3 << 20));
        assert_eq!(parse_size("2K"), Ok(2000));
        assert!(parse_size("3MB").unwrap_err().contains("3MB"));
        assert!(parse_size("x").is_err());
    }
}
