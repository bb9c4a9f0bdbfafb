//! Where the process's GPU work goes — its contexts, the streams it created, the
//! stream captures under way — so the agent can wait for that work without ever
//! conflicting with a capture, and without spinning a core while it waits.
//!
//! Why this exists: the obvious drain, `cuCtxSynchronize`, is illegal while any stream
//! of the context is being captured into a CUDA graph. The driver answers
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` *and invalidates the capture* (CUDA
//! Programming Guide, "Stream Capture": a context-wide synchronisation necessarily
//! conflicts with it), which is what broke graph-capturing programs (vLLM,
//! `torch.compile(mode="reduce-overhead")`, llama.cpp) under other interposers. It also
//! spins: under the default `CU_CTX_SCHED_AUTO` every synchronisation keeps the calling
//! thread on a core until the work is done, seconds per drain beside long kernels.
//! So the drain waits on events of its own, created with `CU_EVENT_BLOCKING_SYNC`
//! (`cuEventSynchronize` sleeps on them), one per stream:
//!
//! * every registered stream (created through a wrapper, registered by another creation
//!   wrapper such as a green context's, or first seen by a bounded launch) gets the
//!   agent's event, and each context's legacy stream gets one, which covers the blocking
//!   streams and every thread's per-thread default stream (they all synchronise with
//!   it); all are recorded before the first wait, in the stream's context;
//! * a stream in a capture never gets one: an event recorded there would be a node of
//!   the capture, and waiting for it fails and invalidates the capture in every mode.
//!   Captures begun through the wrappers are listed ([`Work::capture_begins`],
//!   [`Work::capture_ended`]) *before* the driver sees them; a stream that *joined* a
//!   capture (`cuStreamWaitEvent` on an event recorded in a capturing stream: torch's
//!   `wait_stream`, DDP overlap, MoE side streams) passed no wrapper, so the driver is
//!   asked (`cuStreamIsCapturing`) before the record, and again after it: a stream that
//!   joined in between is not waited for;
//! * the legacy stream of a context with a capture under way is left alone: it
//!   encompasses every blocking stream of the context, any of which may join the capture
//!   between a look and a record, and then work on the legacy stream invalidates it
//!   (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`). So during a capture, work another thread
//!   queued on the legacy stream or its own per-thread default stream (reachable only
//!   through the legacy stream from the agent's thread) is not waited for: a revoked
//!   holder may release while such work still runs, for as long as the capture lasts;
//! * every drain runs inside [`Work::exclusive`], a two-flag handshake (each side stores
//!   its own flag, then reads the other's, all SeqCst): a capture that begins while a
//!   drain runs waits for the drain to end, and a drain sees every capture that could
//!   already be under way — so it never records its event into a stream that started
//!   capturing after it looked;
//! * the agent's thread is in RELAXED capture mode (GLOBAL mode would make even its
//!   event waits invalidate another thread's capture).
//!
//! A stream the process never registered (created before the library armed, and never
//! launched into while bounded) is reached only through the legacy stream, so only if it
//! is blocking. Every registration happens in a wrapped creation call or on the gate's
//! cold path; nothing here is on the launch hot path.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU32, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpushare_proto::token_client::{futex_wait, futex_wake};

use super::ahead::Ring;
use crate::cuda::{CUdevice, Handle, CUDA_SUCCESS};

/// How long a beginning capture sleeps between looks at a drain in
/// progress (it is woken when that ends; this only bounds a missed wake).
const CAPTURE_WAIT_SLICE: Duration = Duration::from_millis(10);

/// A context the process created or retained.
#[derive(Debug)]
pub struct ContextEntry {
    pub handle: Handle,
    /// The device whose primary context this is (None: a created context).
    pub primary_of: Option<CUdevice>,
    /// The launch-ahead ring of the context's legacy default stream.
    pub legacy_ring: Mutex<Ring>,
    /// The agent's completion event in this context (0: not created yet).
    drain_event: AtomicUsize,
}

/// A stream the process created.
#[derive(Debug)]
pub struct StreamEntry {
    pub handle: Handle,
    pub context: Handle,
    /// `CU_STREAM_NON_BLOCKING`: does not synchronise with the legacy stream.
    pub non_blocking: bool,
    pub ring: Mutex<Ring>,
    drain_event: AtomicUsize,
}

/// A capture under way, begun through a wrapped entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Capture {
    /// The stream as the caller named it, with the thread for per-thread default
    /// streams (whose handle means a different stream in every thread).
    stream: Handle,
    thread: Option<libc::pthread_t>,
    context: Handle,
}

/// One process's record of its work (a fork child starts a new one with its client).
#[derive(Debug, Default)]
pub struct Work {
    contexts: Mutex<Vec<Arc<ContextEntry>>>,
    streams: Mutex<Vec<Arc<StreamEntry>>>,
    captures: Mutex<Vec<Capture>>,
    /// Captures begun (or beginning) and not ended: the handshake's capture side.
    capturing: AtomicU32,
    /// 1 while the agent drains: the handshake's other side, and a futex word a
    /// beginning capture waits on.
    draining: AtomicU32,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a drain went, for the agent's log and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Drained {
    /// Streams (legacy streams included) whose work was waited for.
    pub streams: usize,
    /// Streams left alone: capturing, beside a capture, or unreachable.
    pub skipped: usize,
}

impl Work {
    pub fn new() -> Work {
        Work::default()
    }

    // ----- contexts -----

    /// A context was created, or a primary context retained (repeats are ignored).
    pub fn context_created(&self, handle: Handle, primary_of: Option<CUdevice>) {
        if handle == 0 {
            return;
        }
        let mut contexts = lock(&self.contexts);
        if contexts.iter().any(|c| c.handle == handle) {
            return;
        }
        contexts.push(Arc::new(ContextEntry {
            handle,
            primary_of,
            legacy_ring: Mutex::new(Ring::new()),
            drain_event: AtomicUsize::new(0),
        }));
    }

    /// A context seen current on a launching thread (programs whose context came from
    /// somewhere the wrappers did not see, e.g. created before the library armed).
    pub fn context_seen(&self, handle: Handle) {
        self.context_created(handle, None);
    }

    /// A context was destroyed: forget it, its streams (their handles may be reused) and
    /// the captures in it (a destroyed context ends them; a count left behind would keep
    /// the process "capturing", never idle, for good).
    pub fn context_destroyed(&self, handle: Handle) {
        lock(&self.contexts).retain(|c| c.handle != handle);
        lock(&self.streams).retain(|s| s.context != handle);
        self.forget_captures(|c| c.context == handle);
    }

    /// `device`'s primary context was released or reset; `still_active` is the
    /// driver's answer afterwards (a reset always destroys it).
    pub fn primary_released(&self, device: CUdevice, still_active: bool) {
        if still_active {
            return;
        }
        let gone: Vec<Handle> = lock(&self.contexts)
            .iter()
            .filter(|c| c.primary_of == Some(device))
            .map(|c| c.handle)
            .collect();
        for handle in gone {
            self.context_destroyed(handle);
        }
    }

    pub fn contexts(&self) -> Vec<Arc<ContextEntry>> {
        lock(&self.contexts).clone()
    }

    pub fn context(&self, handle: Handle) -> Option<Arc<ContextEntry>> {
        lock(&self.contexts)
            .iter()
            .find(|c| c.handle == handle)
            .cloned()
    }

    // ----- streams -----

    pub fn stream_created(&self, handle: Handle, context: Handle, flags: libc::c_uint) {
        if handle == 0 {
            return;
        }
        let mut streams = lock(&self.streams);
        streams.retain(|s| s.handle != handle);
        streams.push(Arc::new(StreamEntry {
            handle,
            context,
            non_blocking: flags & crate::driver::CU_STREAM_NON_BLOCKING != 0,
            ring: Mutex::new(Ring::new()),
            drain_event: AtomicUsize::new(0),
        }));
        drop(streams);
        self.context_seen(context);
    }

    /// A stream was destroyed: forget it and a capture it had under way.
    pub fn stream_destroyed(&self, handle: Handle) {
        lock(&self.streams).retain(|s| s.handle != handle);
        self.forget_captures(|c| c.thread.is_none() && c.stream == handle);
    }

    fn forget_captures(&self, gone: impl Fn(&Capture) -> bool) {
        let mut captures = lock(&self.captures);
        let before = captures.len();
        captures.retain(|c| !gone(c));
        let forgotten = (before - captures.len()) as u32;
        if forgotten > 0 {
            self.capturing.fetch_sub(forgotten, SeqCst);
        }
    }

    /// The entry of a created stream; one the wrappers did not see is registered now
    /// (its context asked of the driver).
    pub fn stream(&self, handle: Handle) -> Option<Arc<StreamEntry>> {
        if let Some(found) = lock(&self.streams).iter().find(|s| s.handle == handle) {
            return Some(found.clone());
        }
        let context = crate::driver::stream_context(handle)?;
        // Flags unknown: count it as blocking, the careful choice for the legacy rule.
        self.stream_created(handle, context, 0);
        lock(&self.streams)
            .iter()
            .find(|s| s.handle == handle)
            .cloned()
    }

    pub fn streams(&self) -> Vec<Arc<StreamEntry>> {
        lock(&self.streams).clone()
    }

    // ----- captures -----

    /// Captures under way (begun through a wrapper and not ended).
    pub fn captures_under_way(&self) -> u32 {
        self.capturing.load(SeqCst)
    }

    /// Before the real `cuStreamBeginCapture*`: lists the capture, then waits for a drain
    /// in progress (which could otherwise record into this stream or its context's
    /// legacy stream after the capture began). Listing first is what lets a drain that starts
    /// now see this capture even before the driver has begun it.
    pub fn capture_begins(&self, stream: Handle, per_thread: bool) {
        let capture = self.capture_of(stream, per_thread);
        lock(&self.captures).push(capture);
        self.capturing.fetch_add(1, SeqCst);
        while self.draining.load(SeqCst) != 0 {
            futex_wait(&self.draining, 1, CAPTURE_WAIT_SLICE);
        }
    }

    /// After the real `cuStreamBeginCapture*`: a capture the driver refused to begin is
    /// unlisted.
    pub fn capture_begun(&self, stream: Handle, per_thread: bool, result: crate::cuda::CUresult) {
        if result != CUDA_SUCCESS {
            self.capture_ended(stream, per_thread);
        }
    }

    /// After the real `cuStreamEndCapture*`, whatever it answered: an invalidated
    /// capture ends there too.
    pub fn capture_ended(&self, stream: Handle, per_thread: bool) {
        let (key, thread) = capture_key(stream, per_thread);
        let mut captures = lock(&self.captures);
        if let Some(at) = captures
            .iter()
            .position(|c| c.stream == key && c.thread == thread)
        {
            captures.remove(at);
            self.capturing.fetch_sub(1, SeqCst);
        }
    }

    fn capture_of(&self, stream: Handle, per_thread: bool) -> Capture {
        let (key, thread) = capture_key(stream, per_thread);
        let entry = thread.is_none().then(|| self.stream(key)).flatten();
        let context = entry
            .as_ref()
            .map_or_else(crate::driver::current_context, |s| s.context);
        Capture {
            stream: key,
            thread,
            context,
        }
    }

    fn capturing_stream(&self, handle: Handle) -> bool {
        lock(&self.captures)
            .iter()
            .any(|c| c.thread.is_none() && c.stream == handle)
    }

    /// Runs `drain` with no capture able to begin meanwhile; `drain` is told whether
    /// captures are (or may be) under way. A capture beginning in the meantime waits.
    pub fn exclusive<R>(&self, drain: impl FnOnce(bool) -> R) -> R {
        self.draining.store(1, SeqCst);
        let result = drain(self.capturing.load(SeqCst) != 0);
        self.draining.store(0, SeqCst);
        futex_wake(&self.draining);
        result
    }

    // ----- the drain -----

    /// Whether a capture begun through a wrapper is under way in `context`.
    fn capture_in(&self, context: Handle) -> bool {
        lock(&self.captures).iter().any(|c| c.context == context)
    }

    /// Waits for the work this process submitted, stream by stream, around the captures
    /// under way (see the module's doc): an event recorded on every registered stream
    /// that is not capturing and on each context's legacy stream, then each waited for.
    /// The calling thread must be in RELAXED capture mode (the agent sets it once).
    pub fn drain(&self, driver: &impl DrainDriver) -> Drained {
        self.exclusive(|_| {
            // Every event is recorded before the first wait: one snapshot of the work.
            let mut marked: Vec<Option<Handle>> = Vec::new();
            for stream in self.streams() {
                let reachable = !self.capturing_stream(stream.handle);
                marked.push(if reachable {
                    mark(driver, stream.context, stream.handle, &stream.drain_event)
                } else {
                    None
                });
            }
            for context in self.contexts() {
                // The legacy stream encompasses every blocking stream of its context, and
                // any of them may join the capture (cuStreamWaitEvent) between a look and
                // a record: work on the legacy stream would then invalidate the capture
                // (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). So it is left alone while a
                // capture is under way in its context.
                let reachable = !self.capture_in(context.handle);
                let legacy = crate::driver::CU_STREAM_LEGACY;
                marked.push(if reachable {
                    mark(driver, context.handle, legacy, &context.drain_event)
                } else {
                    None
                });
            }
            let mut drained = Drained::default();
            for event in marked {
                match event {
                    Some(event) if driver.wait(event) => drained.streams += 1,
                    _ => drained.skipped += 1,
                }
            }
            drained
        })
    }
}

/// Records the agent's event on `stream` (in `context`) if the driver says the stream is
/// not capturing, before and after the record, and returns the event to wait for. The
/// look before keeps the event out of a capture the wrappers never saw the stream join
/// (a `cuStreamWaitEvent` on an event recorded in a capturing stream: fork/join capture);
/// the look after catches a join between the look and the record, whose recorded event
/// may be a node of the capture: waiting for such an event fails and invalidates the
/// capture in every mode, so it is not waited for.
fn mark(
    driver: &impl DrainDriver,
    context: Handle,
    stream: Handle,
    event: &AtomicUsize,
) -> Option<Handle> {
    if !driver.make_current(context) || !driver.outside_captures(stream) {
        return None;
    }
    let mut handle = event.load(SeqCst);
    if handle == 0 {
        handle = driver.create_event()?;
        event.store(handle, SeqCst);
    }
    (driver.record(handle, stream) && driver.outside_captures(stream)).then_some(handle)
}

/// A capture's key: per-thread default streams are a different stream in each thread.
fn capture_key(stream: Handle, per_thread: bool) -> (Handle, Option<libc::pthread_t>) {
    let per_thread_default = stream == super::CU_STREAM_PER_THREAD || (per_thread && stream == 0);
    if per_thread_default {
        // SAFETY: pthread_self has no preconditions.
        (
            super::CU_STREAM_PER_THREAD,
            Some(unsafe { libc::pthread_self() }),
        )
    } else {
        (stream, None)
    }
}

/// The driver calls a drain makes (the real driver in the library, a recorder in tests).
pub trait DrainDriver {
    fn make_current(&self, context: Handle) -> bool;
    /// The driver says `stream` is in no capture (active or invalidated); an error (the
    /// legacy stream beside a capturing blocking stream answers one) counts as in one.
    fn outside_captures(&self, stream: Handle) -> bool;
    /// An event in the current context whose waiters sleep.
    fn create_event(&self) -> Option<Handle>;
    fn record(&self, event: Handle, stream: Handle) -> bool;
    fn wait(&self, event: Handle) -> bool;
}

/// The real driver.
pub struct Driver;

impl DrainDriver for Driver {
    fn make_current(&self, context: Handle) -> bool {
        crate::driver::current_context() == context || crate::driver::set_current_context(context)
    }
    fn outside_captures(&self, stream: Handle) -> bool {
        crate::driver::capture_status(stream) == Ok(crate::driver::CaptureStatus::None)
    }
    fn create_event(&self) -> Option<Handle> {
        crate::driver::create_blocking_event()
    }
    fn record(&self, event: Handle, stream: Handle) -> bool {
        crate::driver::record_event(event, stream)
    }
    fn wait(&self, event: Handle) -> bool {
        let rc = crate::driver::synchronize_event(event);
        if rc != Some(CUDA_SUCCESS) {
            crate::log_debug!("draining for the token: cuEventSynchronize answered {rc:?}");
        }
        rc == Some(CUDA_SUCCESS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Records the drain's calls; the driver's capture answers are the test's.
    #[derive(Default)]
    struct Recorder {
        log: RefCell<Vec<String>>,
        next_event: RefCell<Handle>,
        /// Streams the driver says are capturing (joined where no wrapper saw it).
        capturing: RefCell<Vec<Handle>>,
        /// Streams that join a capture just as the drain's event is recorded into them.
        join_at_record: Vec<Handle>,
    }

    impl DrainDriver for Recorder {
        fn make_current(&self, context: Handle) -> bool {
            self.log.borrow_mut().push(format!("current {context}"));
            true
        }
        fn outside_captures(&self, stream: Handle) -> bool {
            !self.capturing.borrow().contains(&stream)
        }
        fn create_event(&self) -> Option<Handle> {
            *self.next_event.borrow_mut() += 1;
            Some(100 + *self.next_event.borrow())
        }
        fn record(&self, event: Handle, stream: Handle) -> bool {
            self.log
                .borrow_mut()
                .push(format!("record {event} on {stream}"));
            if self.join_at_record.contains(&stream) {
                self.capturing.borrow_mut().push(stream);
            }
            true
        }
        fn wait(&self, event: Handle) -> bool {
            self.log.borrow_mut().push(format!("wait {event}"));
            true
        }
    }

    impl Recorder {
        fn log(&self) -> Vec<String> {
            self.log.borrow().clone()
        }
        /// The streams the drain recorded into, in order.
        fn recorded_on(&self) -> Vec<Handle> {
            self.log()
                .iter()
                .filter_map(|l| l.rsplit_once(" on ").map(|(_, s)| s.parse().unwrap()))
                .collect()
        }
    }

    const LEGACY: Handle = crate::driver::CU_STREAM_LEGACY;

    fn counts(streams: usize, skipped: usize) -> Drained {
        Drained { streams, skipped }
    }

    fn work_with_two_contexts_and_streams() -> Work {
        let work = Work::new();
        work.context_created(1, Some(0));
        work.context_created(2, None);
        work.stream_created(10, 1, crate::driver::CU_STREAM_NON_BLOCKING);
        work.stream_created(20, 2, 0);
        work
    }

    /// No context-wide synchronisation (it spins a core under CU_CTX_SCHED_AUTO): an
    /// event on every stream, each context's legacy stream included (it covers the
    /// blocking streams and every thread's per-thread default stream), all recorded
    /// before the first wait, each in its stream's context.
    #[test]
    fn without_captures_every_stream_and_every_legacy_stream_gets_an_event() {
        let work = work_with_two_contexts_and_streams();
        let driver = Recorder::default();
        let drained = work.drain(&driver);
        assert_eq!(
            driver.log(),
            [
                "current 1",
                "record 101 on 10",
                "current 2",
                "record 102 on 20",
                "current 1",
                "record 103 on 1",
                "current 2",
                "record 104 on 1",
                "wait 101",
                "wait 102",
                "wait 103",
                "wait 104",
            ],
            "every context, not only the first launching thread's"
        );
        assert_eq!(drained, counts(4, 0));
        // The events are made once and reused.
        let again = Recorder::default();
        work.drain(&again);
        assert_eq!(*again.next_event.borrow(), 0, "{:?}", again.log());
    }

    #[test]
    fn during_a_capture_the_capturing_stream_and_its_contexts_legacy_stream_are_left_alone() {
        let work = work_with_two_contexts_and_streams();
        // A non-blocking stream of context 1 captures.
        work.capture_begins(10, false);
        work.capture_begun(10, false, CUDA_SUCCESS);
        let driver = Recorder::default();
        *driver.capturing.borrow_mut() = vec![10];
        let drained = work.drain(&driver);
        // Stream 20 and context 2's legacy stream; context 1's legacy stream not, as a
        // blocking stream of context 1 may join the capture at any moment.
        assert_eq!(driver.recorded_on(), [20, LEGACY], "{:?}", driver.log());
        assert!(driver.log().contains(&"current 2".to_string()));
        assert!(
            !driver.log().contains(&"current 1".to_string()),
            "{:?}",
            driver.log()
        );
        assert_eq!(drained, counts(2, 2));
        // Ended (even invalidated): every stream again.
        work.capture_ended(10, false);
        assert_eq!(work.captures_under_way(), 0);
        let driver = Recorder::default();
        assert_eq!(work.drain(&driver).streams, 4);
    }

    /// A stream that joined a capture by waiting for an event recorded in it (fork/join
    /// capture: torch's `wait_stream`, side streams) passed no capture wrapper; the driver
    /// says it is capturing, and the drain leaves it alone: an event recorded there would
    /// be a node of the capture, and waiting for it would invalidate the capture.
    #[test]
    fn a_stream_that_joined_a_capture_is_left_alone() {
        let work = work_with_two_contexts_and_streams();
        work.stream_created(30, 1, 0);
        work.capture_begins(10, false);
        work.capture_begun(10, false, CUDA_SUCCESS);
        let driver = Recorder::default();
        *driver.capturing.borrow_mut() = vec![10, 30];
        let drained = work.drain(&driver);
        assert!(!driver.recorded_on().contains(&30), "{:?}", driver.log());
        assert_eq!(driver.recorded_on(), [20, LEGACY]);
        assert_eq!(drained.streams, 2);
    }

    /// A stream that joins between the drain's look and its record may have taken the
    /// event into the capture: it is not waited for.
    #[test]
    fn a_stream_that_joins_as_the_event_is_recorded_is_not_waited_for() {
        let work = work_with_two_contexts_and_streams();
        work.capture_begins(10, false);
        work.capture_begun(10, false, CUDA_SUCCESS);
        let driver = Recorder {
            capturing: RefCell::new(vec![10]),
            join_at_record: vec![20],
            ..Recorder::default()
        };
        let drained = work.drain(&driver);
        let log = driver.log();
        assert!(log.contains(&"record 101 on 20".to_string()), "{log:?}");
        assert!(!log.contains(&"wait 101".to_string()), "{log:?}");
        assert_eq!(drained, counts(1, 3));
    }

    /// A capture the wrappers never saw begin (an entry point they do not list) is still
    /// kept out of: the driver's answer decides, for the legacy stream too (it answers an
    /// error while a blocking stream of its context captures).
    #[test]
    fn the_drivers_answer_keeps_the_drain_out_of_captures_no_wrapper_saw() {
        let work = work_with_two_contexts_and_streams();
        let driver = Recorder::default();
        *driver.capturing.borrow_mut() = vec![20, LEGACY];
        let drained = work.drain(&driver);
        assert_eq!(driver.recorded_on(), [10], "{:?}", driver.log());
        assert_eq!(drained, counts(1, 3));
    }

    /// A stream of a green context (registered by its creation wrapper with the context
    /// `cuCtxFromGreenCtx` names; green-context streams are always non-blocking) gets its
    /// event in that context like any stream.
    #[test]
    fn a_registered_green_context_stream_is_drained_in_its_context() {
        let work = Work::new();
        work.context_created(1, Some(0));
        let green: Handle = 7;
        work.stream_created(70, green, crate::driver::CU_STREAM_NON_BLOCKING);
        let driver = Recorder::default();
        work.drain(&driver);
        let log = driver.log();
        let at = log
            .iter()
            .position(|l| l == "record 101 on 70")
            .expect("drained");
        assert_eq!(log[at - 1], format!("current {green}"), "{log:?}");
        assert!(log.contains(&"wait 101".to_string()), "{log:?}");
    }

    #[test]
    fn a_blocking_capture_keeps_the_drain_off_its_contexts_legacy_stream() {
        let work = work_with_two_contexts_and_streams();
        work.capture_begins(20, false);
        work.capture_begun(20, false, CUDA_SUCCESS);
        let driver = Recorder::default();
        work.drain(&driver);
        // Stream 10 and context 1's legacy stream only.
        assert_eq!(driver.recorded_on(), [10, LEGACY], "{:?}", driver.log());
    }

    #[test]
    fn a_refused_begin_is_not_counted_and_a_reset_primary_context_is_forgotten() {
        let work = work_with_two_contexts_and_streams();
        work.capture_begins(10, false);
        work.capture_begun(10, false, 900);
        assert_eq!(work.captures_under_way(), 0);
        work.primary_released(0, true);
        assert_eq!(work.contexts().len(), 2, "still retained elsewhere");
        work.primary_released(0, false);
        let left: Vec<Handle> = work.contexts().iter().map(|c| c.handle).collect();
        assert_eq!(left, [2]);
        assert!(work.streams().iter().all(|s| s.context != 1));
    }

    /// A drain driver whose event waits block until the test lets them go (it is used
    /// from another thread, so no RefCell).
    struct Gated {
        entered: std::sync::mpsc::SyncSender<()>,
        proceed: Mutex<std::sync::mpsc::Receiver<()>>,
        recorded_on: Mutex<Vec<Handle>>,
    }

    impl DrainDriver for Gated {
        fn make_current(&self, _: Handle) -> bool {
            true
        }
        fn outside_captures(&self, _: Handle) -> bool {
            true
        }
        fn create_event(&self) -> Option<Handle> {
            Some(1)
        }
        fn record(&self, _: Handle, stream: Handle) -> bool {
            self.recorded_on.lock().unwrap().push(stream);
            true
        }
        fn wait(&self, _: Handle) -> bool {
            let _ = self.entered.send(());
            let _ = self.proceed.lock().unwrap().recv();
            true
        }
    }

    /// Starts a drain of `work` on another thread and returns once it is inside its first
    /// wait; the returned sender lets every wait go.
    fn drain_in_background(
        work: &'static Work,
    ) -> (
        std::thread::JoinHandle<Drained>,
        std::sync::mpsc::Sender<()>,
        &'static Gated,
    ) {
        let (entered_tx, entered_rx) = std::sync::mpsc::sync_channel(16);
        let (proceed_tx, proceed_rx) = std::sync::mpsc::channel();
        let driver: &'static Gated = Box::leak(Box::new(Gated {
            entered: entered_tx,
            proceed: Mutex::new(proceed_rx),
            recorded_on: Mutex::new(Vec::new()),
        }));
        let draining = std::thread::spawn(move || work.drain(driver));
        entered_rx.recv().unwrap();
        (draining, proceed_tx, driver)
    }

    /// Begins a capture on another thread; the flag says when `capture_begins` returned.
    fn begin_in_background(
        work: &'static Work,
        stream: Handle,
    ) -> (
        std::thread::JoinHandle<()>,
        Arc<std::sync::atomic::AtomicBool>,
    ) {
        let begun = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = begun.clone();
        let thread = std::thread::spawn(move || {
            work.capture_begins(stream, false);
            flag.store(true, SeqCst);
        });
        (thread, begun)
    }

    #[test]
    fn a_capture_waits_for_a_drain_in_progress() {
        let work: &'static Work = Box::leak(Box::new(work_with_two_contexts_and_streams()));
        let (draining, proceed, _) = drain_in_background(work);
        let (capturing, begun) = begin_in_background(work, 10);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!begun.load(SeqCst), "a capture began during a drain");
        for _ in 0..4 {
            proceed.send(()).unwrap();
        }
        assert_eq!(draining.join().unwrap().streams, 4);
        capturing.join().unwrap();
        assert!(begun.load(SeqCst));
        // With a capture under way, the next drain knows.
        assert!(work.exclusive(|captures_under_way| captures_under_way));
    }

    /// The race a per-stream drain must not lose: a capture beginning on a stream the
    /// drain has not reached yet would receive the drain's event (and its wait would
    /// invalidate the capture). It waits until the drain is over instead.
    #[test]
    fn a_capture_waits_for_a_stream_by_stream_drain_too() {
        let work: &'static Work = Box::leak(Box::new(work_with_two_contexts_and_streams()));
        // Stream 10 captures: the drain records on 20 and context 2's legacy stream.
        work.capture_begins(10, false);
        work.capture_begun(10, false, CUDA_SUCCESS);
        let (draining, proceed, driver) = drain_in_background(work);
        // The drain waits on stream 20; meanwhile a capture begins on stream 30.
        work.stream_created(30, 2, 0);
        let (capturing, begun) = begin_in_background(work, 30);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!begun.load(SeqCst), "a capture began during a drain");
        for _ in 0..8 {
            let _ = proceed.send(());
        }
        let drained = draining.join().unwrap();
        capturing.join().unwrap();
        assert!(begun.load(SeqCst));
        assert_eq!(
            *driver.recorded_on.lock().unwrap(),
            [20, LEGACY],
            "recorded into a capturing stream or its context's legacy stream"
        );
        assert_eq!(drained.skipped, 2);
    }

    /// A capture listed by `capture_begins` whose driver call has not returned yet is
    /// already kept out of a drain, and one the driver refused is forgotten.
    #[test]
    fn a_beginning_capture_is_seen_by_a_drain_before_the_driver_has_begun_it() {
        let work = work_with_two_contexts_and_streams();
        work.capture_begins(20, false);
        let driver = Recorder::default();
        work.drain(&driver);
        // Not 20, nor context 2's legacy stream.
        assert_eq!(driver.recorded_on(), [10, LEGACY], "{:?}", driver.log());
        work.capture_begun(20, false, 900);
        assert_eq!(work.captures_under_way(), 0);
    }

    #[test]
    fn destroying_a_capturing_stream_or_its_context_ends_the_capture() {
        let work = work_with_two_contexts_and_streams();
        work.capture_begins(10, false);
        work.capture_begins(20, false);
        assert_eq!(work.captures_under_way(), 2);
        work.stream_destroyed(10);
        assert_eq!(work.captures_under_way(), 1);
        work.context_destroyed(2);
        assert_eq!(work.captures_under_way(), 0);
    }
}
