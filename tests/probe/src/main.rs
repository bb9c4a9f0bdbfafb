//! gpushare-cuda-probe: a small CUDA driver program for the interposer's tests and
//! benchmark. It resolves the driver the way the CUDA runtime does — `dlopen`
//! ("libcuda.so.1"), `dlsym(handle, "cuGetProcAddress_v2")`, then every entry point
//! through it for one CUDA version and flags — and runs the steps named on its
//! command line, printing one line per step: `<step> <CUDA result> [key=value ...]`.
//!
//! Options: `--cuda-version N` (default 12040), `--ptds` (per-thread default stream),
//! `--cudart-like` (the primary context through the driver's private `CUDART_INTERFACE`
//! table, as the CUDA runtime gets it, instead of `cuDevicePrimaryCtxRetain`),
//! `--driver-library PATH` (`dlopen` PATH instead of `libcuda.so.1`: a library that
//! fronts the driver, as a tracer does, answers `cuGetProcAddress_v2`).
//! Steps: `alloc B`, `linked-alloc B`, `pitch W H`, `managed B`, `array W H`, `array3d W H D`,
//! `mipmap W H LEVELS`, `async B`, `pool-async B`, `vmm B`, `vmm-host B`, `vmm-export B` (exported as a POSIX descriptor, kept), `free-all`,
//! `sync`, `trim`, `meminfo`, `totalmem`, `launch N`, `launch-ex`, `coop`, `graph`,
//! `legacy-launch`, `ptsz-check`, `procaddr NAME VERSION FLAGS`, `resolver-alloc FLAGS B`, `dlsym NAME`, `next NAME`, `nvml-meminfo`,
//! `wait FILE`, `touch FILE`, `sleep MS`, `chaos`, `bench-launch N`, `bench-totalmem N`, `bench-linked-totalmem N`,
//! `ctx-create`, `kernel-ms N`, `capture-begin global|thread-local|relaxed`, `capture-launch N`, `capture-end`,
//! `capture-join N`, `capture-join-at N TOUCH WAIT`, `cig-capture-begin`, `cig-capture-end`, `green-launch-ahead MS`, `green-kernel-ms MS`,
//! `two-streams MS`, `stream-create`, `stamp`, `copies sync|async|memset|memset-async|attributes|attributes-3d N B`, `reset`, `dlsym-launch N`,
//! `raw-launch N MS` (N kernels of MS ms through the driver's own cuLaunchKernel, past the interposer),
//! `max-alloc` (the largest single allocation granted, by binary search), `timeslice-trace MS`
//! (when a kernel of MS ms was running, from the GPU's clock), `checkpoint PID`
//! (cuCheckpointProcess* latencies on another process), `fill BYTE` (the pattern
//! `(BYTE + i) mod 256` over the whole most recent `alloc`/`managed` allocation, with
//! cuMemcpyHtoD), `check BYTE` (reads it back with cuMemcpyDtoH: CUDA_SUCCESS when it holds
//! that pattern, else CUDA_ERROR_UNKNOWN with `mismatch_at=OFFSET found=B expected=B`).
//!
//! Its kernel is `gpushare_spin_ns` from tests/simgpu/ptx/spin.ptx (PTX, spinning on
//! `%globaltimer`), so it runs unchanged on the simulated driver and on a real GPU.
#![allow(clippy::missing_transmute_annotations)]

mod pattern;
mod steps;

use steps::{
    captures, contents, contexts, copies, info, launches, memory, process, streams, symbols,
};

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

type R = c_int;
type H = usize;
type Ptr = u64;
type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;
type Launch11 = unsafe extern "C" fn(
    H,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    H,
    *mut *mut c_void,
    *mut *mut c_void,
) -> R;
type Coop = unsafe extern "C" fn(
    H,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    H,
    *mut *mut c_void,
) -> R;

const PTDS: u64 = 2;

/// The portable test kernel (`gpushare_spin_ns(u64 ns)` spins on `%globaltimer`):
/// PTX text, NUL-terminated as `cuModuleLoadData` reads it, so the probe runs on the
/// simulated driver and on a real one alike.
const SPIN_PTX: &str = concat!(include_str!("../../../tests/simgpu/ptx/spin.ptx"), "\0");
/// The tracing kernel of `timeslice-trace` (tests/simgpu/ptx/trace.ptx), NUL-terminated.
const TRACE_PTX: &str = concat!(include_str!("../../../tests/simgpu/ptx/trace.ptx"), "\0");

struct Cuda {
    handle: *mut c_void,
    get_proc: GetProc,
    version: c_int,
    flags: u64,
}

impl Cuda {
    /// `library`: the object whose `cuGetProcAddress_v2` the program resolves through
    /// (`libcuda.so.1`, or a library fronting the driver).
    fn load(version: c_int, flags: u64, library: &CStr) -> Cuda {
        // SAFETY: dlopen and dlsym get NUL-terminated C-string literals; dlerror is read
        // right after the failed dlopen, so it is a NUL-terminated message; `sym` is
        // non-null when transmuted, and cuGetProcAddress_v2 has GetProc's signature
        // (cuda.h). The handle is never closed, so `sym` stays valid.
        unsafe {
            let handle = libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
            if handle.is_null() {
                fatal(&format!(
                    "dlopen({}): {}",
                    library.to_string_lossy(),
                    CStr::from_ptr(libc::dlerror()).to_string_lossy()
                ));
            }
            let sym = libc::dlsym(handle, c"cuGetProcAddress_v2".as_ptr());
            if sym.is_null() {
                fatal("no cuGetProcAddress_v2");
            }
            Cuda {
                handle,
                get_proc: std::mem::transmute::<*mut c_void, GetProc>(sym),
                version,
                flags,
            }
        }
    }

    /// cuGetProcAddress_v2(name, version, flags): the pointer and the result.
    fn lookup(&self, name: &str, version: c_int, flags: u64) -> (R, *mut c_void) {
        let c = CString::new(name).unwrap();
        let (mut p, mut status) = (std::ptr::null_mut(), 0);
        // SAFETY: get_proc is cuGetProcAddress_v2 (resolved in `load`); `c` is a live
        // NUL-terminated string, `p` and `status` live locals of the types it writes
        // (a function pointer and a CUdriverProcAddressQueryResult, an int).
        let rc = unsafe { (self.get_proc)(c.as_ptr(), &mut p, version, flags, &mut status) };
        (rc, p)
    }

    fn get<T>(&self, name: &str) -> T {
        let (rc, p) = self.lookup(name, self.version, self.flags);
        if rc != 0 || p.is_null() {
            fatal(&format!("cuGetProcAddress_v2({name}) failed: {rc}"));
        }
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: `p` is non-null (checked above), and every caller names as T the
        // function-pointer type of `name` for this version (cuda.h).
        unsafe { std::mem::transmute_copy(&p) }
    }
}

/// A symbol from `dlsym` or `cuGetProcAddress` as the function-pointer type `T`; a null
/// one (no such symbol) is a fatal error, since null is no value of a function pointer.
///
/// # Safety
///
/// `T` must be an `unsafe extern "C" fn` type with the C signature of the function `name`
/// names (cuda.h, nvml.h).
unsafe fn entry<T>(sym: *mut c_void, name: &str) -> T {
    if sym.is_null() {
        fatal(&format!("no {name}"));
    }
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `sym` is a non-null code address of the same size as `T`, and the caller
    // guarantees `T` is that function's signature.
    unsafe { std::mem::transmute_copy(&sym) }
}

fn fatal(msg: &str) -> ! {
    eprintln!("gpushare-cuda-probe: {msg}");
    std::process::exit(3)
}

/// `libfile:symbol` of a function pointer, from the loader (which library answers).
/// `name` as the library behind `handle` defines it, looked up with glibc's own `dlsym`
/// (found with `dlvsym`, which an interposer exporting `dlsym` does not replace).
fn driver_symbol(handle: *mut c_void, name: &CStr) -> *mut c_void {
    type Dlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: dlopen of the already-loaded C library (RTLD_NOLOAD) and dlvsym with
        // NUL-terminated literals; the handle is never closed.
        let real = unsafe {
            let libc_handle =
                libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if libc_handle.is_null() {
                continue;
            }
            libc::dlvsym(libc_handle, c"dlsym".as_ptr(), version.as_ptr())
        };
        if !real.is_null() {
            // SAFETY: glibc's dlsym has Dlsym's signature; `handle` is a live dlopen
            // handle and `name` is NUL-terminated.
            return unsafe {
                std::mem::transmute::<*mut c_void, Dlsym>(real)(handle, name.as_ptr())
            };
        }
    }
    std::ptr::null_mut()
}

fn who(p: *mut c_void) -> String {
    // SAFETY: Dl_info is four raw pointers, for which all-zero (null) is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `p` is non-null (checked first) and only looked up, never called; `info`
    // is a live Dl_info for dladdr to fill.
    if p.is_null() || unsafe { libc::dladdr(p, &mut info) } == 0 {
        return "none".into();
    }
    let cstr = |s: *const c_char| {
        if s.is_null() {
            "?".into()
        } else {
            // SAFETY: a non-null name dladdr filled in: a NUL-terminated string of the
            // loader's, live while the object is loaded (this probe unloads none).
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        }
    };
    let file = cstr(info.dli_fname);
    let file = file.rsplit('/').next().unwrap_or("").to_owned();
    format!("{file}:{}", cstr(info.dli_sname))
}

enum Held {
    Device(Ptr),
    Array(H),
    Mipmapped(H),
    Pooled(Ptr),
    Mapped { va: Ptr, size: usize },
}

struct Probe {
    cuda: Cuda,
    function: H,
    held: Vec<Held>,
    pool: Option<H>,
    /// The stream `capture-begin` is capturing on, and the graph it ended with.
    capture: Option<(H, H)>,
    /// The most recent `alloc` or `managed` allocation and its size: what `fill` and `check`
    /// work on.
    last_alloc: Option<(Ptr, usize)>,
    error_name: unsafe extern "C" fn(R, *mut *const c_char) -> R,
}

impl Probe {
    fn name(&self, rc: R) -> String {
        let mut p = std::ptr::null();
        // SAFETY: error_name is cuGetErrorName (its cuda.h signature); `p` is a live
        // `*const c_char` for it to set; any result code may be asked about.
        if unsafe { (self.error_name)(rc, &mut p) } != 0 || p.is_null() {
            return format!("CUDA_ERROR_{rc}");
        }
        // SAFETY: on success cuGetErrorName points `p` (non-null, checked) at a static
        // NUL-terminated name.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn report(&self, step: &str, rc: R, extra: &str) {
        println!(
            "{step} {}{}{extra}",
            self.name(rc),
            if extra.is_empty() { "" } else { " " }
        );
    }

    fn kernel(&self, launch: Launch11, ns: u64) -> R {
        self.kernel_on(launch, ns, 0)
    }

    fn kernel_on(&self, launch: Launch11, ns: u64, stream: H) -> R {
        let mut duration = ns;
        let mut params = [&mut duration as *mut u64 as *mut c_void];
        // SAFETY: `launch` is cuLaunchKernel (Launch11 is its cuda.h signature);
        // gpushare_spin_ns takes one u64, and `params` holds one pointer to the live local
        // `duration`, read before the call returns; `extra` is null. The function and
        // stream are handles the driver checks (it answers an error for a bad one).
        unsafe {
            launch(
                self.function,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }

    fn new_stream(&self, flags: c_uint) -> H {
        let create: unsafe extern "C" fn(*mut H, c_uint) -> R = self.cuda.get("cuStreamCreate");
        let mut stream = 0;
        // SAFETY: cuStreamCreate, given a live CUstream (pointer-sized H) to write.
        let rc = unsafe { create(&mut stream, flags) };
        if rc != 0 {
            fatal(&format!("cuStreamCreate: {}", self.name(rc)));
        }
        stream
    }
}

fn num(args: &mut impl Iterator<Item = String>) -> u64 {
    let s = args.next().unwrap_or_else(|| fatal("missing number"));
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .unwrap_or_else(|_| fatal(&format!("bad number {s}")));
    n * match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => fatal(&format!("bad unit {unit}")),
    }
}

/// `CUDART_INTERFACE`, the driver's private table the CUDA runtime asks for.
const CUDART_INTERFACE: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];

/// The primary context the way the CUDA runtime gets it (`--cudart-like`): through entry 2
/// of the driver's `CUDART_INTERFACE` export table, not `cuDevicePrimaryCtxRetain`.
fn cudart_primary_context(cuda: &Cuda, ctx: &mut H, dev: c_int) -> R {
    let get_table: unsafe extern "C" fn(*mut *const usize, *const u8) -> R =
        cuda.get("cuGetExportTable");
    let mut table = std::ptr::null();
    // SAFETY: cuGetExportTable, given a live pointer to write and a 16-byte GUID.
    let rc = unsafe { get_table(&mut table, CUDART_INTERFACE.as_ptr()) };
    if rc != 0 || table.is_null() {
        return rc.max(1);
    }
    // SAFETY: the table the driver returned: its first word is its size in bytes, and
    // entry 2 lies inside it (checked).
    let entry = unsafe {
        if *table < 3 * std::mem::size_of::<usize>() {
            return 1;
        }
        *table.add(2)
    };
    if entry == 0 {
        return 1;
    }
    // SAFETY: entry 2 has this signature (a CUcontext out-parameter and a CUdevice).
    let primary: unsafe extern "C" fn(*mut H, c_int) -> R = unsafe { std::mem::transmute(entry) };
    // SAFETY: a live CUcontext to write and the device the probe got.
    unsafe { primary(ctx, dev) }
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let (mut version, mut flags, mut cudart_like) = (12040, 0, false);
    let mut driver_library = CString::from(c"libcuda.so.1");
    while let Some(a) = args.peek() {
        match a.as_str() {
            "--cudart-like" => {
                args.next();
                cudart_like = true;
            }
            "--cuda-version" => {
                args.next();
                version = num(&mut args) as c_int;
            }
            "--ptds" => {
                args.next();
                flags = PTDS;
            }
            "--driver-library" => {
                args.next();
                let path = args
                    .next()
                    .unwrap_or_else(|| fatal("--driver-library: missing path"));
                driver_library = CString::new(path)
                    .unwrap_or_else(|_| fatal("--driver-library: a path without NUL bytes"));
            }
            _ => break,
        }
    }
    let cuda = Cuda::load(version, flags, &driver_library);
    let init: unsafe extern "C" fn(c_uint) -> R = cuda.get("cuInit");
    let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> R = cuda.get("cuDeviceGet");
    let retain: unsafe extern "C" fn(*mut H, c_int) -> R = cuda.get("cuDevicePrimaryCtxRetain");
    let set_current: unsafe extern "C" fn(H) -> R = cuda.get("cuCtxSetCurrent");
    let load_module: unsafe extern "C" fn(*mut H, *const c_void) -> R =
        cuda.get("cuModuleLoadData");
    let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
        cuda.get("cuModuleGetFunction");
    let error_name = cuda.get("cuGetErrorName");
    let (mut dev, mut ctx, mut module, mut function) = (0, 0, 0, 0);
    // SAFETY: each function was looked up by its name for this CUDA version and typed
    // with its cuda.h signature; the out-pointers are live locals of the handle types
    // they write (int, pointer-sized handles); the PTX image and the kernel name are
    // NUL-terminated and outlive the calls.
    let ok = unsafe {
        init(0) == 0
            && device_get(&mut dev, 0) == 0
            && if cudart_like {
                cudart_primary_context(&cuda, &mut ctx, dev)
            } else {
                retain(&mut ctx, dev)
            } == 0
            && set_current(ctx) == 0
            && load_module(&mut module, SPIN_PTX.as_ptr().cast()) == 0
            && get_function(&mut function, module, c"gpushare_spin_ns".as_ptr()) == 0
    };
    if !ok {
        fatal("driver setup failed");
    }
    let mut p = Probe {
        cuda,
        function,
        held: Vec::new(),
        pool: None,
        capture: None,
        last_alloc: None,
        error_name,
    };
    while let Some(step) = args.next() {
        run_step(&mut p, &step, &mut args, dev, ctx);
    }
}

/// Runs the step named `step`, taking its arguments from `args`; each step is a function
/// of the module under `steps/` for its concept.
fn run_step(
    p: &mut Probe,
    step: &str,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
    ctx: H,
) {
    match step {
        "alloc" | "managed" => memory::alloc(p, step, args),
        "linked-alloc" => memory::linked_alloc(p, args),
        "pitch" => memory::pitch(p, args),
        "array" => memory::array(p, args),
        "array3d" => memory::array3d(p, args),
        "mipmap" => memory::mipmap(p, args),
        "async" | "pool-async" => memory::alloc_async(p, step, args, dev),
        "vmm" | "vmm-host" | "vmm-export" => memory::vmm(p, step, args, dev),
        "free-all" => memory::free_all(p),
        "fill" => contents::fill(p, args),
        "check" => contents::check(p, args),
        "sync" => contexts::sync(p),
        "trim" => memory::trim(p, dev),
        "pool-destroy" => memory::pool_destroy(p),
        "meminfo" => info::meminfo(p),
        "totalmem" => info::totalmem(p, dev),
        "nvml-meminfo" => info::nvml_meminfo(),
        "launch" => launches::launch(p, args),
        "launch-ex" => launches::launch_ex(p),
        "coop" => launches::coop(p),
        "graph" => captures::graph(p),
        "legacy-launch" => symbols::legacy_launch(p),
        "ptsz-check" => streams::ptsz_check(p),
        "ptsz-procaddr-alloc" => symbols::ptsz_procaddr_alloc(p, args),
        "resolver-alloc" => symbols::resolver_alloc(p, args),
        "ctx-create" => contexts::ctx_create(p, dev),
        "stream-create" => streams::stream_create(p),
        "kernel-ms" => launches::kernel_ms(p, args),
        "capture-begin" => captures::capture_begin(p, args),
        "cig-capture-begin" => captures::cig_capture_begin(p),
        "cig-capture-end" => captures::cig_capture_end(p),
        "capture-launch" => captures::capture_launch(p, args),
        "capture-end" => captures::capture_end(p),
        "capture-join" => captures::capture_join(p, args),
        "capture-join-at" => captures::capture_join_at(p, args),
        "green-launch-ahead" => streams::green_launch_ahead(p, args, dev, ctx),
        "green-kernel-ms" => streams::green_kernel_ms(p, args, dev, ctx),
        "two-streams" => streams::two_streams(p, args),
        "procaddr" => symbols::procaddr(p, args),
        "dlsym" => symbols::dlsym(p, args),
        "next" => symbols::next(p, args),
        "wait" => process::wait(p, args),
        "touch" => process::touch(p, args),
        "sleep" => process::sleep(args),
        "reset" => contexts::reset(p, dev),
        "dlsym-launch" => launches::dlsym_launch(p, args),
        "raw-launch" => launches::raw_launch(p, args),
        "stamp" => process::stamp(p),
        "copies" => copies::copies(p, args),
        "chaos" => process::chaos(p, ctx),
        "bench-launch" => launches::bench_launch(p, args),
        "bench-totalmem" | "bench-linked-totalmem" => info::bench_totalmem(p, step, args, dev),
        "timeslice-trace" => launches::timeslice_trace(p, args),
        "checkpoint" => process::checkpoint(p, args),
        "max-alloc" => info::max_alloc(p),
        other => fatal(&format!("unknown step {other}")),
    }
}
