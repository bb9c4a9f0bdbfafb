//! Is there an NVIDIA driver to check? Asked of the driver itself, not of one file: the
//! CUDA driver library loads, `cuInit(0)` succeeds and counts a device, and NVML (which
//! the arbiter needs) initialises. `/proc/driver/nvidia` alone says neither (a container
//! may lack it and still have the GPU, or have it with no usable library).

use libc::{c_char, c_int, c_uint, c_void};
use std::ffi::CStr;

/// What the CUDA driver library answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaSeen {
    /// `dlopen("libcuda.so.1")` failed, with dlerror's text.
    NotLoadable(String),
    /// A symbol every CUDA driver exports is missing.
    MissingSymbol(&'static str),
    /// `cuInit(0)` returned this code.
    InitFailed(c_int),
    /// It initialised: the device count, `cuDriverGetVersion`, device 0's name.
    Ready {
        devices: c_int,
        version: c_int,
        name: String,
    },
}

/// What NVML answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlSeen {
    NotLoadable(String),
    MissingSymbol(&'static str),
    InitFailed(c_int),
    /// `nvmlSystemGetDriverVersion`, e.g. "570.124.06".
    Ready {
        driver: String,
    },
}

/// The GPU the run checks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Gpu {
    pub name: String,
    pub devices: c_int,
    /// `cuDriverGetVersion`: 13000 for CUDA 13.0.
    pub cuda_version: c_int,
    pub driver: String,
}

impl Gpu {
    pub fn summary(&self) -> String {
        format!(
            "{} (driver {}, CUDA {}.{}, {} device(s))",
            self.name,
            self.driver,
            self.cuda_version / 1000,
            self.cuda_version % 1000 / 10,
            self.devices
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detection {
    /// No driver or no GPU: nothing to check (exit 0), and why.
    Absent(String),
    /// A driver is there but does not work: a failure, and why.
    Broken(String),
    Present(Gpu),
}

/// `CUDA_ERROR_NO_DEVICE`: the library works and there is no GPU.
const CUDA_ERROR_NO_DEVICE: c_int = 100;

/// Decides from what the two libraries answered.
pub fn decide(cuda: CudaSeen, nvml: NvmlSeen) -> Detection {
    let (devices, cuda_version, name) = match cuda {
        CudaSeen::NotLoadable(why) => {
            return Detection::Absent(format!("libcuda.so.1 cannot be loaded: {why}"))
        }
        CudaSeen::InitFailed(CUDA_ERROR_NO_DEVICE) => {
            return Detection::Absent("cuInit(0): CUDA_ERROR_NO_DEVICE, no GPU is visible".into())
        }
        CudaSeen::Ready { devices: 0, .. } => {
            return Detection::Absent("cuDeviceGetCount counts 0 devices".into())
        }
        CudaSeen::MissingSymbol(symbol) => {
            return Detection::Broken(format!("libcuda.so.1 does not export {symbol}"))
        }
        CudaSeen::InitFailed(rc) => {
            return Detection::Broken(format!("libcuda.so.1 loads but cuInit(0) returned {rc}"))
        }
        CudaSeen::Ready {
            devices,
            version,
            name,
        } => (devices, version, name),
    };
    let driver = match nvml {
        NvmlSeen::Ready { driver } => driver,
        NvmlSeen::NotLoadable(why) => {
            return Detection::Broken(format!(
                "CUDA sees {devices} device(s) but libnvidia-ml.so.1 cannot be loaded: {why}"
            ))
        }
        NvmlSeen::MissingSymbol(symbol) => {
            return Detection::Broken(format!("libnvidia-ml.so.1 does not export {symbol}"))
        }
        NvmlSeen::InitFailed(rc) => {
            return Detection::Broken(format!(
                "CUDA sees {devices} device(s) but nvmlInit_v2 returned {rc}"
            ))
        }
    };
    Detection::Present(Gpu {
        name,
        devices,
        cuda_version,
        driver,
    })
}

/// Asks this machine's libraries (whatever the loader finds: `LD_LIBRARY_PATH` first).
pub fn detect() -> Detection {
    decide(ask_cuda(), ask_nvml())
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message valid until the next dl call.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        return "no reason given".into();
    }
    // SAFETY: non-null, NUL-terminated, read before any other dl call.
    unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned()
}

fn open(name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: a NUL-terminated name; the handle stays open for the process (the library
    // keeps its state for the steps' own processes to re-create; nothing here unloads it).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        Err(dlerror())
    } else {
        Ok(handle)
    }
}

/// The export `name` of `handle`, as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of that export.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &'static CStr) -> Option<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a live handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    // SAFETY: the caller names the export's signature; the sizes match (asserted).
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn ask_cuda() -> CudaSeen {
    let handle = match open(c"libcuda.so.1") {
        Ok(h) => h,
        Err(why) => return CudaSeen::NotLoadable(why),
    };
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type OutInt = unsafe extern "C" fn(*mut c_int) -> c_int;
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    // SAFETY: each type is the export's cuda.h signature.
    let (init, count, version, get, name) = unsafe {
        (
            symbol::<Init>(handle, c"cuInit"),
            symbol::<OutInt>(handle, c"cuDeviceGetCount"),
            symbol::<OutInt>(handle, c"cuDriverGetVersion"),
            symbol::<DeviceGet>(handle, c"cuDeviceGet"),
            symbol::<Name>(handle, c"cuDeviceGetName"),
        )
    };
    let (Some(init), Some(count), Some(version), Some(get), Some(name)) =
        (init, count, version, get, name)
    else {
        return CudaSeen::MissingSymbol(
            "cuInit, cuDeviceGetCount, cuDriverGetVersion, cuDeviceGet or cuDeviceGetName",
        );
    };
    // SAFETY: cuInit takes flags 0.
    let rc = unsafe { init(0) };
    if rc != 0 {
        return CudaSeen::InitFailed(rc);
    }
    let (mut devices, mut cuda_version, mut device) = (0, 0, 0);
    let mut buf = [0 as c_char; 256];
    // SAFETY: live out-parameters; the name buffer's length is passed.
    let rc = unsafe {
        count(&mut devices)
            .max(version(&mut cuda_version))
            .max(if devices > 0 { get(&mut device, 0) } else { 0 })
            .max(if devices > 0 {
                name(buf.as_mut_ptr(), buf.len() as c_int, device)
            } else {
                0
            })
    };
    if rc != 0 {
        return CudaSeen::InitFailed(rc);
    }
    // SAFETY: cuDeviceGetName NUL-terminates within the length given (zeroed otherwise).
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    CudaSeen::Ready {
        devices,
        version: cuda_version,
        name,
    }
}

fn ask_nvml() -> NvmlSeen {
    let handle = match open(c"libnvidia-ml.so.1") {
        Ok(h) => h,
        Err(why) => return NvmlSeen::NotLoadable(why),
    };
    type Init = unsafe extern "C" fn() -> c_int;
    type Version = unsafe extern "C" fn(*mut c_char, c_uint) -> c_int;
    // SAFETY: each type is the export's nvml.h signature.
    let (init, version) = unsafe {
        (
            symbol::<Init>(handle, c"nvmlInit_v2"),
            symbol::<Version>(handle, c"nvmlSystemGetDriverVersion"),
        )
    };
    let Some(init) = init else {
        return NvmlSeen::MissingSymbol("nvmlInit_v2");
    };
    // SAFETY: nvmlInit_v2 takes nothing.
    let rc = unsafe { init() };
    if rc != 0 {
        return NvmlSeen::InitFailed(rc);
    }
    let mut buf = [0 as c_char; 96];
    let driver = match version {
        // SAFETY: the buffer and its length.
        Some(v) if unsafe { v(buf.as_mut_ptr(), buf.len() as c_uint) } == 0 => {
            // SAFETY: NVML NUL-terminates within the length given.
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        }
        _ => "unknown".into(),
    };
    NvmlSeen::Ready { driver }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(devices: c_int) -> CudaSeen {
        CudaSeen::Ready {
            devices,
            version: 13000,
            name: "NVIDIA H100 80GB HBM3".into(),
        }
    }

    #[test]
    fn decisions() {
        let nvml = || NvmlSeen::Ready {
            driver: "580.65.06".into(),
        };
        let absent =
            |d: &Detection, part: &str| matches!(d, Detection::Absent(why) if why.contains(part));
        let broken =
            |d: &Detection, part: &str| matches!(d, Detection::Broken(why) if why.contains(part));
        let d = decide(CudaSeen::NotLoadable("no such file".into()), nvml());
        assert!(
            absent(&d, "libcuda.so.1 cannot be loaded: no such file"),
            "{d:?}"
        );
        let d = decide(CudaSeen::InitFailed(100), NvmlSeen::NotLoadable("x".into()));
        assert!(absent(&d, "CUDA_ERROR_NO_DEVICE"), "{d:?}");
        let d = decide(ready(0), nvml());
        assert!(absent(&d, "0 devices"), "{d:?}");
        let d = decide(CudaSeen::InitFailed(999), nvml());
        assert!(broken(&d, "cuInit(0) returned 999"), "{d:?}");
        let d = decide(CudaSeen::MissingSymbol("cuInit"), nvml());
        assert!(broken(&d, "does not export cuInit"), "{d:?}");
        let d = decide(ready(1), NvmlSeen::NotLoadable("gone".into()));
        assert!(
            broken(&d, "libnvidia-ml.so.1 cannot be loaded: gone"),
            "{d:?}"
        );
        let d = decide(ready(1), NvmlSeen::InitFailed(9));
        assert!(broken(&d, "nvmlInit_v2 returned 9"), "{d:?}");
        let d = decide(ready(2), nvml());
        assert_eq!(
            d,
            Detection::Present(Gpu {
                name: "NVIDIA H100 80GB HBM3".into(),
                devices: 2,
                cuda_version: 13000,
                driver: "580.65.06".into()
            })
        );
    }
}
