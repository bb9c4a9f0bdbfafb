//! Modules and functions. No code runs on the simulated GPU, but images are checked like the
//! real driver checks them: `cuModuleLoadData` takes PTX text (e.g. `tests/simgpu/ptx/
//! spin.ptx`), and `cuModuleGetFunction` finds only the kernels (`.entry`) the image declares.
//! A function's duration comes from its first parameter (`gpushare_spin_ns`) or its name
//! (`sleep_2ms`; see `simgpu_model::kernel`).
//!
//! Module memory is loaded lazily, as CUDA does by default since 12.2 (CUDA_MODULE_LOADING=
//! LAZY): a module costs nothing on the device until the first launch of one of its kernels,
//! which charges `SIMGPU_MODULE_MEMORY` (and fails with `CUDA_ERROR_OUT_OF_MEMORY` when the
//! GPU cannot fit it); unloading the module or destroying its context gives it back.
//!
//! PTX is refused where the configured driver (`SIMGPU_CUDA_VERSION`) would refuse it: a
//! `.version` newer than the PTX ISA that driver release knows is
//! `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, a `.target` older than the oldest architecture its
//! release compiles for (sm_75 from CUDA 13.0, sm_50 in 12.x, sm_35 in 11.x) or a header
//! that does not parse is `CUDA_ERROR_INVALID_PTX` (the JIT compilation fails).

use super::Handle;
use crate::driver::{driver, Function, Module};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_char, c_void};
use simgpu_model::kernel::{KernelDuration, ModuleImage};
use std::ffi::CStr;

/// What a PTX module's header asks of the driver that JIT-compiles it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PtxHeader {
    /// `.version MAJOR.MINOR`: the PTX ISA the text is written in.
    isa: (u32, u32),
    /// `.target sm_NN` (an `a`/`f` suffix is ignored): the oldest architecture it runs on.
    target_sm: u32,
}

/// Reads `.version` and `.target` from PTX text; `None` where either is absent or malformed.
fn ptx_header(text: &str) -> Option<PtxHeader> {
    let directive = |name: &str| {
        text.lines()
            .map(|line| line.split("//").next().unwrap_or("").trim())
            .find_map(|line| {
                line.strip_prefix(name)
                    .filter(|rest| rest.starts_with(char::is_whitespace))
            })
            .map(str::trim)
    };
    let (major, minor) = directive(".version")?.split_once('.')?;
    // `.target sm_90a, texmode_independent`: the architecture is the first of the list.
    let target = directive(".target")?.split(',').next()?.trim();
    let digits: String = target
        .strip_prefix("sm_")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some(PtxHeader {
        isa: (major.parse().ok()?, minor.parse().ok()?),
        target_sm: digits.parse().ok()?,
    })
}

/// The newest PTX ISA a driver of CUDA `cuda_version` (`cuDriverGetVersion`'s 12080 for 12.8)
/// JIT-compiles, from the PTX ISA release history: ISA 7.x came with CUDA 11.x, 8.0–8.5 with
/// 12.0–12.5, 12.6 kept 8.5, 12.7–12.9 brought 8.6–8.8, and 9.x comes with 13.x. `None`
/// before CUDA 11, which simgpu does not model.
fn newest_ptx_isa(cuda_version: i32) -> Option<(u32, u32)> {
    let (major, minor) = (cuda_version / 1000, (cuda_version % 1000 / 10) as u32);
    match major {
        ..=10 => None,
        11 => Some((7, minor)),
        12 if minor <= 5 => Some((8, minor)),
        12 => Some((8, minor - 1)),
        _ => Some((major as u32 - 4, minor)),
    }
}

/// The oldest `.target` a driver of CUDA `cuda_version` compiles for: each major release drops
/// the architectures its toolchain no longer supports (CUDA 13.0 dropped Maxwell, Pascal and
/// Volta, below sm_75; 12.0 dropped Kepler, below sm_50).
fn oldest_ptx_target(cuda_version: i32) -> u32 {
    match cuda_version / 1000 {
        ..=10 => 0,
        11 => 35,
        12 => 50,
        _ => 75,
    }
}

/// Why a driver of CUDA `cuda_version` refuses to JIT-compile PTX `text`, if it does.
fn ptx_refusal(text: &str, cuda_version: i32) -> Option<CudaError> {
    let Some(header) = ptx_header(text) else {
        return Some(CudaError::InvalidPtx);
    };
    if newest_ptx_isa(cuda_version).is_some_and(|newest| header.isa > newest) {
        return Some(CudaError::UnsupportedPtxVersion);
    }
    (header.target_sm < oldest_ptx_target(cuda_version)).then_some(CudaError::InvalidPtx)
}

/// Reads what `image` is: its first 4 bytes decide binary formats; text is read up to its NUL
/// (cuModuleLoadData requires PTX to be NUL-terminated).
///
/// # Safety
/// `image` must point at a module image per the cuModuleLoadData contract.
unsafe fn classify(image: *const c_void) -> ModuleImage {
    // SAFETY: every image format is at least 4 bytes long (a cubin's ELF header, a fatbin's
    // header) or NUL-terminated text; bytes are read one at a time and the scan stops at a NUL.
    let head: Vec<u8> = unsafe {
        let p = image as *const u8;
        (0..4)
            .map(|i| p.add(i).read())
            .take_while(|&b| b != 0)
            .collect()
    };
    if head.len() == 4 && matches!(ModuleImage::parse(&head), ModuleImage::Binary) {
        return ModuleImage::Binary;
    }
    // SAFETY: not a binary format, so NUL-terminated text per the contract.
    let text = unsafe { CStr::from_ptr(image as *const c_char) };
    ModuleImage::parse(text.to_bytes())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let ctx = d.current(&state)?;
        if image.is_null() || module.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: the caller's image per the API contract.
        let kind = match unsafe { classify(image) } {
            ModuleImage::Binary => return Err(CudaError::NotSupported),
            ModuleImage::InvalidPtx => return Err(CudaError::InvalidPtx),
            ModuleImage::Invalid => return Err(CudaError::InvalidImage),
            kind => kind,
        };
        // SAFETY: classified as PTX, so NUL-terminated text per the contract.
        let text = unsafe { CStr::from_ptr(image as *const c_char) }.to_string_lossy();
        if let Some(refusal) = ptx_refusal(&text, d.config.cuda_version as i32) {
            return Err(refusal);
        }
        let h = state.modules.insert(Module {
            ctx,
            image: kind,
            loaded_bytes: 0,
        });
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(module, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        d.unload_module(&mut state, module)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let m = state.modules.get(module).ok_or(CudaError::InvalidHandle)?;
        if name.is_null() || function.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: a NUL-terminated name per the API contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| CudaError::NotFound)?;
        if !m.image.declares(name) {
            return Err(CudaError::NotFound);
        }
        let h = state.functions.insert(Function {
            duration: KernelDuration::from_function_name(name),
            module,
        });
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(function, h) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptx(version: &str, target: &str) -> String {
        format!(
            "// a comment .version 99.9\n.version {version}\n.target {target}\n.address_size 64\n"
        )
    }

    #[test]
    fn headers_are_read_like_the_jit_reads_them() {
        let table = [
            (ptx("7.0", "sm_52"), Some(((7, 0), 52))),
            (
                ptx("8.8", "sm_90a, texmode_independent"),
                Some(((8, 8), 90)),
            ),
            (ptx("9.0", "sm_100f"), Some(((9, 0), 100))),
            (ptx("7", "sm_75"), None),
            (ptx("7.x", "sm_75"), None),
            (ptx("7.0", "compute_75"), None),
            (ptx("7.0", "sm_"), None),
            (".versionx 7.0\n.target sm_75\n".to_string(), None),
            (".target sm_75\n".to_string(), None),
        ];
        for (text, want) in table {
            let want = want.map(|(isa, target_sm)| PtxHeader { isa, target_sm });
            assert_eq!(ptx_header(&text), want, "{text}");
        }
    }

    #[test]
    fn each_driver_refuses_what_its_release_cannot_compile() {
        use CudaError::{InvalidPtx, UnsupportedPtxVersion};
        let table = [
            // (driver, .version, .target, refusal)
            (12080, "7.0", "sm_52", None),
            (13000, "7.0", "sm_52", Some(InvalidPtx)),
            (13000, "7.0", "sm_70", Some(InvalidPtx)),
            (13000, "7.0", "sm_75", None),
            (13000, "9.0", "sm_75", None),
            (13000, "9.1", "sm_75", Some(UnsupportedPtxVersion)),
            (13010, "9.1", "sm_90a", None),
            (12000, "8.0", "sm_75", None),
            (12000, "8.1", "sm_75", Some(UnsupportedPtxVersion)),
            (12000, "7.8", "sm_35", Some(InvalidPtx)),
            (12050, "8.5", "sm_75", None),
            (12060, "8.5", "sm_75", None),
            (12060, "8.6", "sm_75", Some(UnsupportedPtxVersion)),
            (12080, "8.7", "sm_75", None),
            (12080, "8.8", "sm_75", Some(UnsupportedPtxVersion)),
            (12090, "8.8", "sm_75", None),
            (11080, "7.8", "sm_35", None),
            (11080, "8.0", "sm_75", Some(UnsupportedPtxVersion)),
        ];
        for (driver, version, target, want) in table {
            assert_eq!(
                ptx_refusal(&ptx(version, target), driver),
                want,
                "driver {driver}, .version {version}, .target {target}"
            );
        }
    }

    #[test]
    fn the_test_kernels_load_on_every_driver_from_cuda_12_0_to_13_x() {
        let trace = include_str!("../../../ptx/trace.ptx");
        for driver in [12000, 12040, 12080, 12090, 13000, 13010, 13020] {
            for (name, ptx) in [("spin", simgpu_model::kernel::SPIN_PTX), ("trace", trace)] {
                assert_eq!(
                    ptx_refusal(ptx, driver),
                    None,
                    "{name}.ptx on CUDA {driver}"
                );
            }
        }
    }
}
