//! The event loop every mode shares: pods arrive at their trace times, run for their duration
//! once a mode has started them on a GPU, and the gauges are metered between events.

use super::events::EventQueue;
use super::meter::{Gauges, Meter};
use super::trace::Pod;

/// What one event did: the pods kube-scheduler bound to a node and those that started on a GPU.
#[derive(Debug, Default)]
pub struct Changes {
    pub bound: Vec<u32>,
    pub started: Vec<u32>,
}

/// A way of running a cluster: what happens when a pod arrives and when one ends.
pub trait Model {
    fn arrive(&mut self, pod: u32, pods: &[Pod], changes: &mut Changes);
    fn finish(&mut self, pod: u32, pods: &[Pod], changes: &mut Changes);
    fn gauges(&self) -> Gauges;
}

/// When each pod was bound to a node and started on a GPU (`u64::MAX`: never).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub bound_ms: u64,
    pub start_ms: u64,
}

impl Timing {
    /// The pod was bound to a node where no GPU could hold it, and waited there.
    pub fn waited_on_node(&self) -> bool {
        self.start_ms > self.bound_ms
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrive(u32),
    Finish(u32),
}

/// Runs `pods` through `model` until the last one has ended; returns each pod's timing and
/// the time the last one ended.
pub fn drive(model: &mut impl Model, pods: &[Pod], meter: &mut Meter) -> (Vec<Timing>, u64) {
    let mut queue = EventQueue::default();
    for (i, pod) in pods.iter().enumerate() {
        queue.push(pod.arrival_ms, Event::Arrive(i as u32));
    }
    let mut timings = vec![
        Timing {
            bound_ms: u64::MAX,
            start_ms: u64::MAX,
        };
        pods.len()
    ];
    let mut changes = Changes::default();
    let mut end_ms = 0;
    while let Some((now, event)) = queue.pop() {
        meter.advance(now);
        end_ms = now;
        match event {
            Event::Arrive(pod) => model.arrive(pod, pods, &mut changes),
            Event::Finish(pod) => model.finish(pod, pods, &mut changes),
        }
        for pod in changes.bound.drain(..) {
            timings[pod as usize].bound_ms = now;
        }
        for pod in changes.started.drain(..) {
            timings[pod as usize].start_ms = now;
            queue.push(now + pods[pod as usize].duration_ms, Event::Finish(pod));
        }
        meter.set(model.gauges());
    }
    (timings, end_ms)
}
