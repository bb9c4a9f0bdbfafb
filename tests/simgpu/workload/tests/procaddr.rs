//! cuGetProcAddress_v2 on the installed libcuda.so.1, called as the CUDA runtime calls it.

mod common;
use libc::{c_char, c_int, c_void};
use std::ffi::CString;

type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
const PTDS: u64 = 1 << 1;
const CUDA_ERROR_NOT_FOUND: c_int = 500;

struct Lib(*mut c_void);

impl Lib {
    fn open() -> Lib {
        let path = CString::new(common::libs_dir().join("libcuda.so.1").to_str().unwrap()).unwrap();
        // SAFETY: dlopen of our own library; never closed.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen libcuda.so.1");
        Lib(handle)
    }

    fn sym(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).unwrap();
        // SAFETY: dlsym on a live handle.
        unsafe { libc::dlsym(self.0, c.as_ptr()) }
    }

    fn get(&self, name: &str, version: c_int, flags: u64) -> (c_int, *mut c_void, c_int) {
        // SAFETY: the exported cuGetProcAddress_v2 has this signature (cuda.h, CUDA 12).
        let f: GetProcAddressV2 = unsafe { std::mem::transmute(self.sym("cuGetProcAddress_v2")) };
        let c = CString::new(name).unwrap();
        let (mut pfn, mut status) = (std::ptr::null_mut(), -1);
        // SAFETY: valid out-pointers.
        let rc = unsafe { f(c.as_ptr(), &mut pfn, version, flags, &mut status) };
        (rc, pfn, status)
    }
}

#[test]
fn versions_and_flags_select_the_abi() {
    let lib = Lib::open();
    let found = |name: &str, version, flags, symbol: &str| {
        let (rc, pfn, status) = lib.get(name, version, flags);
        assert_eq!((rc, status), (0, 0), "{name}@{version} flags {flags}");
        assert_eq!(
            pfn,
            lib.sym(symbol),
            "{name}@{version} flags {flags} should be {symbol}"
        );
        assert!(!pfn.is_null());
    };
    found("cuLaunchKernel", 12040, PTDS, "cuLaunchKernel_ptsz");
    found("cuLaunchKernel", 12040, 0, "cuLaunchKernel");
    found("cuMemcpyHtoD", 12040, PTDS, "cuMemcpyHtoD_v2_ptds");
    found("cuMemAllocAsync", 12040, PTDS, "cuMemAllocAsync_ptsz");
    found("cuGraphLaunch", 12040, PTDS, "cuGraphLaunch_ptsz");
    found("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
    found("cuMemAlloc", 12040, PTDS, "cuMemAlloc_v2");
    found("cuCtxCreate", 3020, 0, "cuCtxCreate_v2");
    found("cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
    found("cuCtxCreate", 12050, 0, "cuCtxCreate_v4");
    found(
        "cuDevicePrimaryCtxRelease",
        11000,
        0,
        "cuDevicePrimaryCtxRelease_v2",
    );
    found("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
    // The real driver's table: a per-thread request for the resolver itself is answered
    // with the plain resolver (its flags are per call, not per function).
    found("cuGetProcAddress", 12040, PTDS, "cuGetProcAddress_v2");
    found("cuGetProcAddress", 11030, PTDS, "cuGetProcAddress");

    let (rc, pfn, status) = lib.get("cuMemAlloc", 2000, 0);
    assert_eq!(
        (rc, pfn.is_null(), status),
        (CUDA_ERROR_NOT_FOUND, true, 2),
        "version not sufficient"
    );
    let (rc, pfn, status) = lib.get("cuNoSuchThing", 12040, 0);
    assert_eq!(
        (rc, pfn.is_null(), status),
        (CUDA_ERROR_NOT_FOUND, true, 1),
        "symbol not found"
    );
    let (rc, _, _) = lib.get("cuMemAlloc", 99000, 0);
    assert_eq!(
        rc, 1,
        "a version newer than the driver is CUDA_ERROR_INVALID_VALUE"
    );
}

#[test]
fn the_per_thread_get_proc_address_defaults_to_per_thread_variants() {
    let lib = Lib::open();
    found_ptsz(&lib);
}

/// cuda.h declares `cuGetProcAddress_v2_ptsz` for per-thread default stream compilation:
/// flags 0 there mean CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM. Only its export reaches
/// it; `cuGetProcAddress` never hands it out.
fn found_ptsz(lib: &Lib) {
    let pfn = lib.sym("cuGetProcAddress_v2_ptsz");
    assert!(!pfn.is_null(), "exported");
    // SAFETY: the export has cuGetProcAddress_v2's signature.
    let ptsz: GetProcAddressV2 = unsafe { std::mem::transmute(pfn) };
    let get = |name: &str, flags: u64| {
        let c = CString::new(name).unwrap();
        let (mut pfn, mut status) = (std::ptr::null_mut(), -1);
        // SAFETY: valid out-pointers.
        let rc = unsafe { ptsz(c.as_ptr(), &mut pfn, 12040, flags, &mut status) };
        assert_eq!((rc, status), (0, 0), "{name}");
        pfn
    };
    assert_eq!(get("cuLaunchKernel", 0), lib.sym("cuLaunchKernel_ptsz"));
    assert_eq!(
        get("cuStreamGetCaptureInfo", 0),
        lib.sym("cuStreamGetCaptureInfo_v3_ptsz")
    );
    assert_eq!(
        get("cuLaunchKernel", 1),
        lib.sym("cuLaunchKernel"),
        "an explicit CU_GET_PROC_ADDRESS_LEGACY_STREAM is honoured"
    );
    assert_eq!(get("cuMemAlloc", 0), lib.sym("cuMemAlloc_v2"), "no stream");
}

#[test]
fn library_has_the_driver_soname_and_binds_symbolically() {
    let out = std::process::Command::new("readelf")
        .arg("-d")
        .arg(common::libs_dir().join("libcuda.so.1"))
        .output()
        .expect("readelf (binutils) is needed to inspect the library");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libcuda.so.1]"), "{text}");
    assert!(
        text.contains("SYMBOLIC"),
        "the library must be linked with -Bsymbolic: {text}"
    );
    let nvml = std::process::Command::new("readelf")
        .arg("-d")
        .arg(common::libs_dir().join("libnvidia-ml.so.1"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&nvml.stdout).contains("Library soname: [libnvidia-ml.so.1]"));
}
