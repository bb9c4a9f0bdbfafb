//! Launch wrappers: the gate, the driver, and the gate again (a launch under the
//! launch-ahead bound records its completion). Nothing else happens here — this is
//! the hot path (no allocation, lock, logging or system call while the token is held
//! without a bound).

use libc::{c_int, c_uint, c_void};

use super::real_fn;
use crate::cuda::*;
use crate::gate::estimate::What;
use crate::gate::{self, Target};

type Params = *mut *mut c_void;

/// Defines a gated wrapper:
/// `name(per_thread_default_stream, stream expression, kernel; arg: type, ...)`.
macro_rules! gated {
    ($(#[$doc:meta])* $name:ident ($per_thread:expr, $stream:expr, $kernel:expr; $($arg:ident : $ty:ty),*)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn($($ty),*) -> CUresult);
                let ticket = gate::admit(
                    Target { stream: $stream, per_thread: $per_thread },
                    What::Kernel($kernel),
                );
                // SAFETY: the caller's arguments, forwarded unchanged.
                let result = unsafe { real($($arg),*) };
                gate::launched(ticket, result);
                result
            })
        }
    };
}

/// The stream of a `CUlaunchConfig` (a null config is the driver's to refuse).
fn config_stream(config: *const LaunchConfig) -> Handle {
    if config.is_null() {
        0
    } else {
        // SAFETY: a non-null config the caller passes to the driver, which reads it too.
        unsafe { (*config).stream }
    }
}

gated!(cuLaunchKernel(false, stream, f; f: Handle, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
    block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint, stream: Handle,
    params: Params, extra: Params));
gated!(cuLaunchKernel_ptsz(true, stream, f; f: Handle, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
    block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint, stream: Handle,
    params: Params, extra: Params));
gated!(cuLaunchKernelEx(false, config_stream(config), f; config: *const LaunchConfig, f: Handle,
    params: Params, extra: Params));
gated!(cuLaunchKernelEx_ptsz(true, config_stream(config), f; config: *const LaunchConfig, f: Handle,
    params: Params, extra: Params));
gated!(cuLaunchCooperativeKernel(false, stream, f; f: Handle, grid_x: c_uint, grid_y: c_uint,
    grid_z: c_uint, block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint,
    stream: Handle, params: Params));
gated!(cuLaunchCooperativeKernel_ptsz(true, stream, f; f: Handle, grid_x: c_uint,
    grid_y: c_uint, grid_z: c_uint, block_x: c_uint, block_y: c_uint, block_z: c_uint,
    shared_mem: c_uint, stream: Handle, params: Params));
/// Defines a gated graph launch: a graph with memory nodes reserves its memory from
/// the device's graph pool at launch, which no allocation wrapper sees. The pool's
/// growth for a graph whose needs instantiation read (`graph_memory`) is charged
/// before the launch, refused over the quota; the pool is settled against the ledger
/// afterwards — for other graphs at most every [`GRAPH_SETTLE_NS`], so a
/// program launching graphs back to back takes the accounts' lock ten times a second,
/// not per launch (the arbiter's reconciliation with NVML covers the gap).
macro_rules! gated_graph {
    ($name:ident ($per_thread:expr)) => {
        /// Graphs are gated when launched; the launches captured into them ran nothing.
        ///
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(exec: Handle, stream: Handle) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(Handle, Handle) -> CUresult);
                // Memory nodes reserve their memory inside the launch: charged first.
                let memory_nodes = crate::graph_memory::needs(exec);
                if let Some(needed) = memory_nodes {
                    let rc = crate::graph_memory::reserve_before_launch(needed);
                    if rc != CUDA_SUCCESS {
                        return rc;
                    }
                }
                let ticket = gate::admit(
                    Target { stream, per_thread: $per_thread },
                    What::Graph(exec),
                );
                // SAFETY: the caller's arguments, forwarded unchanged.
                let result = unsafe { real(exec, stream) };
                gate::launched(ticket, result);
                if memory_nodes.is_some() {
                    // The charge made before becomes the pool's real size at once.
                    settle_graph_memory_now();
                } else if result == CUDA_SUCCESS {
                    settle_graph_memory();
                }
                result
            })
        }
    };
}

/// How often graph launches settle the graph memory pool at most.
const GRAPH_SETTLE_NS: u64 = 100_000_000;
static LAST_GRAPH_SETTLE_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[inline(always)]
fn settle_graph_memory() {
    use std::sync::atomic::Ordering::Relaxed;
    let now = gate::monotonic_ns();
    let last = LAST_GRAPH_SETTLE_NS.load(Relaxed);
    if now.saturating_sub(last) >= GRAPH_SETTLE_NS
        && LAST_GRAPH_SETTLE_NS
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
    {
        settle_graph_memory_now();
    }
}

#[cold]
#[inline(never)]
fn settle_graph_memory_now() {
    if crate::config::is_active() {
        crate::accounts::graph_launched();
    }
}

gated_graph!(cuGraphLaunch(false));
gated_graph!(cuGraphLaunch_ptsz(true));
gated!(
    /// Pre-4.0 launch API (block shape and parameters set beforehand), on stream 0.
    cuLaunch(false, 0, f; f: Handle));
gated!(cuLaunchGrid(false, 0, f; f: Handle, grid_width: c_int, grid_height: c_int));
gated!(cuLaunchGridAsync(false, stream, f; f: Handle, grid_width: c_int, grid_height: c_int,
    stream: Handle));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::{record_real, Hook};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SEEN: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn legacy(f: Handle) -> CUresult {
        SEEN.store(f, Ordering::SeqCst);
        7
    }
    extern "C" fn grid(f: Handle, w: c_int, h: c_int) -> CUresult {
        SEEN.store(f + (w * 10 + h) as usize, Ordering::SeqCst);
        8
    }
    extern "C" fn grid_async(f: Handle, w: c_int, h: c_int, stream: Handle) -> CUresult {
        SEEN.store(f + (w * 10 + h) as usize + stream, Ordering::SeqCst);
        9
    }
    extern "C" fn graph(exec: Handle, stream: Handle) -> CUresult {
        SEEN.store(exec * 100 + stream, Ordering::SeqCst);
        10
    }
    extern "C" fn ex(config: *const LaunchConfig, f: Handle, _: Params, _: Params) -> CUresult {
        // SAFETY: the test passes a valid config.
        SEEN.store(f + unsafe { (*config).stream }, Ordering::SeqCst);
        11
    }
    extern "C" fn coop(
        f: Handle,
        gx: c_uint,
        _: c_uint,
        _: c_uint,
        bx: c_uint,
        _: c_uint,
        _: c_uint,
        _: c_uint,
        stream: Handle,
        _: Params,
    ) -> CUresult {
        SEEN.store(
            f + gx as usize * 10 + bx as usize + stream,
            Ordering::SeqCst,
        );
        12
    }

    /// Each gated wrapper reaches the driver function of its own variant with the
    /// caller's arguments and returns its answer (the ABI is the declared one).
    #[test]
    #[allow(clippy::fn_to_numeric_cast_any)]
    fn every_gated_wrapper_forwards_its_arguments() {
        let p = |f: *const ()| f as *mut c_void;
        record_real(Hook::cuLaunch, p(legacy as *const ()));
        record_real(Hook::cuLaunchGrid, p(grid as *const ()));
        record_real(Hook::cuLaunchGridAsync, p(grid_async as *const ()));
        record_real(Hook::cuGraphLaunch, p(graph as *const ()));
        record_real(Hook::cuGraphLaunch_ptsz, p(graph as *const ()));
        record_real(Hook::cuLaunchKernelEx, p(ex as *const ()));
        record_real(Hook::cuLaunchKernelEx_ptsz, p(ex as *const ()));
        record_real(Hook::cuLaunchCooperativeKernel, p(coop as *const ()));
        record_real(Hook::cuLaunchCooperativeKernel_ptsz, p(coop as *const ()));
        let null: Params = std::ptr::null_mut();
        let config = LaunchConfig {
            grid_dim: [1; 3],
            block_dim: [1; 3],
            shared_mem_bytes: 0,
            stream: 5,
            attrs: std::ptr::null_mut(),
            num_attrs: 0,
        };
        // SAFETY: every stub ignores or checks its pointers.
        unsafe {
            assert_eq!((cuLaunch(1000), SEEN.load(Ordering::SeqCst)), (7, 1000));
            assert_eq!(
                (cuLaunchGrid(1000, 2, 3), SEEN.load(Ordering::SeqCst)),
                (8, 1023)
            );
            assert_eq!(
                (
                    cuLaunchGridAsync(1000, 2, 3, 4),
                    SEEN.load(Ordering::SeqCst)
                ),
                (9, 1027)
            );
            assert_eq!(
                (cuGraphLaunch(3, 4), SEEN.load(Ordering::SeqCst)),
                (10, 304)
            );
            assert_eq!(
                (cuGraphLaunch_ptsz(4, 5), SEEN.load(Ordering::SeqCst)),
                (10, 405)
            );
            assert_eq!(
                (
                    cuLaunchKernelEx(&config, 1000, null, null),
                    SEEN.load(Ordering::SeqCst)
                ),
                (11, 1005)
            );
            assert_eq!(
                (
                    cuLaunchKernelEx_ptsz(&config, 2000, null, null),
                    SEEN.load(Ordering::SeqCst)
                ),
                (11, 2005)
            );
            assert_eq!(
                (
                    cuLaunchCooperativeKernel(1000, 2, 1, 1, 3, 1, 1, 0, 4, null),
                    SEEN.load(Ordering::SeqCst)
                ),
                (12, 1027)
            );
            assert_eq!(
                (
                    cuLaunchCooperativeKernel_ptsz(2000, 2, 1, 1, 3, 1, 1, 0, 4, null),
                    SEEN.load(Ordering::SeqCst)
                ),
                (12, 2027)
            );
        }
    }
}
