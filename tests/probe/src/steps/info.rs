//! Steps that ask how much memory there is: the driver's and NVML's answers, the largest
//! single grant, and how long asking takes.

use crate::{entry, fatal, num, Probe, Ptr, R};
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::time::Instant;

pub(crate) fn meminfo(p: &mut Probe) {
    let c = &p.cuda;
    let f: unsafe extern "C" fn(*mut usize, *mut usize) -> R = c.get("cuMemGetInfo");
    let (mut free, mut total) = (0, 0);
    // SAFETY: cuMemGetInfo_v2, given two live size_t to write.
    let rc = unsafe { f(&mut free, &mut total) };
    p.report("meminfo", rc, &format!("free={free} total={total}"));
}

pub(crate) fn totalmem(p: &mut Probe, dev: c_int) {
    let c = &p.cuda;
    let f: unsafe extern "C" fn(*mut usize, c_int) -> R = c.get("cuDeviceTotalMem");
    let mut total = 0;
    // SAFETY: cuDeviceTotalMem_v2, given a live size_t to write.
    let rc = unsafe { f(&mut total, dev) };
    p.report("totalmem", rc, &format!("total={total}"));
}

pub(crate) fn bench_totalmem(
    p: &mut Probe,
    step: &str,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
) {
    let c = &p.cuda;
    let n = num(args);
    let f: unsafe extern "C" fn(*mut usize, c_int) -> R = if step == "bench-totalmem" {
        c.get("cuDeviceTotalMem")
    } else {
        // As a program linked with -lcuda binds it: the preloaded export, if any.
        // SAFETY: RTLD_DEFAULT and a NUL-terminated name.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cuDeviceTotalMem_v2".as_ptr()) };
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

pub(crate) fn max_alloc(p: &mut Probe) {
    // The largest single cuMemAlloc the driver grants now, to 2 MiB (its allocation
    // granularity for large blocks): NVML's total includes memory CUDA never hands
    // out (reserved, the context), so packing quotas needs this figure.
    let c = &p.cuda;
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
        "max-alloc",
        rc,
        &format!("bytes={} free={free_now} total={total}", low * STEP),
    );
}

pub(crate) fn nvml_meminfo() {
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
