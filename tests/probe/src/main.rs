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
//! `mipmap W H LEVELS`, `async B`, `pool-async B`, `vmm B`, `vmm-host B`, `free-all`,
//! `sync`, `trim`, `meminfo`, `totalmem`, `launch N`, `launch-ex`, `coop`, `graph`,
//! `legacy-launch`, `ptsz-check`, `procaddr NAME VERSION FLAGS`, `resolver-alloc FLAGS B`, `dlsym NAME`, `next NAME`, `nvml-meminfo`,
//! `wait FILE`, `touch FILE`, `sleep MS`, `chaos`, `bench-launch N`, `bench-totalmem N`, `bench-linked-totalmem N`,
//! `ctx-create`, `kernel-ms N`, `capture-begin global|thread-local|relaxed`, `capture-launch N`, `capture-end`,
//! `capture-join N`, `capture-join-at N TOUCH WAIT`, `cig-capture-begin`, `cig-capture-end`, `green-launch-ahead MS`, `green-kernel-ms MS`,
//! `two-streams MS`, `stream-create`, `stamp`, `copies sync|async|memset|memset-async|attributes|attributes-3d N B`, `reset`, `dlsym-launch N`,
//! `raw-launch N MS` (N kernels of MS ms through the driver's own cuLaunchKernel, past the interposer),
//! `max-alloc` (the largest single allocation granted, by binary search), `timeslice-trace MS`
//! (when a kernel of MS ms was running, from the GPU's clock), `checkpoint PID`
//! (cuCheckpointProcess* latencies on another process).
//!
//! Its kernel is `gpushare_spin_ns` from tests/simgpu/ptx/spin.ptx (PTX, spinning on
//! `%globaltimer`), so it runs unchanged on the simulated driver and on a real GPU.
#![allow(clippy::missing_transmute_annotations)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::time::{Duration, Instant};

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

#[repr(C)]
struct ArrayDesc {
    w: usize,
    h: usize,
    format: c_uint,
    channels: c_uint,
}
#[repr(C)]
struct Array3DDesc {
    w: usize,
    h: usize,
    d: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}
#[repr(C)]
struct AllocProp {
    kind: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}
#[repr(C)]
struct PoolProps {
    kind: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
    win32: *mut c_void,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
}
#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: H,
    attrs: *mut c_void,
    nattrs: c_uint,
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

/// `sizeof(CUdevResource)` (cuda.h, CUDA 12.4).
const DEV_RESOURCE_BYTES: usize = 144;

/// A non-blocking stream of a new green context on all of `dev`'s SMs (CUDA 12.5), with
/// the green context's `CUcontext` made current (events and the stream share it): the
/// worst result and the stream.
fn green_stream_current(c: &Cuda, dev: c_int) -> (R, H) {
    let get_resource: unsafe extern "C" fn(c_int, *mut c_void, c_int) -> R =
        c.get("cuDeviceGetDevResource");
    let generate: unsafe extern "C" fn(*mut H, *const c_void, c_uint) -> R =
        c.get("cuDevResourceGenerateDesc");
    let create: unsafe extern "C" fn(*mut H, H, c_int, c_uint) -> R = c.get("cuGreenCtxCreate");
    let create_stream: unsafe extern "C" fn(*mut H, H, c_uint, c_int) -> R =
        c.get("cuGreenCtxStreamCreate");
    let mut resource = [0u8; DEV_RESOURCE_BYTES];
    let (mut desc, mut green, mut stream) = (0, 0, 0);
    // SAFETY: each with live out-parameters of the types it writes; the SM resource type
    // (1), CU_GREEN_CTX_DEFAULT_STREAM (1) and CU_STREAM_NON_BLOCKING (1) as cuda.h
    // requires; the resource array is the one filled just before.
    let rc = unsafe {
        get_resource(dev, resource.as_mut_ptr().cast(), 1)
            .max(generate(&mut desc, resource.as_ptr().cast(), 1))
            .max(create(&mut green, desc, dev, 1))
            .max(create_stream(&mut stream, green, 1, 0))
    };
    let from_green: unsafe extern "C" fn(*mut H, H) -> R = c.get("cuCtxFromGreenCtx");
    let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
    let mut green_ctx = 0;
    // SAFETY: a live CUcontext to write and the green context created above.
    let rc = rc.max(unsafe { from_green(&mut green_ctx, green) });
    // SAFETY: cuCtxSetCurrent of a context the driver just named.
    (rc.max(unsafe { set_current(green_ctx) }), stream)
}

/// Room for a `CUstreamCigCaptureParams` (cuda.h: a type and a pointer).
const CIG_CAPTURE_PARAMS_BYTES: usize = 16;

/// `sizeof(CUmemcpyAttributes)` (cuda.h: an access order, two `CUmemLocation`s, flags).
const MEMCPY_ATTRIBUTES_BYTES: usize = 24;

/// A `CUDA_MEMCPY3D_BATCH_OP` (cuda.h, 112 bytes) copying `bytes` from device pointer
/// `src` to `dst`: two pointer operands (type `CU_MEMCPY_OPERAND_TYPE_POINTER` = 1, then
/// the pointer; 40 bytes each), the extent `bytes × 1 × 1` at offset 80.
fn memcpy_3d_op(dst: Ptr, src: Ptr, bytes: usize) -> [u8; 112] {
    let mut op = [0u8; 112];
    let mut put = |offset: usize, value: u64| {
        op[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    };
    put(0, 1);
    put(8, src);
    put(40, 1);
    put(48, dst);
    put(80, bytes as u64);
    put(88, 1);
    put(96, 1);
    op
}

/// Resolves `cuMemAlloc` through `get` (a `cuGetProcAddress_v2`-shaped resolver) and
/// allocates `bytes` with the answer; returns its result and the function it called.
fn alloc_through(p: &mut Probe, get: GetProc, version: c_int, bytes: usize) -> (R, *mut c_void) {
    let (mut f, mut status) = (std::ptr::null_mut(), 0);
    // SAFETY: a resolver with cuGetProcAddress_v2's signature, given a NUL-terminated name
    // and live locals for the pointer and the query result.
    let rc = unsafe { get(c"cuMemAlloc".as_ptr(), &mut f, version, 0, &mut status) };
    if rc != 0 || f.is_null() {
        fatal(&format!("resolving cuMemAlloc: {rc}"));
    }
    // SAFETY: `f` is non-null (checked above) and cuMemAlloc_v2's, of this type.
    let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = unsafe { std::mem::transmute(f) };
    let mut ptr = 0;
    // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr to write.
    let rc = unsafe { alloc(&mut ptr, bytes) };
    if rc == 0 {
        p.held.push(Held::Device(ptr));
    }
    (rc, f)
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
        error_name,
    };
    while let Some(step) = args.next() {
        run_step(&mut p, &step, &mut args, dev, ctx);
    }
}

fn run_step(
    p: &mut Probe,
    step: &str,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
    ctx: H,
) {
    let c = &p.cuda;
    match step {
        "alloc" | "managed" => {
            let bytes = num(args) as usize;
            let mut ptr = 0;
            let rc = if step == "alloc" {
                let f: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
                // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr (u64) to write.
                unsafe { f(&mut ptr, bytes) }
            } else {
                let f: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R =
                    c.get("cuMemAllocManaged");
                // SAFETY: cuMemAllocManaged, given a live CUdeviceptr to write and
                // CU_MEM_ATTACH_GLOBAL.
                unsafe { f(&mut ptr, bytes, 1) }
            };
            if rc == 0 {
                p.held.push(Held::Device(ptr));
            }
            p.report(step, rc, &format!("bytes={bytes}"));
        }
        "linked-alloc" => {
            // What a program linked with -lcuda does: its `cuMemAlloc_v2` reference is
            // bound through the global scope, where the preloaded library comes first.
            let bytes = num(args) as usize;
            // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
            let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()) };
            // SAFETY: cuMemAlloc_v2's cuda.h signature (entry refuses a null symbol).
            let f: unsafe extern "C" fn(*mut Ptr, usize) -> R =
                unsafe { entry(sym, "cuMemAlloc_v2") };
            let mut ptr = 0;
            // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr to write.
            let rc = unsafe { f(&mut ptr, bytes) };
            if rc == 0 {
                p.held.push(Held::Device(ptr));
            }
            p.report(step, rc, &format!("bytes={bytes} via={}", who(sym)));
        }
        "pitch" => {
            let (w, h) = (num(args) as usize, num(args) as usize);
            let f: unsafe extern "C" fn(*mut Ptr, *mut usize, usize, usize, c_uint) -> R =
                c.get("cuMemAllocPitch");
            let (mut ptr, mut pitch) = (0, 0);
            // SAFETY: cuMemAllocPitch_v2, given a live CUdeviceptr and a live size_t to
            // write; 4 is a valid element size.
            let rc = unsafe { f(&mut ptr, &mut pitch, w, h, 4) };
            if rc == 0 {
                p.held.push(Held::Device(ptr));
            }
            p.report(step, rc, &format!("pitch={pitch} bytes={}", pitch * h));
        }
        "array" | "array3d" | "mipmap" => {
            let (w, h) = (num(args) as usize, num(args) as usize);
            let mut handle = 0;
            let (rc, mipmapped) = match step {
                "array" => {
                    let f: unsafe extern "C" fn(*mut H, *const ArrayDesc) -> R =
                        c.get("cuArrayCreate");
                    (
                        // SAFETY: cuArrayCreate_v2, given a live CUarray to write and a
                        // CUDA_ARRAY_DESCRIPTOR (ArrayDesc is its repr(C) layout) that
                        // lives until the call returns.
                        unsafe {
                            f(
                                &mut handle,
                                &ArrayDesc {
                                    w,
                                    h,
                                    format: 0x20,
                                    channels: 1,
                                },
                            )
                        },
                        false,
                    )
                }
                "array3d" => {
                    let d = num(args) as usize;
                    let f: unsafe extern "C" fn(*mut H, *const Array3DDesc) -> R =
                        c.get("cuArray3DCreate");
                    (
                        // SAFETY: cuArray3DCreate_v2, given a live CUarray to write and a
                        // CUDA_ARRAY3D_DESCRIPTOR (Array3DDesc is its repr(C) layout) that
                        // lives until the call returns.
                        unsafe {
                            f(
                                &mut handle,
                                &Array3DDesc {
                                    w,
                                    h,
                                    d,
                                    format: 0x20,
                                    channels: 1,
                                    flags: 0,
                                },
                            )
                        },
                        false,
                    )
                }
                _ => {
                    let levels = num(args) as c_uint;
                    let f: unsafe extern "C" fn(*mut H, *const Array3DDesc, c_uint) -> R =
                        c.get("cuMipmappedArrayCreate");
                    (
                        // SAFETY: cuMipmappedArrayCreate, given a live
                        // CUmipmappedArray to write and a CUDA_ARRAY3D_DESCRIPTOR that
                        // lives until the call returns.
                        unsafe {
                            f(
                                &mut handle,
                                &Array3DDesc {
                                    w,
                                    h,
                                    d: 0,
                                    format: 0x20,
                                    channels: 1,
                                    flags: 0,
                                },
                                levels,
                            )
                        },
                        true,
                    )
                }
            };
            if rc == 0 {
                p.held.push(if mipmapped {
                    Held::Mipmapped(handle)
                } else {
                    Held::Array(handle)
                });
            }
            p.report(step, rc, "");
        }
        "async" | "pool-async" => {
            let bytes = num(args) as usize;
            let mut ptr = 0;
            let rc = if step == "async" {
                let f: unsafe extern "C" fn(*mut Ptr, usize, H) -> R = c.get("cuMemAllocAsync");
                // SAFETY: cuMemAllocAsync, given a live CUdeviceptr to write, on the
                // legacy stream (0).
                unsafe { f(&mut ptr, bytes, 0) }
            } else {
                let pool = match p.pool {
                    Some(pool) => pool,
                    None => {
                        let create: unsafe extern "C" fn(*mut H, *const PoolProps) -> R =
                            c.get("cuMemPoolCreate");
                        let props = PoolProps {
                            kind: 1,
                            handle_types: 0,
                            location_type: 1,
                            location_id: dev,
                            win32: std::ptr::null_mut(),
                            max_size: 0,
                            usage: 0,
                            reserved: [0; 54],
                        };
                        let mut pool = 0;
                        // SAFETY: cuMemPoolCreate, given a live CUmemoryPool to write and
                        // CUmemPoolProps (PoolProps is its repr(C) layout, the reserved
                        // bytes zero) that live until the call returns.
                        let rc = unsafe { create(&mut pool, &props) };
                        if rc != 0 {
                            return p.report(step, rc, "pool-create");
                        }
                        p.pool = Some(pool);
                        pool
                    }
                };
                let f: unsafe extern "C" fn(*mut Ptr, usize, H, H) -> R =
                    c.get("cuMemAllocFromPoolAsync");
                // SAFETY: cuMemAllocFromPoolAsync, given a live CUdeviceptr to write, a
                // pool the driver made, and the legacy stream.
                unsafe { f(&mut ptr, bytes, pool, 0) }
            };
            if rc == 0 {
                p.held.push(Held::Pooled(ptr));
            }
            p.report(step, rc, &format!("bytes={bytes}"));
        }
        "vmm" | "vmm-host" => {
            let size = num(args) as usize;
            let create: unsafe extern "C" fn(*mut u64, usize, *const AllocProp, u64) -> R =
                c.get("cuMemCreate");
            let location_type = if step == "vmm" { 1 } else { 2 };
            let prop = AllocProp {
                kind: 1,
                handle_types: 0,
                location_type,
                location_id: dev,
                win32: std::ptr::null_mut(),
                flags: [0; 8],
            };
            let mut handle = 0;
            // SAFETY: cuMemCreate, given a live CUmemGenericAllocationHandle (u64) to
            // write and CUmemAllocationProp (AllocProp is its repr(C) layout) that lives
            // until the call returns.
            let rc = unsafe { create(&mut handle, size, &prop, 0) };
            if rc != 0 || step == "vmm-host" {
                if rc == 0 {
                    let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
                    // SAFETY: cuMemRelease of the handle cuMemCreate just made, released once.
                    unsafe { release(handle) };
                }
                return p.report(step, rc, &format!("bytes={size}"));
            }
            let reserve: unsafe extern "C" fn(*mut Ptr, usize, usize, Ptr, u64) -> R =
                c.get("cuMemAddressReserve");
            let map: unsafe extern "C" fn(Ptr, usize, usize, u64, u64) -> R = c.get("cuMemMap");
            let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
            let mut va = 0;
            // The usual idiom: map, then release the handle at once; the memory lives until unmapped.
            // SAFETY: cuMemAddressReserve, given a live CUdeviceptr to write.
            let reserved = unsafe { reserve(&mut va, size, 0, 0, 0) };
            // SAFETY: cuMemMap takes the range and handle as values, which the driver
            // checks; the probe never touches the memory from the host.
            let mapped = unsafe { map(va, size, 0, handle, 0) };
            // SAFETY: cuMemRelease of the handle cuMemCreate made, released once.
            let released = unsafe { release(handle) };
            let rc = reserved.max(mapped).max(released);
            p.held.push(Held::Mapped { va, size });
            p.report(step, rc, &format!("bytes={size}"));
        }
        "free-all" => {
            let mut worst = 0;
            while let Some(h) = p.held.pop() {
                // SAFETY: each free function is looked up with its cuda.h signature and
                // given, once, what its allocation step stored in `held` (all values,
                // no host pointers), popped so it is never freed twice.
                let rc = unsafe {
                    match h {
                        Held::Device(ptr) => {
                            c.get::<unsafe extern "C" fn(Ptr) -> R>("cuMemFree")(ptr)
                        }
                        Held::Array(a) => {
                            c.get::<unsafe extern "C" fn(H) -> R>("cuArrayDestroy")(a)
                        }
                        Held::Mipmapped(a) => {
                            c.get::<unsafe extern "C" fn(H) -> R>("cuMipmappedArrayDestroy")(a)
                        }
                        Held::Pooled(ptr) => {
                            c.get::<unsafe extern "C" fn(Ptr, H) -> R>("cuMemFreeAsync")(ptr, 0)
                        }
                        Held::Mapped { va, size } => {
                            let unmap: unsafe extern "C" fn(Ptr, usize) -> R = c.get("cuMemUnmap");
                            let free: unsafe extern "C" fn(Ptr, usize) -> R =
                                c.get("cuMemAddressFree");
                            unmap(va, size).max(free(va, size))
                        }
                    }
                };
                worst = worst.max(rc);
            }
            p.report(step, worst, "");
        }
        "sync" => {
            let f: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
            // SAFETY: cuCtxSynchronize takes no arguments.
            let rc = unsafe { f() };
            p.report(step, rc, "");
        }
        "trim" => {
            let trim: unsafe extern "C" fn(H, usize) -> R = c.get("cuMemPoolTrimTo");
            let get_pool: unsafe extern "C" fn(*mut H, c_int) -> R = c.get("cuDeviceGetMemPool");
            let mut default_pool = 0;
            // SAFETY: cuDeviceGetMemPool, given a live CUmemoryPool to write.
            let mut rc = unsafe { get_pool(&mut default_pool, dev) };
            for pool in [Some(default_pool), p.pool].into_iter().flatten() {
                // SAFETY: cuMemPoolTrimTo takes the pool as a value, which the driver checks.
                rc = rc.max(unsafe { trim(pool, 0) });
            }
            p.report(step, rc, "");
        }
        "pool-destroy" => {
            let Some(pool) = p.pool.take() else {
                return p.report(step, 1, "no pool");
            };
            let f: unsafe extern "C" fn(H) -> R = c.get("cuMemPoolDestroy");
            // SAFETY: cuMemPoolDestroy of the pool this probe created, taken out of
            // `p.pool` so it is destroyed once.
            let rc = unsafe { f(pool) };
            p.report(step, rc, "");
        }
        "meminfo" => {
            let f: unsafe extern "C" fn(*mut usize, *mut usize) -> R = c.get("cuMemGetInfo");
            let (mut free, mut total) = (0, 0);
            // SAFETY: cuMemGetInfo_v2, given two live size_t to write.
            let rc = unsafe { f(&mut free, &mut total) };
            p.report(step, rc, &format!("free={free} total={total}"));
        }
        "totalmem" => {
            let f: unsafe extern "C" fn(*mut usize, c_int) -> R = c.get("cuDeviceTotalMem");
            let mut total = 0;
            // SAFETY: cuDeviceTotalMem_v2, given a live size_t to write.
            let rc = unsafe { f(&mut total, dev) };
            p.report(step, rc, &format!("total={total}"));
        }
        "nvml-meminfo" => nvml_meminfo(),
        "launch" => {
            let n = num(args);
            let f: Launch11 = c.get("cuLaunchKernel");
            let rc = (0..n).map(|_| p.kernel(f, 1000)).max().unwrap_or(0);
            p.report(step, rc, &format!("kernels={n}"));
        }
        "launch-ex" => {
            let f: unsafe extern "C" fn(
                *const LaunchConfig,
                H,
                *mut *mut c_void,
                *mut *mut c_void,
            ) -> R = c.get("cuLaunchKernelEx");
            let mut ns = 1000u64;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            let config = LaunchConfig {
                grid: [1; 3],
                block: [32, 1, 1],
                shared: 0,
                stream: 0,
                attrs: std::ptr::null_mut(),
                nattrs: 0,
            };
            // SAFETY: cuLaunchKernelEx, given a CUlaunchConfig (LaunchConfig is its repr(C)
            // layout, no attributes) and the kernel's one parameter, a pointer to the
            // live local `ns`; all live until the call returns.
            let rc = unsafe {
                f(
                    &config,
                    p.function,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            p.report(step, rc, "");
        }
        "coop" => {
            let f: Coop = c.get("cuLaunchCooperativeKernel");
            let mut ns = 1000u64;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            // SAFETY: cuLaunchCooperativeKernel (Coop is its cuda.h signature), given the
            // kernel's one parameter, a pointer to the live local `ns`.
            let rc = unsafe { f(p.function, 1, 1, 1, 32, 1, 1, 0, 0, params.as_mut_ptr()) };
            p.report(step, rc, "");
        }
        "graph" => {
            let create: unsafe extern "C" fn(*mut H, c_uint) -> R = c.get("cuStreamCreate");
            let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
            let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
            let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
                c.get("cuGraphInstantiateWithFlags");
            let launch: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
            let launch_kernel: Launch11 = c.get("cuLaunchKernel");
            let (mut stream, mut graph, mut exec) = (0, 0, 0);
            let mut ns = 1000u64;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            // SAFETY: each function has its cuda.h signature; the out-pointers are live
            // locals of the handle types they write, the kernel's one parameter points at
            // the live local `ns`, and handles from a failed step are only values the
            // driver rejects.
            let rc = unsafe {
                create(&mut stream, 1)
                    .max(begin(stream, 0))
                    .max(launch_kernel(
                        p.function,
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
                    ))
                    .max(end(stream, &mut graph))
                    .max(instantiate(&mut exec, graph, 0))
                    .max(launch(exec, stream))
            };
            p.report(step, rc, "");
        }
        "legacy-launch" => {
            // No simulated driver exports cuLaunch: the wrapper must say so, not crash.
            let (rc, ptr) = c.lookup("cuLaunch", 2000, 0);
            p.report(step, rc, &format!("via={}", who(ptr)));
        }
        "ptsz-check" => ptsz_check(p),
        "ptsz-procaddr-alloc" => {
            // What a per-thread-default-stream build does: cuda.h's cuGetProcAddress is
            // cuGetProcAddress_v2_ptsz there, asked with the default flags.
            let bytes = num(args) as usize;
            // SAFETY: a live handle and a NUL-terminated name.
            let sym = unsafe { libc::dlsym(c.handle, c"cuGetProcAddress_v2_ptsz".as_ptr()) };
            if sym.is_null() {
                fatal("no cuGetProcAddress_v2_ptsz");
            }
            // SAFETY: cuGetProcAddress_v2_ptsz has cuGetProcAddress_v2's signature.
            let get: GetProc = unsafe { std::mem::transmute::<*mut c_void, GetProc>(sym) };
            let (rc, f) = alloc_through(p, get, c.version, bytes);
            p.report(step, rc, &format!("bytes={bytes} via={}", who(f)));
        }
        "resolver-alloc" => {
            // The resolver asked for through the resolver (with the given flags), then
            // cuMemAlloc through the answer: what a library handed cuGetProcAddress does.
            let flags = num(args);
            let bytes = num(args) as usize;
            let (rc, resolver) = c.lookup("cuGetProcAddress", c.version, flags);
            if rc != 0 || resolver.is_null() || c.version < 12000 {
                fatal(&format!(
                    "cuGetProcAddress_v2(cuGetProcAddress, {flags}): {rc}"
                ));
            }
            // SAFETY: non-null (checked), and for CUDA 12.0+ the answer is cuGetProcAddress_v2.
            let get: GetProc = unsafe { std::mem::transmute::<*mut c_void, GetProc>(resolver) };
            let (rc, f) = alloc_through(p, get, c.version, bytes);
            p.report(
                step,
                rc,
                &format!(
                    "bytes={bytes} resolver_via={} via={}",
                    who(resolver),
                    who(f)
                ),
            );
        }
        "ctx-create" => {
            // A second context on the device, made current (pushed) like cuCtxCreate does;
            // the probe's kernels then run in it (the module is loaded there too).
            // CUDA 11.4–12.4 resolve cuCtxCreate to cuCtxCreate_v3 (execution affinity).
            let create: unsafe extern "C" fn(*mut H, *mut c_void, c_int, c_uint, c_int) -> R =
                c.get("cuCtxCreate");
            let load_module: unsafe extern "C" fn(*mut H, *const c_void) -> R =
                c.get("cuModuleLoadData");
            let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
                c.get("cuModuleGetFunction");
            let (mut context, mut module, mut function) = (0, 0, 0);
            // SAFETY: cuCtxCreate_v3 (no affinity parameters: null, 0), cuModuleLoadData and
            // cuModuleGetFunction, given live locals of the handle types they write and a
            // NUL-terminated image and name that outlive the calls.
            let rc = unsafe {
                create(&mut context, std::ptr::null_mut(), 0, 0, dev)
                    .max(load_module(&mut module, SPIN_PTX.as_ptr().cast()))
                    .max(get_function(
                        &mut function,
                        module,
                        c"gpushare_spin_ns".as_ptr(),
                    ))
            };
            if rc == 0 {
                p.function = function;
            }
            p.report(step, rc, "");
        }
        "stream-create" => {
            // One stream (default flags), kept: the first stream a CUDA runtime creates.
            p.new_stream(0);
            p.report(step, 0, "");
        }
        "kernel-ms" => {
            // One kernel of N ms on the legacy stream (long kernels: drains, overdue).
            let ms = num(args);
            let f: Launch11 = c.get("cuLaunchKernel");
            p.report(step, p.kernel(f, ms * 1_000_000), &format!("ms={ms}"));
        }
        "capture-begin" => {
            // `capture-begin global|thread-local|relaxed`: a non-blocking stream starts
            // capturing in that mode (PyTorch captures on such a stream, GLOBAL mode).
            let mode = match args.next().as_deref() {
                Some("global") => 0,
                Some("thread-local") => 1,
                Some("relaxed") => 2,
                other => fatal(&format!(
                    "capture-begin global|thread-local|relaxed, not {other:?}"
                )),
            };
            let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
            let stream = p.new_stream(1);
            // SAFETY: a stream this probe created; the mode is one of CUstreamCaptureMode's values.
            let rc = unsafe { begin(stream, mode) };
            p.capture = Some((stream, 0));
            p.report(step, rc, &format!("mode={mode}"));
        }
        "cig-capture-begin" => {
            // CUDA 13.2 (run with --cuda-version 13020): a non-blocking stream starts
            // capturing into a graphics command list (zeroed parameters: none of the
            // simulated driver's concern).
            let begin: unsafe extern "C" fn(H, *mut c_void) -> R =
                c.get("cuStreamBeginCaptureToCig");
            let stream = p.new_stream(1);
            let mut params = [0u8; CIG_CAPTURE_PARAMS_BYTES];
            // SAFETY: a stream this probe created and live CUstreamCigCaptureParams.
            let rc = unsafe { begin(stream, params.as_mut_ptr().cast()) };
            p.capture = Some((stream, 0));
            p.report(step, rc, "");
        }
        "cig-capture-end" => {
            let end: unsafe extern "C" fn(H) -> R = c.get("cuStreamEndCaptureToCig");
            let (stream, _) = p
                .capture
                .take()
                .unwrap_or_else(|| fatal("cig-capture-end before cig-capture-begin"));
            // SAFETY: cuStreamEndCaptureToCig of the stream this probe began capturing.
            let rc = unsafe { end(stream) };
            p.report(step, rc, "");
        }
        "capture-launch" => {
            let n = num(args);
            let f: Launch11 = c.get("cuLaunchKernel");
            let (stream, _) = p
                .capture
                .unwrap_or_else(|| fatal("capture-launch before capture-begin"));
            let rc = (0..n)
                .map(|_| p.kernel_on(f, 1000, stream))
                .max()
                .unwrap_or(0);
            p.report(step, rc, &format!("kernels={n}"));
        }
        "capture-end" => {
            // Ends the capture; a valid graph is instantiated, launched and waited for.
            let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
            let is_capturing: unsafe extern "C" fn(H, *mut c_int) -> R =
                c.get("cuStreamIsCapturing");
            let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
                c.get("cuGraphInstantiateWithFlags");
            let launch: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
            let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
            let (stream, _) = p
                .capture
                .unwrap_or_else(|| fatal("capture-end before capture-begin"));
            let mut status = -1;
            // SAFETY: cuStreamIsCapturing, given a stream this probe created and a live
            // CUstreamCaptureStatus (an int) to write.
            unsafe { is_capturing(stream, &mut status) };
            let mut graph = 0;
            // SAFETY: cuStreamEndCapture, given that stream and a live CUgraph to write.
            let rc = unsafe { end(stream, &mut graph) };
            let mut ran = -1;
            if rc == 0 {
                let mut exec = 0;
                // SAFETY: cuGraphInstantiateWithFlags writes a live CUgraphExec; the graph
                // is the one the driver just returned and the stream the capture's.
                ran = unsafe {
                    instantiate(&mut exec, graph, 0)
                        .max(launch(exec, stream))
                        .max(sync(stream))
                };
            }
            p.capture = None;
            p.report(step, rc, &format!("status_before={status} graph_ran={ran}"));
        }
        "capture-join" => {
            let n = num(args);
            capture_join(p, step, n, None);
        }
        "capture-join-at" => {
            // `capture-join-at N TOUCH WAIT`: capture-join that touches TOUCH once the side
            // stream has joined and has work in the capture, and waits for WAIT before
            // joining back (tests revoke the token there).
            let n = num(args);
            let touch = args
                .next()
                .unwrap_or_else(|| fatal("capture-join-at N TOUCH WAIT"));
            let wait = args
                .next()
                .unwrap_or_else(|| fatal("capture-join-at N TOUCH WAIT"));
            capture_join(p, step, n, Some((touch, wait)));
        }
        "green-launch-ahead" => {
            // CUDA 12.5 (run with --cuda-version 12050): a stream of a green context on
            // all of the device's SMs, a kernel of N ms on it, then how long a second
            // launch into that stream took (a launch-ahead bound of 1 waits for the first).
            let ms = num(args);
            let (rc, stream) = green_stream_current(c, dev);
            let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
            let f: Launch11 = c.get("cuLaunchKernel");
            let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
            let first = p.kernel_on(f, ms * 1_000_000, stream);
            let start = Instant::now();
            let second = p.kernel_on(f, 1000, stream);
            let same_us = start.elapsed().as_micros();
            // SAFETY: cuStreamSynchronize of the stream created above.
            let synced = unsafe { sync(stream) };
            // SAFETY: cuCtxSetCurrent of the probe's primary context, current before.
            let restored = unsafe { set_current(ctx) };
            p.report(
                step,
                rc.max(first).max(second).max(synced).max(restored),
                &format!("same_stream_launch_us={same_us}"),
            );
        }
        "green-kernel-ms" => {
            // CUDA 12.5 (run with --cuda-version 12050): a kernel of N ms on a green
            // context's stream, left running (no synchronisation): work only that
            // non-blocking stream, in the green context's own CUcontext, holds.
            let ms = num(args);
            let (rc, stream) = green_stream_current(c, dev);
            let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
            let f: Launch11 = c.get("cuLaunchKernel");
            let launched = p.kernel_on(f, ms * 1_000_000, stream);
            // SAFETY: cuCtxSetCurrent of the probe's primary context, current before.
            let restored = unsafe { set_current(ctx) };
            p.report(step, rc.max(launched).max(restored), "");
        }
        "two-streams" => {
            // A kernel of N ms on one stream, then a short one on another: how long the
            // second launch call took (a process-wide launch-ahead bound waits for the first).
            let ms = num(args);
            let f: Launch11 = c.get("cuLaunchKernel");
            let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
            let (a, b) = (p.new_stream(1), p.new_stream(1));
            let first = p.kernel_on(f, ms * 1_000_000, a);
            let start = Instant::now();
            let second = p.kernel_on(f, 1000, b);
            let second_us = start.elapsed().as_micros();
            let start = Instant::now();
            let third = p.kernel_on(f, 1000, a);
            let same_us = start.elapsed().as_micros();
            // SAFETY: cuCtxSynchronize takes no arguments.
            let synced = unsafe { sync() };
            p.report(
                step,
                first.max(second).max(third).max(synced),
                &format!("second_launch_us={second_us} same_stream_launch_us={same_us}"),
            );
        }
        "procaddr" => {
            let name = args
                .next()
                .unwrap_or_else(|| fatal("procaddr NAME VERSION FLAGS"));
            let (version, flags) = (num(args) as c_int, num(args));
            let (rc, ptr) = c.lookup(&name, version, flags);
            p.report(
                step,
                rc,
                &format!(
                    "name={name} version={version} flags={flags} via={}",
                    who(ptr)
                ),
            );
        }
        "dlsym" => {
            let name = args.next().unwrap_or_else(|| fatal("dlsym NAME"));
            let cname = CString::new(name.clone()).unwrap();
            // SAFETY: a live handle and a NUL-terminated name.
            let ptr = unsafe { libc::dlsym(c.handle, cname.as_ptr()) };
            p.report(step, 0, &format!("name={name} via={}", who(ptr)));
        }
        "next" => {
            // dlsym(RTLD_NEXT) searches after the *calling* object: from this program,
            // the preloaded library comes next.
            let name = args.next().unwrap_or_else(|| fatal("next NAME"));
            let cname = CString::new(name.clone()).unwrap();
            // SAFETY: a pseudo-handle and a NUL-terminated name.
            let ptr = unsafe { libc::dlsym(libc::RTLD_NEXT, cname.as_ptr()) };
            p.report(step, 0, &format!("name={name} via={}", who(ptr)));
        }
        "wait" => {
            let file = args.next().unwrap_or_else(|| fatal("wait FILE"));
            let start = Instant::now();
            while !std::path::Path::new(&file).exists() {
                if start.elapsed() > Duration::from_secs(60) {
                    fatal(&format!("{file} never appeared"));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            p.report(step, 0, "");
        }
        "touch" => {
            let file = args.next().unwrap_or_else(|| fatal("touch FILE"));
            std::fs::write(&file, b"").unwrap_or_else(|e| fatal(&format!("{file}: {e}")));
            p.report(step, 0, "");
        }
        "sleep" => std::thread::sleep(Duration::from_millis(num(args))),
        "reset" => {
            // cuDevicePrimaryCtxReset: everything made in the primary context is gone (its
            // allocations forgotten here); the context is retained again, made current and
            // the kernel loaded again, so later steps run in the fresh one.
            let reset: unsafe extern "C" fn(c_int) -> R = c.get("cuDevicePrimaryCtxReset");
            let retain: unsafe extern "C" fn(*mut H, c_int) -> R =
                c.get("cuDevicePrimaryCtxRetain");
            let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
            let load_module: unsafe extern "C" fn(*mut H, *const c_void) -> R =
                c.get("cuModuleLoadData");
            let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
                c.get("cuModuleGetFunction");
            let (mut context, mut module, mut function) = (0, 0, 0);
            // SAFETY: cuDevicePrimaryCtxReset takes a device ordinal, which the driver
            // checks. Nothing the probe uses later lives in the old context: `held` is
            // cleared and the kernel loaded again below.
            let rc = unsafe { reset(dev) };
            // SAFETY: each function has its cuda.h signature, given live locals of the
            // handle types it writes and a NUL-terminated image and name.
            let again = unsafe {
                retain(&mut context, dev)
                    .max(set_current(context))
                    .max(load_module(&mut module, SPIN_PTX.as_ptr().cast()))
                    .max(get_function(
                        &mut function,
                        module,
                        c"gpushare_spin_ns".as_ptr(),
                    ))
            };
            p.held.clear();
            if again == 0 {
                p.function = function;
            }
            p.report(step, rc, &format!("again={}", p.name(again)));
        }
        "dlsym-launch" => {
            // `dlsym-launch N`: N 1 µs kernels through the cuLaunchKernel that
            // `dlsym(dlopen("libcuda.so.1"), "cuLaunchKernel")` answers (the driver's
            // symbol table, not cuGetProcAddress), then a synchronisation.
            let n = num(args);
            // SAFETY: a live handle and a NUL-terminated name.
            let sym = unsafe { libc::dlsym(c.handle, c"cuLaunchKernel".as_ptr()) };
            if sym.is_null() {
                fatal("no cuLaunchKernel");
            }
            // SAFETY: `sym` is non-null (checked above); Launch11 is cuLaunchKernel's
            // signature (cuda.h).
            let f: Launch11 = unsafe { std::mem::transmute::<*mut c_void, Launch11>(sym) };
            let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
            let rc = (0..n).map(|_| p.kernel(f, 1000)).max().unwrap_or(0);
            // SAFETY: cuCtxSynchronize takes no arguments.
            let synced = unsafe { sync() };
            let rc = rc.max(synced);
            p.report(step, rc, &format!("kernels={n} via={}", who(sym)));
        }
        "raw-launch" => {
            // `raw-launch N MS`: a liar. N kernels of MS ms queued on the legacy stream
            // through the driver's own cuLaunchKernel, past the interposer: glibc's
            // dlsym taken with `dlvsym` (not hooked), asked for the driver library's
            // symbol. No synchronisation: the work is left queued, as a process that
            // took the token with one gated launch would leave it.
            let (n, ms) = (num(args), num(args));
            let sym = driver_symbol(c.handle, c"cuLaunchKernel");
            if sym.is_null() {
                fatal("no cuLaunchKernel past the interposer");
            }
            // SAFETY: `sym` is non-null (checked above); Launch11 is cuLaunchKernel's
            // signature (cuda.h).
            let f: Launch11 = unsafe { std::mem::transmute::<*mut c_void, Launch11>(sym) };
            let rc = (0..n)
                .map(|_| p.kernel(f, ms * 1_000_000))
                .max()
                .unwrap_or(0);
            p.report(step, rc, &format!("kernels={n} ms={ms} via={}", who(sym)));
        }
        "stamp" => {
            // Wall-clock microseconds, to order steps of different processes.
            let us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros());
            p.report(step, 0, &format!("unix_us={us}"));
        }
        "copies" => {
            // `copies sync|async|memset|memset-async N B`: N device-to-device copies of B
            // bytes between two fresh buffers (cuMemcpyDtoD, or cuMemcpyDtoDAsync on the
            // legacy stream and a synchronisation), or N memsets of one (cuMemsetD32, or
            // cuMemsetD32Async and a synchronisation), then the buffers freed.
            let mode = args
                .next()
                .unwrap_or_else(|| fatal("copies sync|async N B"));
            let (n, bytes) = (num(args), num(args) as usize);
            let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
            let free: unsafe extern "C" fn(Ptr) -> R = c.get("cuMemFree");
            let (mut a, mut b) = (0, 0);
            // SAFETY: cuMemAlloc_v2, given live CUdeviceptrs to write.
            let mut rc = unsafe { alloc(&mut a, bytes).max(alloc(&mut b, bytes)) };
            let start = Instant::now();
            if rc == 0 {
                rc = match mode.as_str() {
                    "sync" => {
                        let copy: unsafe extern "C" fn(Ptr, Ptr, usize) -> R =
                            c.get("cuMemcpyDtoD");
                        (0..n)
                            // SAFETY: cuMemcpyDtoD_v2 between the two live device buffers of
                            // `bytes` allocated above (no host memory involved).
                            .map(|_| unsafe { copy(b, a, bytes) })
                            .max()
                            .unwrap_or(0)
                    }
                    "async" => {
                        let copy: unsafe extern "C" fn(Ptr, Ptr, usize, H) -> R =
                            c.get("cuMemcpyDtoDAsync");
                        let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
                        let queued = (0..n)
                            // SAFETY: cuMemcpyDtoDAsync_v2 between the two live device
                            // buffers of `bytes`, on the legacy stream.
                            .map(|_| unsafe { copy(b, a, bytes, 0) })
                            .max();
                        // SAFETY: cuCtxSynchronize takes no arguments.
                        let synced = unsafe { sync() };
                        queued.unwrap_or(0).max(synced)
                    }
                    "memset" => {
                        let set: unsafe extern "C" fn(Ptr, c_uint, usize) -> R =
                            c.get("cuMemsetD32");
                        (0..n)
                            // SAFETY: cuMemsetD32_v2 of bytes/4 words of the live device
                            // buffer `b` of `bytes`.
                            .map(|_| unsafe { set(b, 7, bytes / 4) })
                            .max()
                            .unwrap_or(0)
                    }
                    "memset-async" => {
                        let set: unsafe extern "C" fn(Ptr, c_uint, usize, H) -> R =
                            c.get("cuMemsetD32Async");
                        let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
                        let queued = (0..n)
                            // SAFETY: cuMemsetD32Async of bytes/4 words of the live device
                            // buffer `b` of `bytes`, on the legacy stream.
                            .map(|_| unsafe { set(b, 7, bytes / 4, 0) })
                            .max();
                        // SAFETY: cuCtxSynchronize takes no arguments.
                        let synced = unsafe { sync() };
                        queued.unwrap_or(0).max(synced)
                    }
                    "attributes" => {
                        // CUDA 13.2 (run with --cuda-version 13020): the pointers decide
                        // the direction; the attributes are required, zeroed is valid.
                        let copy: unsafe extern "C" fn(Ptr, Ptr, usize, *mut c_void, H) -> R =
                            c.get("cuMemcpyWithAttributesAsync");
                        // cuCtxSynchronize is cuCtxSynchronize_v2 (a context argument) for 13.0+.
                        let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
                        let mut attributes = [0u8; MEMCPY_ATTRIBUTES_BYTES];
                        let queued = (0..n)
                            // SAFETY: cuMemcpyWithAttributesAsync between the two live device
                            // buffers of `bytes`, with a live zeroed CUmemcpyAttributes, on
                            // the legacy stream.
                            .map(|_| unsafe { copy(b, a, bytes, attributes.as_mut_ptr().cast(), 0) })
                            .max();
                        // SAFETY: cuStreamSynchronize of the legacy stream.
                        let synced = unsafe { sync(0) };
                        queued.unwrap_or(0).max(synced)
                    }
                    "attributes-3d" => {
                        let copy: unsafe extern "C" fn(*mut c_void, u64, H) -> R =
                            c.get("cuMemcpy3DWithAttributesAsync");
                        // cuCtxSynchronize is cuCtxSynchronize_v2 (a context argument) for 13.0+.
                        let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
                        let mut op = memcpy_3d_op(b, a, bytes);
                        let queued = (0..n)
                            // SAFETY: cuMemcpy3DWithAttributesAsync of one operation between
                            // the two live device buffers of `bytes` (pointer operands, a
                            // bytes × 1 × 1 extent), on the legacy stream.
                            .map(|_| unsafe { copy(op.as_mut_ptr().cast(), 0, 0) })
                            .max();
                        // SAFETY: cuStreamSynchronize of the legacy stream.
                        let synced = unsafe { sync(0) };
                        queued.unwrap_or(0).max(synced)
                    }
                    other => fatal(&format!(
                        "copies sync|async|memset|memset-async|attributes|attributes-3d, not {other}"
                    )),
                };
            }
            let ms = start.elapsed().as_millis();
            // SAFETY: cuMemFree_v2 of the buffers allocated above, each once (freeing 0,
            // a failed allocation's, is the driver's to refuse).
            let _ = unsafe { free(a).max(free(b)) };
            p.report(step, rc, &format!("mode={mode} copies={n} ms={ms}"));
        }
        "chaos" => chaos(p, ctx),
        "bench-launch" => {
            let n = num(args);
            let f: Launch11 = c.get("cuLaunchKernel");
            let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
            let start = Instant::now();
            for _ in 0..n {
                p.kernel(f, 1);
            }
            let ns = start.elapsed().as_nanos() as f64 / n as f64;
            // SAFETY: cuCtxSynchronize takes no arguments.
            unsafe { sync() };
            p.report(step, 0, &format!("ns_per_call={ns:.1}"));
        }
        "bench-totalmem" | "bench-linked-totalmem" => {
            let n = num(args);
            let f: unsafe extern "C" fn(*mut usize, c_int) -> R = if step == "bench-totalmem" {
                c.get("cuDeviceTotalMem")
            } else {
                // As a program linked with -lcuda binds it: the preloaded export, if any.
                // SAFETY: RTLD_DEFAULT and a NUL-terminated name.
                let sym =
                    unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cuDeviceTotalMem_v2".as_ptr()) };
                // SAFETY: cuDeviceTotalMem_v2's cuda.h signature (entry refuses a null symbol).
                unsafe { entry(sym, "cuDeviceTotalMem_v2") }
            };
            let mut total = 0;
            let start = Instant::now();
            for _ in 0..n {
                // SAFETY: cuDeviceTotalMem_v2, given a live size_t to write.
                unsafe { f(&mut total, dev) };
            }
            let ns = start.elapsed().as_nanos() as f64 / n as f64;
            p.report(step, 0, &format!("ns_per_call={ns:.1}"));
        }
        "timeslice-trace" => {
            // When its kernel was running, from the kernel itself (tests/simgpu/ptx/
            // trace.ptx): two of these at once on one GPU interleave at the hardware's
            // time slice. Prints start, end and each gap as FROM-TO (ns of %globaltimer).
            const MAX_GAPS: usize = 8192;
            const GAP_NS: u64 = 5_000;
            let ms = num(args);
            let load: unsafe extern "C" fn(*mut H, *const c_void) -> R = c.get("cuModuleLoadData");
            let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
                c.get("cuModuleGetFunction");
            let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
            let to_device: unsafe extern "C" fn(Ptr, *const c_void, usize) -> R =
                c.get("cuMemcpyHtoD");
            let to_host: unsafe extern "C" fn(*mut c_void, Ptr, usize) -> R = c.get("cuMemcpyDtoH");
            let free: unsafe extern "C" fn(Ptr) -> R = c.get("cuMemFree");
            let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
            let launch: Launch11 = c.get("cuLaunchKernel");
            let mut words = vec![0u64; 4 + 2 * MAX_GAPS];
            let bytes = words.len() * 8;
            let (mut module, mut function, mut buffer) = (0, 0, 0);
            let (mut ns, mut max, mut gap) = (ms * 1_000_000, MAX_GAPS as u32, GAP_NS);
            // SAFETY: each function has its cuda.h signature and gets live locals to write,
            // a NUL-terminated image and name, `bytes` of host memory in `words` both ways,
            // and gpushare_trace's four parameters as pointers to live locals of their
            // types (u64, CUdeviceptr, u32, u64), read before cuLaunchKernel returns.
            let rc = unsafe {
                let mut params = [
                    &mut ns as *mut u64 as *mut c_void,
                    &mut buffer as *mut Ptr as *mut c_void,
                    &mut max as *mut u32 as *mut c_void,
                    &mut gap as *mut u64 as *mut c_void,
                ];
                let rc = load(&mut module, TRACE_PTX.as_ptr().cast())
                    .max(get_function(
                        &mut function,
                        module,
                        c"gpushare_trace".as_ptr(),
                    ))
                    .max(alloc(&mut buffer, bytes));
                let rc = if rc == 0 {
                    to_device(buffer, words.as_ptr().cast(), bytes)
                        .max(launch(
                            function,
                            1,
                            1,
                            1,
                            1,
                            1,
                            1,
                            0,
                            0,
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        ))
                        .max(sync())
                        .max(to_host(words.as_mut_ptr().cast(), buffer, bytes))
                } else {
                    rc
                };
                if buffer != 0 {
                    free(buffer);
                }
                rc
            };
            let recorded = (words[2] as usize).min(MAX_GAPS);
            let gaps: Vec<String> = (0..recorded)
                .map(|i| format!("{}-{}", words[4 + 2 * i], words[5 + 2 * i]))
                .collect();
            p.report(
                step,
                rc,
                &format!(
                    "start={} end={} gaps={recorded} gap_list={}",
                    words[0],
                    words[1],
                    gaps.join(",")
                ),
            );
        }
        "checkpoint" => {
            // cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} (r570+, CUDA 12.8) on
            // process PID: how long each took. Each takes an optional 64-byte argument
            // block, zeroed here except the lock's timeoutMs (its first 32 bits).
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
            p.report(step, rc, &seen.join(" "));
        }
        "max-alloc" => {
            // The largest single cuMemAlloc the driver grants now, to 2 MiB (its allocation
            // granularity for large blocks): NVML's total includes memory CUDA never hands
            // out (reserved, the context), so packing quotas needs this figure.
            const STEP: usize = 2 << 20;
            let info: unsafe extern "C" fn(*mut usize, *mut usize) -> R = c.get("cuMemGetInfo");
            let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
            let free: unsafe extern "C" fn(Ptr) -> R = c.get("cuMemFree");
            let (mut free_now, mut total) = (0, 0);
            // SAFETY: cuMemGetInfo_v2, given two live size_t to write.
            let rc = unsafe { info(&mut free_now, &mut total) };
            // Invariant: `low` blocks of STEP fit; `high` blocks do not.
            let (mut low, mut high) = (0usize, total / STEP + 1);
            while rc == 0 && high - low > 1 {
                let mid = low + (high - low) / 2;
                let mut ptr = 0;
                // SAFETY: cuMemAlloc_v2 given a live CUdeviceptr; what it grants is freed
                // right away with cuMemFree_v2.
                let granted = unsafe { alloc(&mut ptr, mid * STEP) } == 0;
                if granted {
                    // SAFETY: a pointer cuMemAlloc_v2 just returned.
                    unsafe { free(ptr) };
                    low = mid;
                } else {
                    high = mid;
                }
            }
            p.report(
                step,
                rc,
                &format!("bytes={} free={free_now} total={total}", low * STEP),
            );
        }
        other => fatal(&format!("unknown step {other}")),
    }
}

/// A kernel on this thread's stream, then both streams queried: with the per-thread
/// default stream, the legacy stream is idle and the thread's own is busy.
/// `capture-join N`: a multi-stream graph capture, as `torch.cuda.Stream.wait_stream`,
/// DDP's overlap and MoE side streams make one. A non-blocking stream begins a GLOBAL
/// capture (PyTorch's default) and launches; an event recorded there is waited for by a
/// second stream, which so joins the capture (fork); both launch N kernels in all; the
/// second stream's last event is waited for by the first (join); the capture ends, and the
/// graph is instantiated, launched and waited for. The side stream is a blocking one (what
/// `cuStreamCreate(…, 0)` and `cudaStreamCreate` make), so the legacy stream may not be
/// touched while it is joined.
///
/// Prints `capture-join <first failure> kernels=N joined=<cuStreamIsCapturing status of the
/// side stream after it joined> at=<the call that failed first, or none> graph_ran=<result>`.
fn capture_join(p: &Probe, step: &str, n: u64, pause: Option<(String, String)>) {
    let c = &p.cuda;
    let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
    let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
    let event_create: unsafe extern "C" fn(*mut H, c_uint) -> R = c.get("cuEventCreate");
    let record: unsafe extern "C" fn(H, H) -> R = c.get("cuEventRecord");
    let wait_event: unsafe extern "C" fn(H, H, c_uint) -> R = c.get("cuStreamWaitEvent");
    let is_capturing: unsafe extern "C" fn(H, *mut c_int) -> R = c.get("cuStreamIsCapturing");
    let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
        c.get("cuGraphInstantiateWithFlags");
    let launch_graph: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let launch: Launch11 = c.get("cuLaunchKernel");
    let (origin, side) = (p.new_stream(1), p.new_stream(0));
    let (mut fork, mut join) = (0, 0);
    // SAFETY: cuEventCreate, given live CUevent locals to write (CU_EVENT_DISABLE_TIMING).
    let created = unsafe { event_create(&mut fork, 2).max(event_create(&mut join, 2)) };
    if created != 0 {
        fatal(&format!("cuEventCreate: {}", p.name(created)));
    }
    let mut first = (0, "none");
    let mut check = |rc: R, what: &'static str| {
        if rc != 0 && first.0 == 0 {
            first = (rc, what);
        }
    };
    let mut joined = -1;
    // SAFETY: each call has its cuda.h signature and gets streams and events this probe
    // created and live locals to write; the kernel's parameter is set up by `kernel_on`.
    unsafe {
        check(begin(origin, 0), "cuStreamBeginCapture");
        check(p.kernel_on(launch, 1000, origin), "cuLaunchKernel(origin)");
        check(record(fork, origin), "cuEventRecord(fork)");
        check(wait_event(side, fork, 0), "cuStreamWaitEvent(fork)");
        check(is_capturing(side, &mut joined), "cuStreamIsCapturing(side)");
        check(p.kernel_on(launch, 1000, side), "cuLaunchKernel(side)");
    }
    if let Some((touch, wait)) = pause {
        std::fs::write(&touch, b"").unwrap_or_else(|e| fatal(&format!("{touch}: {e}")));
        let start = Instant::now();
        while !std::path::Path::new(&wait).exists() {
            if start.elapsed() > Duration::from_secs(60) {
                fatal(&format!("{wait} never appeared"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut graph = 0;
    // SAFETY: as above.
    unsafe {
        for _ in 1..n {
            check(p.kernel_on(launch, 1000, origin), "cuLaunchKernel(origin)");
            check(p.kernel_on(launch, 1000, side), "cuLaunchKernel(side)");
        }
        check(record(join, side), "cuEventRecord(join)");
        check(wait_event(origin, join, 0), "cuStreamWaitEvent(join)");
        check(end(origin, &mut graph), "cuStreamEndCapture");
    }
    let mut ran = -1;
    if first.0 == 0 {
        let mut exec = 0;
        // SAFETY: cuGraphInstantiateWithFlags writes a live CUgraphExec; the graph is the one
        // the driver just returned and the stream the capture's.
        ran = unsafe {
            instantiate(&mut exec, graph, 0)
                .max(launch_graph(exec, origin))
                .max(sync(origin))
        };
    }
    p.report(
        step,
        first.0,
        &format!("kernels={n} joined={joined} at={} graph_ran={ran}", first.1),
    );
}

fn ptsz_check(p: &mut Probe) {
    let launch: Launch11 = p.cuda.get("cuLaunchKernel");
    let (_, legacy_query) = p.cuda.lookup("cuStreamQuery", 12040, 0);
    let (_, ptsz_query) = p.cuda.lookup("cuStreamQuery", 12040, PTDS);
    // SAFETY: both are cuStreamQuery (legacy and per-thread), CUresult(CUstream); entry
    // refuses a null one.
    let legacy_query: unsafe extern "C" fn(H) -> R =
        unsafe { entry(legacy_query, "cuStreamQuery") };
    // SAFETY: as above.
    let ptsz_query: unsafe extern "C" fn(H) -> R =
        unsafe { entry(ptsz_query, "cuStreamQuery_ptsz") };
    let rc = p.kernel(launch, 300_000_000);
    // SAFETY: cuStreamQuery of the default stream (0), a value.
    let (legacy, own) = unsafe { (legacy_query(0), ptsz_query(0)) };
    let sync: unsafe extern "C" fn() -> R = p.cuda.get("cuCtxSynchronize");
    // SAFETY: cuCtxSynchronize takes no arguments.
    unsafe { sync() };
    p.report(
        "ptsz-check",
        rc,
        &format!("legacy={} per_thread={}", p.name(legacy), p.name(own)),
    );
}

/// Threads that allocate and launch, forks (the children use the library's dlsym
/// and spawn a thread), then the process exits with a long kernel in flight and its
/// threads still running.
fn chaos(p: &mut Probe, ctx: H) {
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

fn nvml_meminfo() {
    #[repr(C)]
    #[derive(Default)]
    struct Mem {
        total: u64,
        free: u64,
        used: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct MemV2 {
        version: c_uint,
        total: u64,
        reserved: u64,
        free: u64,
        used: u64,
    }
    // SAFETY: a NUL-terminated name.
    let h = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        fatal("dlopen(libnvidia-ml.so.1)");
    }
    let lookup = |name: &CStr| {
        // SAFETY: `h` is the live handle above (never closed), `name` NUL-terminated.
        unsafe { libc::dlsym(h, name.as_ptr()) }
    };
    // SAFETY: nvmlInit_v2's nvml.h signature; entry refuses a null symbol.
    let init: unsafe extern "C" fn() -> c_int =
        unsafe { entry(lookup(c"nvmlInit_v2"), "nvmlInit_v2") };
    // SAFETY: nvmlDeviceGetHandleByIndex_v2's nvml.h signature (nvmlDevice_t is a pointer).
    let by_index: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int = unsafe {
        entry(
            lookup(c"nvmlDeviceGetHandleByIndex_v2"),
            "nvmlDeviceGetHandleByIndex_v2",
        )
    };
    // SAFETY: nvmlDeviceGetMemoryInfo's nvml.h signature (Mem is nvmlMemory_t's layout).
    let info: unsafe extern "C" fn(*mut c_void, *mut Mem) -> c_int = unsafe {
        entry(
            lookup(c"nvmlDeviceGetMemoryInfo"),
            "nvmlDeviceGetMemoryInfo",
        )
    };
    // SAFETY: nvmlDeviceGetMemoryInfo_v2's nvml.h signature (MemV2 is nvmlMemory_v2_t's
    // layout).
    let info2: unsafe extern "C" fn(*mut c_void, *mut MemV2) -> c_int = unsafe {
        entry(
            lookup(c"nvmlDeviceGetMemoryInfo_v2"),
            "nvmlDeviceGetMemoryInfo_v2",
        )
    };
    let mut device = std::ptr::null_mut();
    let (mut m, mut m2) = (
        Mem::default(),
        MemV2 {
            version: (2 << 24) | 40,
            ..Default::default()
        },
    );
    // SAFETY: nvmlInit_v2 takes nothing; the others write a live nvmlDevice_t, a live
    // nvmlMemory_t and a live nvmlMemory_v2_t whose version field says so; a null device
    // from a failed lookup is a value NVML refuses.
    let rc = unsafe {
        init()
            .max(by_index(0, &mut device))
            .max(info(device, &mut m))
            .max(info2(device, &mut m2))
    };
    println!(
        "nvml-meminfo {rc} total={} free={} used={} v2_total={} v2_free={} v2_used={} v2_reserved={}",
        m.total, m.free, m.used, m2.total, m2.free, m2.used, m2.reserved
    );
}
