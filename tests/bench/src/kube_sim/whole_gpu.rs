//! Whole-GPU allocation (`nvidia.com/gpu: 1`): every pod takes a GPU of its own, whatever
//! memory it asked for. kube-scheduler counts free GPUs per node (LeastAllocated on
//! `nvidia.com/gpu`); a pod that finds none waits in one FIFO queue for the cluster. Every pod
//! asks for the same single GPU, so the queue's oldest pod takes whichever GPU frees first.

use std::collections::VecDeque;

use super::drive::{Changes, Model};
use super::kube::{KubeScheduler, Resource};
use super::meter::Gauges;
use super::trace::Pod;

pub struct WholeGpuCluster {
    /// `nvidia.com/gpu` per node.
    pub nodes: Vec<Resource>,
    free_gpus: u64,
    kube: KubeScheduler,
    queue: VecDeque<u32>,
    node_of: Vec<u32>,
    gauges: Gauges,
}

impl WholeGpuCluster {
    pub fn new(nodes: usize, gpus_per_node: usize, kube: KubeScheduler, pods: &[Pod]) -> Self {
        let node = Resource {
            allocatable: gpus_per_node as u64,
            requested: 0,
        };
        Self {
            nodes: vec![node; nodes],
            free_gpus: (nodes * gpus_per_node) as u64,
            kube,
            queue: VecDeque::new(),
            node_of: vec![u32::MAX; pods.len()],
            gauges: Gauges::default(),
        }
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    fn take(&mut self, node: usize, id: u32, pod: &Pod, changes: &mut Changes) {
        self.nodes[node].requested += 1;
        self.free_gpus -= 1;
        self.node_of[id as usize] = node as u32;
        self.gauges.busy_gpus += 1.0;
        self.gauges.granted_gib += f64::from(pod.memory_gib);
        changes.bound.push(id);
        changes.started.push(id);
    }
}

impl Model for WholeGpuCluster {
    fn arrive(&mut self, id: u32, pods: &[Pod], changes: &mut Changes) {
        // A GPU free anywhere means the queue is empty: each release serves the queue first.
        if self.free_gpus == 0 {
            self.queue.push_back(id);
            self.gauges.cluster_pending += 1.0;
            return;
        }
        let nodes = &self.nodes;
        let node = self
            .kube
            .select(
                nodes.len(),
                |n| nodes[n].fits(1),
                |n| nodes[n].least_allocated_score(1),
            )
            .expect("a free GPU is on some node");
        self.take(node, id, &pods[id as usize], changes);
    }

    fn finish(&mut self, id: u32, pods: &[Pod], changes: &mut Changes) {
        let node = self.node_of[id as usize] as usize;
        self.nodes[node].requested -= 1;
        self.free_gpus += 1;
        self.gauges.busy_gpus -= 1.0;
        self.gauges.granted_gib -= f64::from(pods[id as usize].memory_gib);
        // The freed GPU is the only free one in the cluster: the queue's oldest takes it.
        if let Some(next) = self.queue.pop_front() {
            self.gauges.cluster_pending -= 1.0;
            self.take(node, next, &pods[next as usize], changes);
        }
    }

    fn gauges(&self) -> Gauges {
        self.gauges
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube_sim::drive::drive;
    use crate::kube_sim::meter::Meter;
    use crate::kube_sim::rng::SplitMix64;

    fn pod(arrival_ms: u64, memory_gib: u32, duration_ms: u64) -> Pod {
        Pod {
            arrival_ms,
            memory_gib,
            high: false,
            duration_ms,
        }
    }

    #[test]
    fn each_pod_takes_a_gpu_and_the_rest_queue_in_arrival_order() {
        // Two nodes of one GPU; four pods of 2 GiB arrive together.
        let pods = [
            pod(0, 2, 100),
            pod(1, 2, 300),
            pod(2, 2, 100),
            pod(3, 2, 100),
        ];
        let mut c = WholeGpuCluster::new(2, 1, KubeScheduler::new(SplitMix64::new(1)), &pods);
        let mut meter = Meter::new((0, 1_000), 1_000, 0);
        let (t, end) = drive(&mut c, &pods, &mut meter);
        let starts: Vec<u64> = t.iter().map(|t| t.start_ms).collect();
        // Pod 2 takes pod 0's GPU at 100, pod 3 takes pod 2's at 200, though 2 GiB of 80 is
        // all any of them uses.
        assert_eq!(starts, [0, 1, 100, 200]);
        assert_eq!(end, 301);
        assert_eq!(c.queued(), 0);
        assert!(t.iter().all(|t| !t.waited_on_node()));
    }

    #[test]
    fn least_allocated_spreads_pods_over_the_nodes() {
        let pods: Vec<Pod> = (0..4).map(|i| pod(i, 8, 1_000)).collect();
        let mut c = WholeGpuCluster::new(2, 4, KubeScheduler::new(SplitMix64::new(5)), &pods);
        let mut changes = Changes::default();
        for id in 0..4 {
            c.arrive(id, &pods, &mut changes);
        }
        let used: Vec<u64> = c.nodes.iter().map(|n| n.requested).collect();
        assert_eq!(used, [2, 2]);
        assert_eq!(c.gauges().granted_gib, 32.0);
        assert_eq!(c.gauges().busy_gpus, 4.0);
    }
}
