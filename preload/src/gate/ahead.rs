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
}

/// The real driver's events.
pub struct DriverEvents;

impl Events for DriverEvents {
    fn current_context(&self) -> Handle {
        crate::driver::current_context()
    }
    fn create(&self) -> Option<Handle> {
        crate::driver::create_event()
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
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// 0: not created yet.
    event: Handle,
    context: Handle,
}

#[derive(Debug, Default)]
pub struct Ring {
    slots: [Slot; RING],
    oldest: usize,
    pending: usize,
}

impl Ring {
    pub const fn new() -> Ring {
        Ring {
            slots: [Slot {
                event: 0,
                context: 0,
            }; RING],
            oldest: 0,
            pending: 0,
        }
    }

    /// Launches recorded and not yet waited for (some may have finished).
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Returns once fewer than `limit` (clamped to 1..=[`RING`]) launches are pending,
    /// waiting on the oldest ones.
    pub fn wait_below(&mut self, limit: u32, events: &impl Events) {
        let limit = (limit as usize).clamp(1, RING);
        while self.pending >= limit {
            events.synchronize(self.slots[self.oldest].event);
            self.oldest = (self.oldest + 1) % RING;
            self.pending -= 1;
        }
    }

    /// Records the completion of a launch just submitted to `stream`.
    pub fn record(&mut self, stream: Handle, events: &impl Events) {
        self.wait_below(RING as u32, events);
        let context = events.current_context();
        let slot = &mut self.slots[(self.oldest + self.pending) % RING];
        if slot.event == 0 || slot.context != context {
            // Events are per context: a launch in another context needs its own.
            if slot.event != 0 {
                events.destroy(slot.event);
            }
            *slot = Slot {
                event: events.create().unwrap_or(0),
                context,
            };
            if slot.event == 0 {
                return;
            }
        }
        if events.record(slot.event, stream) {
            self.pending += 1;
        }
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
            ring.wait_below(2, &fake);
            ring.record(stream, &fake);
        }
        assert_eq!(
            take(&fake),
            ["create 1", "record 1 on 10", "create 2", "record 2 on 11"]
        );
        // The third waits for the first, then reuses... a fresh slot (the ring is 16).
        ring.wait_below(2, &fake);
        ring.record(12, &fake);
        assert_eq!(take(&fake), ["wait 1", "create 3", "record 3 on 12"]);
        assert_eq!(ring.pending(), 2);
        // N = 1: wait for everything pending.
        ring.wait_below(1, &fake);
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
            ring.wait_below(1, &fake);
            ring.record(0, &fake);
        }
        take(&fake);
        // Slot 0 again: its event is reused in the same context...
        ring.wait_below(1, &fake);
        ring.record(0, &fake);
        assert_eq!(
            take(&fake),
            [format!("wait {RING}"), "record 1 on 0".to_string()]
        );
        // ...and replaced when the launch is in another context.
        fake.context.set(2);
        ring.wait_below(1, &fake);
        ring.record(0, &fake);
        assert_eq!(
            take(&fake),
            ["wait 1", "destroy 2", "create 17", "record 17 on 0"]
        );
    }
}
