//! Memory that follows priority, the decisions: which low-priority leases to suspend
//! (lock and checkpoint through the driver) so that a high-priority need fits, and in
//! which order suspended leases come back. Pure functions over what the state knows;
//! the driver calls and the state's bookkeeping are elsewhere.
//!
//! A lease is suspended whole: a container's processes work together (a data loader
//! beside its trainer, NCCL ranks), and one left running against a suspended peer
//! would block in it anyway. A lease any of whose processes holds IPC or managed
//! memory is never chosen: the driver cannot checkpoint such a process (r570).

/// A low-priority lease that could be suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspendable {
    /// Device memory its processes hold on the GPU (what a checkpoint frees).
    pub bytes: u64,
    /// Every process of it can be checkpointed (no IPC, no managed memory).
    pub checkpointable: bool,
    /// When it was admitted, in the arbiter's order: larger is younger.
    pub admitted: u64,
}

/// The answer to "free `shortfall` bytes".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Victims {
    /// Suspend these (indices into the candidates), youngest first.
    Suspend(Vec<usize>),
    /// Even every checkpointable lease together frees only this much.
    NotEnough { reclaimable: u64 },
}

/// Candidates beyond this many largest are not searched exhaustively (C(16, k) ≤ 12,870
/// subsets for any k): the fewest suspensions are still found, as they only need the
/// largest; the least memory moved is then the best among these.
const SEARCHED: usize = 16;

/// The fewest leases whose memory together covers `shortfall`; among as few, the ones
/// that move the least memory (the quickest checkpoint and restore, the least taken
/// from low jobs); among those, the youngest (the oldest keep running).
pub fn choose_victims(shortfall: u64, candidates: &[Suspendable]) -> Victims {
    if shortfall == 0 {
        return Victims::Suspend(Vec::new());
    }
    let mut usable: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].checkpointable && candidates[i].bytes > 0)
        .collect();
    // Largest first; among equals, youngest first.
    usable.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        b.bytes.cmp(&a.bytes).then(b.admitted.cmp(&a.admitted))
    });
    let reclaimable: u64 = usable.iter().map(|&i| candidates[i].bytes).sum();
    if reclaimable < shortfall {
        return Victims::NotEnough { reclaimable };
    }
    // The k largest hold the most any k can: the first prefix that covers is the fewest.
    let mut covered = 0u64;
    let fewest = usable
        .iter()
        .position(|&i| {
            covered += candidates[i].bytes;
            covered >= shortfall
        })
        .map_or(usable.len(), |p| p + 1);
    usable.truncate(SEARCHED.max(fewest));
    let best = best_subset(shortfall, fewest, &usable, candidates);
    let mut chosen: Vec<usize> = best.into_iter().map(|p| usable[p]).collect();
    chosen.sort_by(|&a, &b| candidates[b].admitted.cmp(&candidates[a].admitted));
    Victims::Suspend(chosen)
}

/// Among the `k`-subsets of `usable` that cover `shortfall`, the one with the least
/// memory, then the youngest (largest sum of admission orders). Positions into `usable`.
fn best_subset(shortfall: u64, k: usize, usable: &[usize], c: &[Suspendable]) -> Vec<usize> {
    let n = usable.len();
    // Start from the largest k (they cover), then improve.
    let mut best: Vec<usize> = (0..k).collect();
    let key = |subset: &[usize]| {
        let bytes: u64 = subset.iter().map(|&p| c[usable[p]].bytes).sum();
        let age: u64 = subset.iter().map(|&p| c[usable[p]].admitted).sum();
        (bytes, std::cmp::Reverse(age))
    };
    let mut best_key = key(&best);
    let mut subset: Vec<usize> = (0..k).collect();
    loop {
        let k_now = key(&subset);
        if k_now.0 >= shortfall && k_now < best_key {
            best_key = k_now;
            best.clone_from(&subset);
        }
        // The next k-combination in lexicographic order.
        let Some(i) = (0..k).rev().find(|&i| subset[i] < n - k + i) else {
            return best;
        };
        subset[i] += 1;
        for j in i + 1..k {
            subset[j] = subset[j - 1] + 1;
        }
    }
}

/// A suspended lease waiting to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspended {
    /// What its restore needs free on the GPU.
    pub bytes: u64,
    /// When it was admitted: the oldest comes back first.
    pub admitted: u64,
}

/// Which suspended leases to restore now with `free` bytes: oldest first, each only
/// when it fits whole, and none past one that does not fit, so a large old lease is
/// never overtaken for ever by younger small ones. Indices into `suspended`.
pub fn restore_order(free: u64, suspended: &[Suspended]) -> Vec<usize> {
    let mut by_age: Vec<usize> = (0..suspended.len()).collect();
    by_age.sort_by_key(|&i| suspended[i].admitted);
    let mut left = free;
    let mut back = Vec::new();
    for i in by_age {
        if suspended[i].bytes > left {
            break;
        }
        left -= suspended[i].bytes;
        back.push(i);
    }
    back
}

/// Where a suspended lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SuspensionPhase {
    /// Chosen: its token is being revoked, its processes locked and checkpointed.
    Suspending,
    /// Off the GPU: its memory is free for others.
    Suspended,
    /// Its processes are being restored and unlocked.
    Restoring,
}

/// A lease the reclaim took, or is taking, off its GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Suspension {
    pub gpu: String,
    pub pids: Vec<u32>,
    /// What its processes held on the GPU when it was chosen.
    pub bytes: u64,
    pub phase: SuspensionPhase,
    pub since_unix_ms: u64,
}

pub mod journal;

#[cfg(test)]
mod tests;
