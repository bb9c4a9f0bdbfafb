//! Which GPU(s) a request lands on.
//!
//! This first placement only honours explicit selections and memory: among the
//! candidates with room for the quota it takes the least-leased, then the one with
//! the most free memory. Wang et al.'s Algorithm 1 (priority and utilisation
//! rules, worst fit, the admission queue) replaces it with the full arbiter.

use gpushare_proto::{GpuSelector, MemoryRequest};

use crate::inventory::Gpu;

/// What one GPU already carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuLoad {
    pub leases: usize,
    pub memory_leased: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Indices into the inventory slice.
    pub gpus: Vec<usize>,
    pub memory_bytes: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("gpu {selector}: this node has no GPU {what}")]
    NoSuchGpu { selector: String, what: String },
    #[error("gpu count:{wanted}: this node shares only {available} GPU(s)")]
    TooFewGpus { wanted: usize, available: usize },
    #[error("memory {wanted} bytes per GPU does not fit: {free}")]
    NoRoom { wanted: u64, free: String },
}

pub fn place(
    gpu: &GpuSelector,
    memory: MemoryRequest,
    inventory: &[Gpu],
    loads: &[GpuLoad],
) -> Result<Placement, PlacementError> {
    debug_assert_eq!(inventory.len(), loads.len());
    let candidates = candidates(gpu, inventory)?;
    // A fractional quota is resolved against the smallest candidate, so a
    // multi-GPU lease carries one quota that fits on each of its GPUs.
    let smallest = candidates
        .iter()
        .map(|&i| inventory[i].memory_total)
        .min()
        .unwrap_or(0);
    let memory_bytes = memory.resolve(smallest);
    let fits = |&i: &usize| {
        inventory[i]
            .memory_total
            .saturating_sub(loads[i].memory_leased)
            >= memory_bytes
    };
    let wanted = gpu.gpu_count();

    let chosen: Vec<usize> = match gpu {
        GpuSelector::Count(_) => {
            let mut fitting: Vec<usize> = candidates.iter().copied().filter(fits).collect();
            fitting.sort_by_key(|&i| {
                (
                    loads[i].leases,
                    std::cmp::Reverse(free(i, inventory, loads)),
                    i,
                )
            });
            fitting.truncate(wanted);
            fitting
        }
        // Explicit choices are all-or-nothing.
        _ if candidates.iter().all(fits) => candidates.clone(),
        _ => Vec::new(),
    };
    if chosen.len() < wanted {
        let free = candidates
            .iter()
            .map(|&i| {
                format!(
                    "{} has {} bytes free",
                    inventory[i].uuid,
                    free(i, inventory, loads)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(PlacementError::NoRoom {
            wanted: memory_bytes,
            free,
        });
    }
    Ok(Placement {
        gpus: chosen,
        memory_bytes,
    })
}

fn free(i: usize, inventory: &[Gpu], loads: &[GpuLoad]) -> u64 {
    inventory[i]
        .memory_total
        .saturating_sub(loads[i].memory_leased)
}

fn candidates(gpu: &GpuSelector, inventory: &[Gpu]) -> Result<Vec<usize>, PlacementError> {
    let missing = |what: String| PlacementError::NoSuchGpu {
        selector: gpu.to_string(),
        what,
    };
    match gpu {
        GpuSelector::Count(n) => {
            if (*n as usize) > inventory.len() {
                return Err(PlacementError::TooFewGpus {
                    wanted: *n as usize,
                    available: inventory.len(),
                });
            }
            Ok((0..inventory.len()).collect())
        }
        GpuSelector::Index(indices) => indices
            .iter()
            .map(|&want| {
                inventory
                    .iter()
                    .position(|g| g.index == want)
                    .ok_or_else(|| missing(format!("with index {want}")))
            })
            .collect(),
        GpuSelector::Uuid(uuids) => uuids
            .iter()
            .map(|want| {
                inventory
                    .iter()
                    .position(|g| &g.uuid == want)
                    .ok_or_else(|| missing(want.clone()))
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn inventory() -> Vec<Gpu> {
        (0..3)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i}"),
                name: "t".into(),
                memory_total: 16 * GI,
            })
            .collect()
    }

    fn load(leases: usize, gib: u64) -> GpuLoad {
        GpuLoad {
            leases,
            memory_leased: gib * GI,
        }
    }

    #[test]
    fn count_prefers_least_leased_then_most_free() {
        let inv = inventory();
        let loads = [load(1, 4), load(0, 0), load(0, 2)];
        let p = place(
            &GpuSelector::Count(1),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![1]);
        let p = place(
            &GpuSelector::Count(2),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![1, 2]);
    }

    #[test]
    fn memory_must_fit() {
        let inv = inventory();
        let loads = [load(1, 15), load(1, 15), load(1, 8)];
        let p = place(
            &GpuSelector::Count(1),
            MemoryRequest::Bytes(8 * GI),
            &inv,
            &loads,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![2]);
        let err = place(
            &GpuSelector::Count(1),
            MemoryRequest::Bytes(9 * GI),
            &inv,
            &loads,
        )
        .unwrap_err();
        assert!(matches!(err, PlacementError::NoRoom { .. }), "{err}");
    }

    #[test]
    fn fractions_resolve_against_the_gpu() {
        let inv = inventory();
        let quarter = "25%".parse().unwrap();
        let p = place(&GpuSelector::Count(1), quarter, &inv, &[load(0, 0); 3]).unwrap();
        assert_eq!(p.memory_bytes, 4 * GI);
    }

    #[test]
    fn explicit_selection_is_all_or_nothing() {
        let inv = inventory();
        let loads = [load(0, 0), load(0, 16), load(0, 0)];
        let p = place(
            &GpuSelector::Index(vec![2, 0]),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![2, 0]);
        assert!(place(
            &GpuSelector::Index(vec![0, 1]),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads
        )
        .is_err());
        let p = place(
            &GpuSelector::Uuid(vec!["GPU-2".into()]),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![2]);
    }

    #[test]
    fn unknown_gpus_are_named() {
        let inv = inventory();
        let loads = [load(0, 0); 3];
        let err = place(
            &GpuSelector::Index(vec![7]),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "gpu index:7: this node has no GPU with index 7"
        );
        let err = place(
            &GpuSelector::Uuid(vec!["GPU-x".into()]),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap_err();
        assert!(err.to_string().contains("GPU-x"));
        let err = place(
            &GpuSelector::Count(4),
            MemoryRequest::Bytes(GI),
            &inv,
            &loads,
        )
        .unwrap_err();
        assert_eq!(
            err,
            PlacementError::TooFewGpus {
                wanted: 4,
                available: 3
            }
        );
    }
}
