//! How a synchronisation waits, as the real driver decides it: on the CPU (spinning or
//! yielding) under the default `CU_CTX_SCHED_AUTO`, asleep for an event created with
//! `CU_EVENT_BLOCKING_SYNC` or in a context made with `CU_CTX_SCHED_BLOCKING_SYNC`. An
//! interposer that waits for a process's work must pick the sleeping kind, or it burns a core
//! for as long as the work runs. Measured with the waiting thread's own CPU time and
//! voluntary context switches (a thread that sleeps switches voluntarily; one that spins or
//! yields never does, however little CPU a loaded machine lets it have).

mod common;
use common::{Launch, Lib, Sim, P0, P1, P2, P3};
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;
use std::time::{Duration, Instant};

const CTX_SCHED_BLOCKING_SYNC: c_uint = 0x4;
const EVENT_BLOCKING_SYNC: c_uint = 0x1;
const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// Long enough that a spinning wait's CPU time stands far above a sleeping one's.
const KERNEL: &str = "sleep_400ms";

/// What a wait cost the waiting thread.
#[derive(Debug, Clone, Copy)]
struct Cost {
    /// User + system CPU time.
    cpu: Duration,
    /// Times it gave up the CPU to sleep.
    sleeps: i64,
    wall: Duration,
}

/// The calling thread's CPU time (user + system) and voluntary context switches.
fn thread_usage() -> (Duration, i64) {
    // SAFETY: getrusage fills the live struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (time(usage.ru_utime) + time(usage.ru_stime), usage.ru_nvcsw)
}

/// What `wait` cost.
fn measure(wait: impl FnOnce() -> c_int) -> Cost {
    let ((cpu, sleeps), wall) = (thread_usage(), Instant::now());
    assert_eq!(wait(), 0);
    let (cpu_after, sleeps_after) = thread_usage();
    Cost {
        cpu: cpu_after - cpu,
        sleeps: sleeps_after - sleeps,
        wall: wall.elapsed(),
    }
}

struct Context<'l> {
    lib: &'l Lib,
    kernel: usize,
}

impl Context<'_> {
    /// A context with `flags`, current on this thread, with the test kernel loaded.
    fn new(lib: &Lib, flags: c_uint) -> Context<'_> {
        let image = CString::new(simgpu_model::kernel::ptx_with_entries(&[KERNEL])).unwrap();
        let name = CString::new(KERNEL).unwrap();
        let (mut ctx, mut module, mut kernel) = (0usize, 0usize, 0usize);
        // SAFETY: live out-pointers of the types cuda.h specifies; NUL-terminated image and name.
        unsafe {
            assert_eq!(
                lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut ctx, flags, 0),
                0
            );
            assert_eq!(
                lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                    &mut module,
                    image.as_ptr().cast()
                ),
                0
            );
            assert_eq!(
                lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
                    &mut kernel,
                    module,
                    name.as_ptr()
                ),
                0
            );
        }
        Context { lib, kernel }
    }

    fn launch(&self) {
        let null = std::ptr::null_mut();
        // SAFETY: a kernel without parameters on the legacy stream.
        let rc = unsafe {
            self.lib.f::<Launch>("cuLaunchKernel")(self.kernel, 1, 1, 1, 32, 1, 1, 0, 0, null, null)
        };
        assert_eq!(rc, 0);
    }

    /// A kernel, then an event recorded after it with `flags`, waited for.
    fn event_wait(&self, flags: c_uint) -> Cost {
        let mut event = 0usize;
        // SAFETY: live out-pointer; plain handles.
        unsafe {
            assert_eq!(
                self.lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut event, flags),
                0
            );
            self.launch();
            assert_eq!(self.lib.f::<P2<usize, usize>>("cuEventRecord")(event, 0), 0);
        }
        // SAFETY: a recorded event.
        measure(|| unsafe { self.lib.f::<P1<usize>>("cuEventSynchronize")(event) })
    }

    /// A kernel, then cuCtxSynchronize.
    fn context_wait(&self) -> Cost {
        self.launch();
        // SAFETY: no arguments.
        measure(|| unsafe { self.lib.f::<P0>("cuCtxSynchronize")() })
    }

    /// A kernel, then cuStreamSynchronize of the legacy stream.
    fn stream_wait(&self) -> Cost {
        self.launch();
        // SAFETY: the legacy stream.
        measure(|| unsafe { self.lib.f::<P1<usize>>("cuStreamSynchronize")(0) })
    }
}

#[test]
fn synchronisation_spins_unless_the_event_or_the_context_asks_to_block() {
    let sim = Sim::new(&[
        ("SIMGPU_GPUS", "1"),
        ("SIMGPU_CONTEXT_MEMORY", "0"),
        ("SIMGPU_MODULE_MEMORY", "0"),
    ]);
    let lib = Lib::open(&sim);
    // SAFETY: plain flags.
    assert_eq!(unsafe { lib.f::<P1<c_uint>>("cuInit")(0) }, 0);
    let auto = Context::new(&lib, 0);
    let spinning = [
        ("default event", auto.event_wait(0)),
        (
            "CU_EVENT_DISABLE_TIMING event",
            auto.event_wait(EVENT_DISABLE_TIMING),
        ),
        ("cuCtxSynchronize", auto.context_wait()),
        ("cuStreamSynchronize", auto.stream_wait()),
    ];
    let blocking = [
        (
            "CU_EVENT_BLOCKING_SYNC event",
            auto.event_wait(EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING),
        ),
        ("blocking-sync context: default event", {
            let blocking = Context::new(&lib, CTX_SCHED_BLOCKING_SYNC);
            blocking.event_wait(0)
        }),
        ("blocking-sync context: cuCtxSynchronize", {
            let blocking = Context::new(&lib, CTX_SCHED_BLOCKING_SYNC);
            blocking.context_wait()
        }),
        ("blocking-sync context: cuStreamSynchronize", {
            let blocking = Context::new(&lib, CTX_SCHED_BLOCKING_SYNC);
            blocking.stream_wait()
        }),
    ];
    for (what, cost) in blocking {
        eprintln!("{what}: {cost:?}");
        // Asleep: a blocked waiter costs next to nothing (30 % leaves room for a loaded
        // machine's accounting; a spinning wait costs all of the wall time it gets).
        assert!(
            cost.cpu.as_secs_f64() < 0.3 * cost.wall.as_secs_f64() && cost.sleeps > 0,
            "{what}: not asleep: {cost:?}"
        );
    }
    for (what, cost) in spinning {
        eprintln!("{what}: {cost:?}");
        // On the CPU (or runnable, yielding it) for the whole wait: it never sleeps. How
        // much CPU that gets depends on the machine's load; alone on a core, all of it.
        assert!(cost.sleeps == 0, "{what}: slept while waiting: {cost:?}");
    }
}
