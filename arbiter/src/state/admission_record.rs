//! What admission did, counted for status and metrics: how long each placement
//! decision and batch search took, the reserves that waited for fragmented
//! memory, and those that timed out in the queue.

use std::time::Duration;

use gpushare_proto::timing::PlacementTimes;
use gpushare_proto::{AdmissionRejections, Priority};

#[derive(Debug, Default)]
pub(super) struct AdmissionRecord {
    times: PlacementTimes,
    /// Reserves that waited although the open GPUs' free memory added up would
    /// have held them (`placement::memory_fragmented`); each counted once.
    waits_fragmented: u64,
    /// Reserves that timed out in the admission queue, by priority.
    rejections: AdmissionRejections,
}

impl AdmissionRecord {
    pub(super) fn placement_decided(&mut self, took: Duration) {
        self.times.decisions.record(took);
    }

    pub(super) fn batch_searched(&mut self, took: Duration) {
        self.times.batch_searches.record(took);
    }

    pub(super) fn waited_for_fragmented_memory(&mut self) {
        self.waits_fragmented += 1;
    }

    pub(super) fn timed_out(&mut self, priority: Priority) {
        match priority {
            Priority::High => self.rejections.high += 1,
            Priority::Low => self.rejections.low += 1,
        }
    }

    pub(super) fn placement_times(&self) -> PlacementTimes {
        self.times.clone()
    }

    pub(super) fn waits_fragmented(&self) -> u64 {
        self.waits_fragmented
    }

    pub(super) fn rejections(&self) -> AdmissionRejections {
        self.rejections
    }
}

#[cfg(test)]
mod tests;
