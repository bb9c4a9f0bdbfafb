//! Steps that launch kernels: through each launch entry point, through `cuLaunchKernel`
//! found other ways (the driver's symbol table, past the interposer), and timed.

use crate::{driver_symbol, fatal, num, who, Coop, Launch11, Probe, Ptr, H, R, TRACE_PTX};
use std::ffi::{c_char, c_uint, c_void};
use std::time::Instant;

#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: H,
    attrs: *mut c_void,
    nattrs: c_uint,
}

pub(crate) fn launch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let n = num(args);
    let f: Launch11 = c.get("cuLaunchKernel");
    let rc = (0..n).map(|_| p.kernel(f, 1000)).max().unwrap_or(0);
    p.report("launch", rc, &format!("kernels={n}"));
}

pub(crate) fn launch_ex(p: &mut Probe) {
    let c = &p.cuda;
    let f: unsafe extern "C" fn(*const LaunchConfig, H, *mut *mut c_void, *mut *mut c_void) -> R =
        c.get("cuLaunchKernelEx");
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
    p.report("launch-ex", rc, "");
}

pub(crate) fn coop(p: &mut Probe) {
    let c = &p.cuda;
    let f: Coop = c.get("cuLaunchCooperativeKernel");
    let mut ns = 1000u64;
    let mut params = [&mut ns as *mut u64 as *mut c_void];
    // SAFETY: cuLaunchCooperativeKernel (Coop is its cuda.h signature), given the
    // kernel's one parameter, a pointer to the live local `ns`.
    let rc = unsafe { f(p.function, 1, 1, 1, 32, 1, 1, 0, 0, params.as_mut_ptr()) };
    p.report("coop", rc, "");
}

pub(crate) fn kernel_ms(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // One kernel of N ms on the legacy stream (long kernels: drains, overdue).
    let c = &p.cuda;
    let ms = num(args);
    let f: Launch11 = c.get("cuLaunchKernel");
    p.report(
        "kernel-ms",
        p.kernel(f, ms * 1_000_000),
        &format!("ms={ms}"),
    );
}

pub(crate) fn dlsym_launch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // `dlsym-launch N`: N 1 µs kernels through the cuLaunchKernel that
    // `dlsym(dlopen("libcuda.so.1"), "cuLaunchKernel")` answers (the driver's
    // symbol table, not cuGetProcAddress), then a synchronisation.
    let c = &p.cuda;
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
    p.report("dlsym-launch", rc, &format!("kernels={n} via={}", who(sym)));
}

pub(crate) fn raw_launch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // `raw-launch N MS`: a liar. N kernels of MS ms queued on the legacy stream
    // through the driver's own cuLaunchKernel, past the interposer: glibc's
    // dlsym taken with `dlvsym` (not hooked), asked for the driver library's
    // symbol. No synchronisation: the work is left queued, as a process that
    // took the token with one gated launch would leave it.
    let c = &p.cuda;
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
    p.report(
        "raw-launch",
        rc,
        &format!("kernels={n} ms={ms} via={}", who(sym)),
    );
}

pub(crate) fn bench_launch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
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
    p.report("bench-launch", 0, &format!("ns_per_call={ns:.1}"));
}

pub(crate) fn timeslice_trace(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // When its kernel was running, from the kernel itself (tests/simgpu/ptx/
    // trace.ptx): two of these at once on one GPU interleave at the hardware's
    // time slice. Prints start, end and each gap as FROM-TO (ns of %globaltimer).
    let c = &p.cuda;
    const MAX_GAPS: usize = 8192;
    const GAP_NS: u64 = 5_000;
    let ms = num(args);
    let load: unsafe extern "C" fn(*mut H, *const c_void) -> R = c.get("cuModuleLoadData");
    let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
        c.get("cuModuleGetFunction");
    let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
    let to_device: unsafe extern "C" fn(Ptr, *const c_void, usize) -> R = c.get("cuMemcpyHtoD");
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
        "timeslice-trace",
        rc,
        &format!(
            "start={} end={} gaps={recorded} gap_list={}",
            words[0],
            words[1],
            gaps.join(",")
        ),
    );
}
