//! The shared-GPU modes: kube-scheduler binds a pod to a node, then the node's arbiter places
//! its memory grant on one GPU with the real [`place_memory_grant`] (worst fit), or keeps it
//! waiting there until a release on that node makes room.
//!
//! - [`NodeFilter::NodeTotals`] is gpushare as deployed: kube-scheduler sees only the node's
//!   `gpushare.io/memory` and `gpushare.io/high` totals, so it may bind a pod to a node where
//!   the free memory is split across GPUs and no single one can hold it.
//! - [`NodeFilter::LargestGpuHole`] is an oracle, a GPU-aware scheduler: a node fits only if
//!   one of its GPUs can take the pod now, so no pod ever waits on a node. It bounds what
//!   counting node totals loses.
//!
//! Each GPU holds at most one high pod (placement gives a GPU one high lease), so a high
//! pod's grant goes only to a GPU without one. A node's waiting grants are retried, oldest
//! first, whenever one of its pods ends; then the cluster's pending pods, oldest first, are
//! tried against that node. Those are the only retries needed: a pending pod fitted no node
//! when it was last tried, and since then only the node where a pod ended has more room.

use std::collections::VecDeque;

use gpushare_arbiter::grants::place_memory_grant;
use gpushare_arbiter::placement::GpuView;

use super::drive::{Changes, Model};
use super::kube::{KubeScheduler, Resource, Scoring};
use super::meter::Gauges;
use super::trace::Pod;

const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeFilter {
    /// NodeResourcesFit on the node's totals (what kube-scheduler does).
    NodeTotals,
    /// The node's largest free hole on one GPU (a GPU-aware scheduler).
    LargestGpuHole,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gpu {
    /// GiB granted to the pods running on it.
    pub granted_gib: u32,
    pub pods: u32,
    pub has_high: bool,
}

impl Gpu {
    /// Placement gives a GPU at most one high lease.
    fn takes(&self, pod: &Pod) -> bool {
        !(pod.high && self.has_high)
    }
}

#[derive(Debug, Clone)]
pub struct Node {
    /// `gpushare.io/memory` in GiB units: allocatable, and what the bound pods asked for.
    pub memory: Resource,
    /// `gpushare.io/high`: one per GPU.
    pub high: Resource,
    pub gpus: Vec<Gpu>,
    gpu_gib: u32,
    /// Pods bound here whose grants wait for a GPU, oldest first.
    waiting: VecDeque<u32>,
}

impl Node {
    pub fn new(gpus: usize, gpu_gib: u32) -> Self {
        Self {
            memory: Resource {
                allocatable: gpus as u64 * u64::from(gpu_gib),
                requested: 0,
            },
            high: Resource {
                allocatable: gpus as u64,
                requested: 0,
            },
            gpus: vec![Gpu::default(); gpus],
            gpu_gib,
            waiting: VecDeque::new(),
        }
    }

    /// The filter: whether kube-scheduler may bind `pod` here.
    pub fn fits(&self, pod: &Pod, filter: NodeFilter) -> bool {
        let totals =
            self.memory.fits(u64::from(pod.memory_gib)) && self.high.fits(u64::from(pod.high));
        match filter {
            NodeFilter::NodeTotals => totals,
            // What `place` would find, without building the views for every node scored.
            NodeFilter::LargestGpuHole => {
                totals
                    && self
                        .gpus
                        .iter()
                        .any(|g| g.takes(pod) && self.gpu_gib - g.granted_gib >= pod.memory_gib)
            }
        }
    }

    /// The score on `gpushare.io/memory`.
    pub fn score(&self, pod: &Pod, scoring: Scoring) -> u64 {
        scoring.score(&self.memory, u64::from(pod.memory_gib))
    }

    /// The GPU the arbiter places `pod`'s memory grant on: [`place_memory_grant`] over the
    /// GPUs that may take it (None: the grant waits).
    pub fn place(&self, pod: &Pod) -> Option<usize> {
        let views: Vec<GpuView<'_>> = self
            .gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.takes(pod))
            .map(|(i, g)| GpuView {
                index: i as u32,
                uuid: "",
                memory_allocatable: u64::from(self.gpu_gib) * GIB,
                memory_leased: u64::from(g.granted_gib) * GIB,
                lending: None,
                high_leases: u32::from(g.has_high),
                low_leases: g.pods - u32::from(g.has_high),
                ungated_leases: 0,
                utilization: 0.0,
                drained: false,
                reserved_for: None,
            })
            .collect();
        place_memory_grant(u64::from(pod.memory_gib) * GIB, &views).map(|i| views[i].index as usize)
    }
}

pub struct SharedCluster {
    filter: NodeFilter,
    scoring: Scoring,
    pub nodes: Vec<Node>,
    kube: KubeScheduler,
    /// Pods kube-scheduler could bind nowhere, oldest (lowest id) first: one queue per
    /// request (memory, high), indexed by [`SharedCluster::class`].
    pending: Vec<VecDeque<u32>>,
    /// The requests the trace holds, sorted: a pod's class is its request's index here.
    classes: Vec<(u32, bool)>,
    /// Where each running pod is: (node, GPU).
    placed: Vec<(u32, u8)>,
    gauges: Gauges,
}

impl SharedCluster {
    pub fn new(
        nodes: usize,
        gpus_per_node: usize,
        gpu_gib: u32,
        filter: NodeFilter,
        scoring: Scoring,
        kube: KubeScheduler,
        pods: &[Pod],
    ) -> Self {
        let mut classes: Vec<(u32, bool)> = pods.iter().map(|p| (p.memory_gib, p.high)).collect();
        classes.sort_unstable();
        classes.dedup();
        Self {
            filter,
            scoring,
            nodes: vec![Node::new(gpus_per_node, gpu_gib); nodes],
            kube,
            pending: vec![VecDeque::new(); classes.len()],
            classes,
            placed: vec![(u32::MAX, 0); pods.len()],
            gauges: Gauges::default(),
        }
    }

    fn class(&self, pod: &Pod) -> usize {
        self.classes
            .binary_search(&(pod.memory_gib, pod.high))
            .expect("every request of the trace has a class")
    }

    /// The pods pending for the whole cluster, in no particular order.
    pub fn pending(&self) -> impl Iterator<Item = u32> + '_ {
        self.pending.iter().flatten().copied()
    }

    fn bind(&mut self, node: usize, id: u32, pod: &Pod, changes: &mut Changes) {
        let n = &mut self.nodes[node];
        n.memory.requested += u64::from(pod.memory_gib);
        n.high.requested += u64::from(pod.high);
        changes.bound.push(id);
        match n.place(pod) {
            Some(gpu) => self.start(node, gpu, id, pod, changes),
            None => {
                n.waiting.push_back(id);
                self.gauges.stranded_gib += f64::from(pod.memory_gib);
                self.gauges.node_waiting += 1.0;
            }
        }
    }

    fn start(&mut self, node: usize, gpu: usize, id: u32, pod: &Pod, changes: &mut Changes) {
        let g = &mut self.nodes[node].gpus[gpu];
        if g.pods == 0 {
            self.gauges.busy_gpus += 1.0;
        }
        g.pods += 1;
        g.granted_gib += pod.memory_gib;
        g.has_high |= pod.high;
        self.gauges.granted_gib += f64::from(pod.memory_gib);
        self.placed[id as usize] = (node as u32, gpu as u8);
        changes.started.push(id);
    }
}

impl Model for SharedCluster {
    fn arrive(&mut self, id: u32, pods: &[Pod], changes: &mut Changes) {
        let pod = &pods[id as usize];
        let (nodes, filter, scoring) = (&self.nodes, self.filter, self.scoring);
        let chosen = self.kube.select(
            nodes.len(),
            |n| nodes[n].fits(pod, filter),
            |n| nodes[n].score(pod, scoring),
        );
        match chosen {
            Some(node) => self.bind(node, id, pod, changes),
            None => {
                let class = self.class(pod);
                self.pending[class].push_back(id);
                self.gauges.cluster_pending += 1.0;
            }
        }
    }

    fn finish(&mut self, id: u32, pods: &[Pod], changes: &mut Changes) {
        let pod = &pods[id as usize];
        let (node, gpu) = self.placed[id as usize];
        let node = node as usize;
        let n = &mut self.nodes[node];
        let g = &mut n.gpus[gpu as usize];
        g.pods -= 1;
        g.granted_gib -= pod.memory_gib;
        if pod.high {
            g.has_high = false;
        }
        if g.pods == 0 {
            self.gauges.busy_gpus -= 1.0;
        }
        n.memory.requested -= u64::from(pod.memory_gib);
        n.high.requested -= u64::from(pod.high);
        self.gauges.granted_gib -= f64::from(pod.memory_gib);

        // The node's waiting grants first: they are already bound here.
        let waiting = std::mem::take(&mut self.nodes[node].waiting);
        for w in waiting {
            let wp = &pods[w as usize];
            match self.nodes[node].place(wp) {
                Some(gpu) => {
                    self.gauges.stranded_gib -= f64::from(wp.memory_gib);
                    self.gauges.node_waiting -= 1.0;
                    self.start(node, gpu, w, wp, changes);
                }
                None => self.nodes[node].waiting.push_back(w),
            }
        }

        // The cluster's pending pods, oldest first. Whether a pod fits depends only on its
        // request, and binding only shrinks the node, so once the oldest pod of a request fails
        // here every younger one of that request fails too: try each request's oldest pod, in
        // age order, until every request has failed.
        let mut failed = vec![false; self.pending.len()];
        loop {
            let oldest = self
                .pending
                .iter()
                .enumerate()
                .filter(|(class, queue)| !failed[*class] && !queue.is_empty())
                .min_by_key(|(_, queue)| queue[0])
                .map(|(class, queue)| (class, queue[0]));
            let Some((class, p)) = oldest else { break };
            let pp = &pods[p as usize];
            if self.nodes[node].fits(pp, self.filter) {
                self.pending[class].pop_front();
                self.gauges.cluster_pending -= 1.0;
                self.bind(node, p, pp, changes);
            } else {
                failed[class] = true;
            }
        }
    }

    fn gauges(&self) -> Gauges {
        self.gauges
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube_sim::rng::SplitMix64;

    fn pod(memory_gib: u32, high: bool) -> Pod {
        Pod {
            arrival_ms: 0,
            memory_gib,
            high,
            duration_ms: 1_000,
        }
    }

    fn node_with(granted: &[u32]) -> Node {
        let mut n = Node::new(granted.len(), 80);
        for (g, &gib) in n.gpus.iter_mut().zip(granted) {
            g.granted_gib = gib;
            g.pods = u32::from(gib > 0);
        }
        n.memory.requested = granted.iter().map(|&g| u64::from(g)).sum();
        n
    }

    #[test]
    fn node_totals_admit_a_pod_no_single_gpu_can_hold() {
        // 30 GiB free on each of two GPUs: 60 in all.
        let n = node_with(&[50, 50]);
        let big = pod(40, false);
        assert!(n.fits(&big, NodeFilter::NodeTotals));
        assert_eq!(n.place(&big), None);
        assert!(!n.fits(&big, NodeFilter::LargestGpuHole));
        let small = pod(30, false);
        assert!(n.fits(&small, NodeFilter::LargestGpuHole));
        assert_eq!(n.place(&small), Some(0));
    }

    #[test]
    fn a_full_node_total_or_no_high_slot_fails_the_filter() {
        let n = node_with(&[80, 76]);
        assert!(!n.fits(&pod(8, false), NodeFilter::NodeTotals));
        assert!(n.fits(&pod(4, false), NodeFilter::NodeTotals));
        let mut n = node_with(&[0, 0]);
        n.high.requested = 2;
        assert!(!n.fits(&pod(2, true), NodeFilter::NodeTotals));
        assert!(n.fits(&pod(2, false), NodeFilter::NodeTotals));
    }

    #[test]
    fn placement_is_worst_fit_and_a_high_pod_skips_a_gpu_with_a_high_pod() {
        let mut n = node_with(&[10, 30, 20]);
        assert_eq!(n.place(&pod(8, false)), Some(0));
        n.gpus[0].has_high = true;
        assert_eq!(n.place(&pod(8, true)), Some(2));
        assert_eq!(n.place(&pod(8, false)), Some(0));
        // The only GPU with room has a high pod: a high pod waits, a low one does not.
        let mut n = node_with(&[80, 10]);
        n.gpus[1].has_high = true;
        assert_eq!(n.place(&pod(8, true)), None);
        assert!(!n.fits(&pod(8, true), NodeFilter::LargestGpuHole));
        assert_eq!(n.place(&pod(8, false)), Some(1));
    }

    #[test]
    fn least_allocated_prefers_the_emptier_node() {
        let emptier = node_with(&[10, 0]);
        let fuller = node_with(&[60, 0]);
        let p = pod(8, false);
        assert!(
            emptier.score(&p, Scoring::LeastAllocated) > fuller.score(&p, Scoring::LeastAllocated)
        );
        assert!(
            emptier.score(&p, Scoring::MostAllocated) < fuller.score(&p, Scoring::MostAllocated)
        );
    }

    /// One node of two GPUs: 48 + 48 GiB fill both past half, so a 40 GiB pod passes the
    /// node-total filter (64 free) but fits no GPU, and waits until one of them ends.
    fn fragmenting_trace() -> Vec<Pod> {
        let at = |arrival_ms, memory_gib, duration_ms| Pod {
            arrival_ms,
            memory_gib,
            high: false,
            duration_ms,
        };
        vec![at(0, 48, 10_000), at(1, 48, 20_000), at(2, 40, 5_000)]
    }

    fn run(filter: NodeFilter, pods: &[Pod]) -> (Vec<super::super::drive::Timing>, u64) {
        let kube = KubeScheduler::new(SplitMix64::new(1));
        let mut c = SharedCluster::new(1, 2, 80, filter, Scoring::LeastAllocated, kube, pods);
        let mut meter = super::super::meter::Meter::new((0, 1), 1_000_000, 0);
        super::super::drive::drive(&mut c, pods, &mut meter)
    }

    #[test]
    fn node_totals_bind_the_pod_and_it_waits_on_the_node_for_a_release() {
        let (t, end) = run(NodeFilter::NodeTotals, &fragmenting_trace());
        assert_eq!(t[2].bound_ms, 2, "bound at once by node totals");
        assert_eq!(
            t[2].start_ms, 10_000,
            "placed when the first 48 GiB pod ends"
        );
        assert!(t[2].waited_on_node() && !t[0].waited_on_node());
        assert_eq!(end, 20_001);
    }

    #[test]
    fn the_gpu_aware_filter_keeps_the_pod_pending_instead_and_never_strands() {
        let (t, _) = run(NodeFilter::LargestGpuHole, &fragmenting_trace());
        assert_eq!(t[2].bound_ms, 10_000);
        assert_eq!(t[2].start_ms, 10_000);
        assert!(t.iter().all(|t| !t.waited_on_node()));
    }

    #[test]
    fn after_every_event_no_pending_pod_fits_any_node() {
        // The invariant that lets a release retry pending pods against its own node only.
        let mix = crate::kube_sim::trace::PodMix::typical();
        let mut rng = SplitMix64::new(11);
        let rate = mix.arrival_rate_per_s(0.95, 8.0 * 4.0 * 80.0);
        let pods = crate::kube_sim::trace::generate(&mix, rate, 6.0 * 3600.0, &mut rng);
        for (filter, scoring) in [
            (NodeFilter::NodeTotals, Scoring::LeastAllocated),
            (NodeFilter::NodeTotals, Scoring::MostAllocated),
            (NodeFilter::LargestGpuHole, Scoring::LeastAllocated),
        ] {
            let kube = KubeScheduler::new(SplitMix64::new(2));
            let mut c = SharedCluster::new(8, 4, 80, filter, scoring, kube, &pods);
            let mut changes = Changes::default();
            let mut pending_seen = 0;
            let mut events: Vec<(u64, bool, u32)> = pods
                .iter()
                .enumerate()
                .map(|(i, p)| (p.arrival_ms, true, i as u32))
                .collect();
            events.sort();
            // A small event loop of its own, to look at the state between events.
            let mut queue = super::super::events::EventQueue::default();
            for (at, _, id) in events {
                queue.push(at, (true, id));
            }
            while let Some((now, (arrival, id))) = queue.pop() {
                if arrival {
                    c.arrive(id, &pods, &mut changes);
                } else {
                    c.finish(id, &pods, &mut changes);
                }
                changes.bound.clear();
                for s in changes.started.drain(..) {
                    queue.push(now + pods[s as usize].duration_ms, (false, s));
                }
                for p in c.pending() {
                    pending_seen += 1;
                    let pp = &pods[p as usize];
                    assert!(
                        c.nodes.iter().all(|n| !n.fits(pp, filter)),
                        "{filter:?}: pending pod {p} fits a node"
                    );
                }
            }
            assert!(
                pending_seen > 0,
                "{filter:?}: the load never left a pod pending"
            );
        }
    }
}
