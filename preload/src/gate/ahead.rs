//! The launch-ahead bound: while the page says `launch_ahead = N > 0` (a low-priority
//! holder while a high-priority neighbour is active), at most N launches *per stream*
//! may be submitted and unfinished, so that a revoked holder drains in about one kernel
//! per stream.
//!
//! One completion-only event per launch, in a small ring per stream reused
//! round-robin; before a launch the stream's ring waits on its oldest events until
//! fewer than N are pending. Per stream, not per process: a process-wide bound made
//! every low-priority launch wait for the previous launch of *any* stream, which
//! serialised copy/compute overlap and could deadlock a program whose work on one
//! stream waits for a later launch on another (`cuStreamWaitValue32`, producer and
//! consumer kernels). Within one stream the order is the stream's own, so waiting for
//! its earlier launches cannot wait for anything that depends on the next one.

use crate::cuda::Handle;

/// The most launches the ring tracks; a larger `launch_ahead` is treated as this.
pub const RING: usize = 16;

/// The driver calls the ring makes (the real driver in the library, a fake in tests).
pub trait Events {
    /// The calling thread's context (events belong to one).
    fn current_context(&self) -> Handle;
    fn create(&self) -> Option<Handle>;
    fn record(&self, event: Handle, stream: Handle) -> bool;
    fn synchronize(&self, event: Handle);
    fn destroy(&self, event: Handle);
    /// Nanoseconds from `start` to `end` (both completed), if the driver can tell.
    fn elapsed_ns(&self, start: Handle, end: Handle) -> Option<u64>;
}

/// Where the ring's measurements go.
pub trait Learn {
    /// A launch of kind `key` ran `duration_ns`; it was admitted at `admitted_ns`
    /// against the window `fit_by_ns`.
    fn measured(&self, key: u64, duration_ns: u64, admitted_ns: u64, fit_by_ns: u64);
}

impl Learn for super::estimate::Estimates {
    fn measured(&self, key: u64, duration_ns: u64, admitted_ns: u64, fit_by_ns: u64) {
        let now = super::monotonic_ns();
        super::estimate::Estimates::measured(self, key, duration_ns, admitted_ns, fit_by_ns, now)
    }
}

/// Measurements nobody wants.
pub struct Forget;

impl Learn for Forget {
    fn measured(&self, _: u64, _: u64, _: u64, _: u64) {}
}

/// The real driver's events.
pub struct DriverEvents;

impl Events for DriverEvents {
    fn current_context(&self) -> Handle {
        crate::driver::current_context()
    }
    fn create(&self) -> Option<Handle> {
        // With timestamps: a launch's start and end events time it (`begin`).
        crate::driver::create_timing_event()
    }
    fn record(&self, event: Handle, stream: Handle) -> bool {
        crate::driver::record_event(event, stream)
    }
    fn synchronize(&self, event: Handle) {
        let _ = crate::driver::synchronize_event(event);
    }
    fn destroy(&self, event: Handle) {
        crate::driver::destroy_event(event)
    }
    fn elapsed_ns(&self, start: Handle, end: Handle) -> Option<u64> {
        crate::driver::elapsed_ns(start, end)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The completion event; 0: not created yet.
    event: Handle,
    /// The start event (timing launches only); 0: not created yet.
    start: Handle,
    context: Handle,
    /// A start was recorded for the launch in this slot: what it runs, when it was
    /// admitted and against which window.
    timed: Option<Timed>,
}

/// A timed launch: what it runs (`estimate::What::key`), when it was expected to start,
/// and the window it was admitted against.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timed {
    pub key: u64,
    pub admitted_ns: u64,
    pub fit_by_ns: u64,
}

#[derive(Debug, Default)]
pub struct Ring {
    slots: [Slot; RING],
    oldest: usize,
    pending: usize,
    /// When the stream's admitted work is expected to end (CLOCK_MONOTONIC ns; 0:
    /// nothing estimated), for admission inside a window.
    queued_until: u64,
    /// A launch of unknown length is unfinished: the next waits for it (and so
    /// measures it) before anything queues behind it.
    blind: bool,
}

impl Ring {
    pub const fn new() -> Ring {
        Ring {
            slots: [Slot {
                event: 0,
                start: 0,
                context: 0,
                timed: None,
            }; RING],
            oldest: 0,
            pending: 0,
            queued_until: 0,
            blind: false,
        }
    }

    pub fn queued_until(&self) -> u64 {
        self.queued_until
    }

    pub fn blind(&self) -> bool {
        self.blind
    }

    /// The launch just admitted ends at about `until` (`None`: nobody knows).
    pub fn set_queued_until(&mut self, until: Option<u64>) {
        self.queued_until = until.unwrap_or(0);
        self.blind = until.is_none();
    }

    /// Launches recorded and not yet waited for (some may have finished).
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Returns once fewer than `limit` (clamped to 1..=[`RING`]) launches are pending,
    /// waiting on the oldest ones; a timed launch's duration goes to `learn`.
    pub fn wait_below(&mut self, limit: u32, events: &impl Events, learn: &impl Learn) {
        let limit = (limit as usize).clamp(1, RING);
        while self.pending >= limit {
            let slot = &mut self.slots[self.oldest];
            events.synchronize(slot.event);
            if let Some(timed) = slot.timed.take() {
                if let Some(duration) = events.elapsed_ns(slot.start, slot.event) {
                    learn.measured(timed.key, duration, timed.admitted_ns, timed.fit_by_ns);
                }
            }
            self.oldest = (self.oldest + 1) % RING;
            self.pending -= 1;
            if self.pending == 0 {
                // Everything admitted has run (only a wait says so: `record` calls this
                // on an empty ring right after the admission set them).
                self.queued_until = 0;
                self.blind = false;
            }
        }
    }

    /// The slot the next launch records into, with events of the current context.
    fn next_slot(&mut self, events: &impl Events) -> Option<&mut Slot> {
        let context = events.current_context();
        let slot = &mut self.slots[(self.oldest + self.pending) % RING];
        if slot.event == 0 || slot.context != context {
            // Events are per context: a launch in another context needs its own.
            for event in [slot.event, slot.start] {
                if event != 0 {
                    events.destroy(event);
                }
            }
            *slot = Slot {
                event: events.create().unwrap_or(0),
                start: 0,
                context,
                timed: None,
            };
        }
        (slot.event != 0).then_some(slot)
    }

    /// Before a launch into `stream` that is to be timed: records its start (the ring
    /// has room: [`Ring::wait_below`] ran first).
    pub fn begin(&mut self, stream: Handle, timed: Timed, events: &impl Events) {
        let Some(slot) = self.next_slot(events) else {
            return;
        };
        if slot.start == 0 {
            slot.start = events.create().unwrap_or(0);
        }
        slot.timed = (slot.start != 0 && events.record(slot.start, stream)).then_some(timed);
    }

    /// Records the completion of a launch just submitted to `stream`.
    pub fn record(&mut self, stream: Handle, events: &impl Events, learn: &impl Learn) {
        self.wait_below(RING as u32, events, learn);
        let Some(slot) = self.next_slot(events) else {
            return;
        };
        if events.record(slot.event, stream) {
            self.pending += 1;
        } else {
            slot.timed = None;
        }
    }

    /// A launch that `begin` timed did not reach the driver: forget its start.
    pub fn abandon(&mut self) {
        let index = (self.oldest + self.pending) % RING;
        self.slots[index].timed = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// Events that log what the ring asked of the driver.
    #[derive(Default)]
    struct Fake {
        context: Cell<Handle>,
        next: Cell<Handle>,
        log: RefCell<Vec<String>>,
    }

    impl Events for Fake {
        fn current_context(&self) -> Handle {
            self.context.get()
        }
        fn create(&self) -> Option<Handle> {
            self.next.set(self.next.get() + 1);
            self.log
                .borrow_mut()
                .push(format!("create {}", self.next.get()));
            Some(self.next.get())
        }
        fn record(&self, event: Handle, stream: Handle) -> bool {
            self.log
                .borrow_mut()
                .push(format!("record {event} on {stream}"));
            true
        }
        fn synchronize(&self, event: Handle) {
            self.log.borrow_mut().push(format!("wait {event}"));
        }
        fn destroy(&self, event: Handle) {
            self.log.borrow_mut().push(format!("destroy {event}"));
        }
        fn elapsed_ns(&self, start: Handle, end: Handle) -> Option<u64> {
            self.log
                .borrow_mut()
                .push(format!("elapsed {start}..{end}"));
            Some(1_000 * end as u64)
        }
    }

    fn timed(key: u64, admitted_ns: u64, fit_by_ns: u64) -> Timed {
        Timed {
            key,
            admitted_ns,
            fit_by_ns,
        }
    }

    /// What the ring learned: (key, duration, admitted, window).
    #[derive(Default)]
    struct Learned(RefCell<Vec<(u64, u64, u64, u64)>>);

    impl Learn for Learned {
        fn measured(&self, key: u64, duration_ns: u64, admitted_ns: u64, fit_by_ns: u64) {
            self.0
                .borrow_mut()
                .push((key, duration_ns, admitted_ns, fit_by_ns));
        }
    }

    fn take(fake: &Fake) -> Vec<String> {
        std::mem::take(&mut *fake.log.borrow_mut())
    }

    #[test]
    fn at_most_n_launches_are_pending_and_the_oldest_is_waited_for() {
        let fake = Fake {
            context: Cell::new(1),
            ..Fake::default()
        };
        let mut ring = Ring::new();
        // N = 2: two launches go without waiting.
        for stream in [10, 11] {
            ring.wait_below(2, &fake, &Forget);
            ring.record(stream, &fake, &Forget);
        }
        assert_eq!(
            take(&fake),
            ["create 1", "record 1 on 10", "create 2", "record 2 on 11"]
        );
        // The third waits for the first, then reuses... a fresh slot (the ring is 16).
        ring.wait_below(2, &fake, &Forget);
        ring.record(12, &fake, &Forget);
        assert_eq!(take(&fake), ["wait 1", "create 3", "record 3 on 12"]);
        assert_eq!(ring.pending(), 2);
        // N = 1: wait for everything pending.
        ring.wait_below(1, &fake, &Forget);
        assert_eq!(take(&fake), ["wait 2", "wait 3"]);
        assert_eq!(ring.pending(), 0);
    }

    #[test]
    fn events_are_reused_in_their_context_and_replaced_in_another() {
        let fake = Fake {
            context: Cell::new(1),
            ..Fake::default()
        };
        let mut ring = Ring::new();
        for _ in 0..RING {
            ring.wait_below(1, &fake, &Forget);
            ring.record(0, &fake, &Forget);
        }
        take(&fake);
        // Slot 0 again: its event is reused in the same context...
        ring.wait_below(1, &fake, &Forget);
        ring.record(0, &fake, &Forget);
        assert_eq!(
            take(&fake),
            [format!("wait {RING}"), "record 1 on 0".to_string()]
        );
        // ...and replaced when the launch is in another context.
        fake.context.set(2);
        ring.wait_below(1, &fake, &Forget);
        ring.record(0, &fake, &Forget);
        assert_eq!(
            take(&fake),
            ["wait 1", "destroy 2", "create 17", "record 17 on 0"]
        );
    }

    #[test]
    fn a_timed_launch_is_measured_when_the_ring_waits_for_it() {
        let fake = Fake {
            context: Cell::new(1),
            ..Fake::default()
        };
        let learned = Learned::default();
        let mut ring = Ring::new();
        ring.wait_below(1, &fake, &learned);
        ring.begin(10, timed(42, 500, 900), &fake);
        ring.record(10, &fake, &learned);
        assert_eq!(
            take(&fake),
            ["create 1", "create 2", "record 2 on 10", "record 1 on 10"],
            "the start (2) goes into the stream before the launch, the end (1) after"
        );
        // An untimed launch after it: the wait for the first measures it.
        ring.wait_below(1, &fake, &learned);
        ring.record(10, &fake, &learned);
        assert_eq!(
            take(&fake),
            ["wait 1", "elapsed 2..1", "create 3", "record 3 on 10"]
        );
        assert_eq!(*learned.0.borrow(), [(42, 1_000, 500, 900)]);
        ring.wait_below(1, &fake, &learned);
        assert_eq!(take(&fake), ["wait 3"], "nothing to measure");
        assert_eq!(learned.0.borrow().len(), 1);
        // A timed launch the driver refused is forgotten.
        ring.begin(10, timed(7, 1, 2), &fake);
        ring.abandon();
        ring.record(10, &fake, &learned);
        ring.wait_below(1, &fake, &learned);
        assert_eq!(learned.0.borrow().len(), 1);
    }

    /// What admission knows of the stream's queue lasts until a wait shows it has run:
    /// recording the launch it was set for (on an empty ring) must not forget it.
    #[test]
    fn the_queue_estimate_survives_recording_and_ends_with_the_wait() {
        let fake = Fake {
            context: Cell::new(1),
            ..Fake::default()
        };
        let mut ring = Ring::new();
        ring.begin(10, timed(1, 0, 0), &fake);
        ring.set_queued_until(Some(5_000));
        ring.record(10, &fake, &Forget);
        assert_eq!(ring.queued_until(), 5_000);
        ring.begin(10, timed(1, 0, 0), &fake);
        ring.set_queued_until(None);
        ring.record(10, &fake, &Forget);
        assert!(ring.blind());
        ring.wait_below(2, &fake, &Forget);
        assert!(ring.blind(), "one launch still unfinished");
        ring.wait_below(1, &fake, &Forget);
        assert_eq!((ring.queued_until(), ring.blind()), (0, false));
    }
}
