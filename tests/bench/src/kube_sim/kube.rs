//! A model of kube-scheduler's decision for one pod (Kubernetes 1.33, default profile):
//! filter the nodes, score the feasible ones, pick the best.
//!
//! - Filter (NodeResourcesFit): a node fits when, for every resource the pod asks for, the
//!   node's allocatable minus what its bound pods asked for covers the request. For extended
//!   resources kube-scheduler knows only the node's totals; which GPU holds what is invisible.
//! - How many nodes it looks at: it stops once it has found `numFeasibleNodesToFind` feasible
//!   nodes (for 1,000 nodes 42 %: `50 - nodes/125` percent, at least 100 nodes), starting where
//!   the previous pod's search stopped.
//! - Score (NodeResourcesFit, LeastAllocated): `(allocatable - requested) * 100 / allocatable`
//!   in integers, the pod's own request counted. The default profile scores only `cpu` and
//!   `memory`, which these pods do not ask for, so every node would tie; the model assumes the
//!   operator lists the GPU resource (`gpushare.io/memory`, or `nvidia.com/gpu`) in
//!   `scoringStrategy.resources`, weight 1.
//! - MostAllocated (the other scoring strategy, which operators of GPU clusters choose to pack
//!   nodes and keep whole ones free): `requested * 100 / allocatable`, the pod's request counted.
//! - Select: among the nodes with the highest score, one at random (kube-scheduler's
//!   `selectHost` keeps each of them with equal chance).

use super::rng::SplitMix64;

pub const MAX_NODE_SCORE: u64 = 100;
/// kube-scheduler's `minFeasibleNodesToFind` and `minFeasibleNodesPercentageToFind`.
const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;
const MIN_FEASIBLE_NODES_PERCENTAGE: usize = 5;

/// What a node offers and what its bound pods asked for, in units of one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    pub allocatable: u64,
    pub requested: u64,
}

impl Resource {
    pub fn free(&self) -> u64 {
        self.allocatable.saturating_sub(self.requested)
    }

    /// NodeResourcesFit's filter for one resource.
    pub fn fits(&self, request: u64) -> bool {
        request <= self.free()
    }

    /// LeastAllocated's score for one resource, the pod's request counted.
    pub fn least_allocated_score(&self, request: u64) -> u64 {
        if self.allocatable == 0 {
            return 0;
        }
        let requested = self.requested + request;
        self.allocatable.saturating_sub(requested) * MAX_NODE_SCORE / self.allocatable
    }

    /// MostAllocated's score for one resource, the pod's request counted.
    pub fn most_allocated_score(&self, request: u64) -> u64 {
        if self.allocatable == 0 {
            return 0;
        }
        let requested = (self.requested + request).min(self.allocatable);
        requested * MAX_NODE_SCORE / self.allocatable
    }
}

/// NodeResourcesFit's scoring strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// The default: spread.
    LeastAllocated,
    /// Pack.
    MostAllocated,
}

impl Scoring {
    pub fn score(self, resource: &Resource, request: u64) -> u64 {
        match self {
            Self::LeastAllocated => resource.least_allocated_score(request),
            Self::MostAllocated => resource.most_allocated_score(request),
        }
    }
}

/// How many feasible nodes kube-scheduler looks for before it stops filtering.
pub fn feasible_nodes_to_find(nodes: usize) -> usize {
    if nodes < MIN_FEASIBLE_NODES_TO_FIND {
        return nodes;
    }
    let percentage = 50usize
        .saturating_sub(nodes / 125)
        .max(MIN_FEASIBLE_NODES_PERCENTAGE);
    (nodes * percentage / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// The scheduler's state between pods: where the next search starts, and its tie-breaks.
pub struct KubeScheduler {
    next_start: usize,
    rng: SplitMix64,
    feasible: Vec<(usize, u64)>,
}

impl KubeScheduler {
    pub fn new(rng: SplitMix64) -> Self {
        Self {
            next_start: 0,
            rng,
            feasible: Vec::new(),
        }
    }

    /// The node a pod is bound to among `nodes` (None: it stays pending). `fits` is the
    /// filter, `score` the score of a node that passed it.
    pub fn select(
        &mut self,
        nodes: usize,
        mut fits: impl FnMut(usize) -> bool,
        mut score: impl FnMut(usize) -> u64,
    ) -> Option<usize> {
        if nodes == 0 {
            return None;
        }
        let wanted = feasible_nodes_to_find(nodes);
        self.feasible.clear();
        let mut processed = 0;
        while processed < nodes && self.feasible.len() < wanted {
            let node = (self.next_start + processed) % nodes;
            processed += 1;
            if fits(node) {
                self.feasible.push((node, score(node)));
            }
        }
        self.next_start = (self.next_start + processed) % nodes;
        // selectHost: reservoir sampling among the highest scores.
        let mut chosen = None;
        let (mut best, mut ties) = (0, 0usize);
        for &(node, s) in &self.feasible {
            if chosen.is_none() || s > best {
                (chosen, best, ties) = (Some(node), s, 1);
            } else if s == best {
                ties += 1;
                if self.rng.below(ties) == 0 {
                    chosen = Some(node);
                }
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_fits_when_its_free_total_covers_the_request() {
        let node = Resource {
            allocatable: 640,
            requested: 600,
        };
        assert!(node.fits(40));
        assert!(!node.fits(41));
        let full = Resource {
            allocatable: 8,
            requested: 8,
        };
        assert!(!full.fits(1));
        assert!(full.fits(0), "a pod that asks for none of a resource fits");
    }

    #[test]
    fn least_allocated_counts_the_pods_own_request_and_rounds_down() {
        let empty = Resource {
            allocatable: 640,
            requested: 0,
        };
        assert_eq!(empty.least_allocated_score(0), 100);
        assert_eq!(empty.least_allocated_score(8), 98); // 632 * 100 / 640 = 98.75
        let half = Resource {
            allocatable: 640,
            requested: 320,
        };
        assert_eq!(half.least_allocated_score(40), 43);
        let gpus = Resource {
            allocatable: 8,
            requested: 7,
        };
        assert_eq!(gpus.least_allocated_score(1), 0);
    }

    #[test]
    fn most_allocated_scores_the_fuller_node_higher() {
        let half = Resource {
            allocatable: 640,
            requested: 320,
        };
        assert_eq!(half.most_allocated_score(40), 56); // 360 * 100 / 640 = 56.25
        assert_eq!(Scoring::MostAllocated.score(&half, 0), 50);
        assert_eq!(Scoring::LeastAllocated.score(&half, 0), 50);
        let fuller = Resource {
            allocatable: 640,
            requested: 600,
        };
        assert!(Scoring::MostAllocated.score(&fuller, 8) > Scoring::MostAllocated.score(&half, 8));
        assert!(
            Scoring::LeastAllocated.score(&fuller, 8) < Scoring::LeastAllocated.score(&half, 8)
        );
    }

    #[test]
    fn kube_scheduler_looks_for_42_percent_of_1000_nodes_and_at_least_100() {
        assert_eq!(feasible_nodes_to_find(1_000), 420);
        assert_eq!(feasible_nodes_to_find(5_000), 500); // 10 %
        assert_eq!(feasible_nodes_to_find(100_000), 5_000); // the 5 % floor
        assert_eq!(feasible_nodes_to_find(150), 100);
        assert_eq!(feasible_nodes_to_find(60), 60);
    }

    #[test]
    fn the_highest_score_wins_and_ties_are_shared_out() {
        let mut kube = KubeScheduler::new(SplitMix64::new(1));
        let scores = [10, 50, 30, 50, 50];
        let mut wins = [0; 5];
        for _ in 0..3_000 {
            let node = kube.select(5, |_| true, |n| scores[n]).unwrap();
            wins[node] += 1;
        }
        assert_eq!((wins[0], wins[2]), (0, 0), "{wins:?}");
        for n in [1, 3, 4] {
            assert!((800..1_200).contains(&wins[n]), "{wins:?}");
        }
    }

    #[test]
    fn nodes_that_fail_the_filter_are_never_chosen() {
        let mut kube = KubeScheduler::new(SplitMix64::new(1));
        assert_eq!(kube.select(4, |n| n == 2, |_| 0), Some(2));
        assert_eq!(kube.select(4, |_| false, |_| 0), None);
        assert_eq!(kube.select(0, |_| true, |_| 0), None);
    }

    #[test]
    fn the_search_stops_at_enough_feasible_nodes_and_resumes_after_them() {
        let mut kube = KubeScheduler::new(SplitMix64::new(1));
        let mut seen = Vec::new();
        // 1,000 nodes, all feasible, all equal: 420 are looked at, from node 0.
        kube.select(
            1_000,
            |n| {
                seen.push(n);
                true
            },
            |_| 0,
        );
        assert_eq!(seen.len(), 420);
        assert_eq!((seen[0], seen[419]), (0, 419));
        seen.clear();
        // The next pod's search starts at node 420; the best node before it is not seen.
        let chosen = kube.select(
            1_000,
            |n| {
                seen.push(n);
                true
            },
            |n| u64::from(n == 5),
        );
        assert_eq!(seen[0], 420);
        assert_ne!(chosen, Some(5));
    }
}
