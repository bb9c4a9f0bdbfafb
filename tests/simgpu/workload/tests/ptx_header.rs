//! PTX headers checked against the driver version, as a real driver's JIT checks them: a CUDA
//! 13 driver refuses targets its release dropped (below sm_75) and any driver refuses a PTX ISA
//! newer than its own. The portable spin kernel must load on every driver gpushare meets.

mod common;
use common::{Lib, Sim, P1, P2};
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;

const INVALID_PTX: c_int = 218;
const UNSUPPORTED_PTX_VERSION: c_int = 222;

#[test]
fn a_cuda_13_driver_refuses_old_targets_and_newer_ptx_isas() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_CUDA_VERSION", "13000")]);
    let lib = Lib::open(&sim);
    // SAFETY: every call passes live out-pointers of the types cuda.h specifies.
    unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        let mut ctx = 0usize;
        assert_eq!(
            lib.f::<P2<*mut usize, c_int>>("cuDevicePrimaryCtxRetain")(&mut ctx, 0),
            0
        );
        assert_eq!(lib.f::<P1<usize>>("cuCtxSetCurrent")(ctx), 0);
        let load = |image: &str| {
            let image = CString::new(image).unwrap();
            let mut module = 0usize;
            lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast(),
            )
        };
        let kernel = ".visible .entry k()\n{\n\tret;\n}\n";
        let with = |version: &str, target: &str| {
            format!(".version {version}\n.target {target}\n.address_size 64\n{kernel}")
        };
        assert_eq!(
            load(&with("7.0", "sm_52")),
            INVALID_PTX,
            "Maxwell: dropped in 13.0"
        );
        assert_eq!(
            load(&with("7.0", "sm_70")),
            INVALID_PTX,
            "Volta: dropped in 13.0"
        );
        assert_eq!(
            load(&with("9.1", "sm_90")),
            UNSUPPORTED_PTX_VERSION,
            "ISA of 13.1"
        );
        assert_eq!(load(&with("9.0", "sm_90")), 0);
        assert_eq!(load(&with("7.0", "sm_75")), 0);
        assert_eq!(load(simgpu_model::kernel::SPIN_PTX), 0, "the spin kernel");
    }
}

#[test]
fn the_workload_runs_its_spin_kernel_on_a_cuda_13_driver() {
    for cuda in ["12080", "13000", "13010"] {
        let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_CUDA_VERSION", cuda)]);
        let out = sim
            .workload(&[
                "--kernel",
                "fixed:100us",
                "--kernels",
                "2",
                "--iterations",
                "2",
            ])
            .output()
            .expect("spawn simgpu-workload");
        assert!(
            out.status.success(),
            "CUDA {cuda}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
