//! Which GPU(s) a request lands on: Wang et al., Algorithm 1 (`place`,
//! `[placement] policy = "wang"`), or the balanced policy (`balanced`).
//!
//! A pure function over a snapshot of the GPUs (`GpuView`), so every rule is
//! table-tested without a daemon, a driver or a clock.
//!
//! 1. Explicit requests (`index:`, `uuid:`), tenant reservations and drained GPUs
//!    narrow the candidates first (Xiao et al.).
//! 2. A high-priority request skips GPUs with too little free memory or with a
//!    high-priority lease already; a low-priority request skips GPUs with too
//!    little free memory, a last-minute utilisation above `gpu_util_limit`, or
//!    `low_nums_limit` low-priority leases already.
//! 3. Worst fit among the GPUs already in use: a high-priority job prefers the
//!    fewest low-priority jobs, then the most free memory; a low-priority job
//!    prefers GPUs running only low-priority work, then GPUs with a high-priority
//!    job, the fewest low-priority jobs and the most free memory.
//! 4. When no GPU in use fits, an unused GPU of the pool (most free memory first).
//!
//! Beyond Algorithm 1: a lease that spans several GPUs runs ungated (a time-slice
//! token covers one GPU, and a grant on each GPU separately could deadlock a
//! collective operation), so a high-priority job is never placed beside one, and
//! one is never placed beside a high-priority job: nothing would protect the high
//! job's time from it.
//!
//! `NoFit` is transient (the request may wait in the admission queue); every
//! other error can never succeed on this node and fails at once.

use std::cmp::Reverse;
use std::fmt;

use gpushare_proto::{ByteSize, GpuSelector, MemoryRequest, Priority};

pub mod balanced;
pub use balanced::{place_balanced, Balanced};

/// One GPU as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuView<'a> {
    pub index: u32,
    pub uuid: &'a str,
    /// What CUDA can allocate on this GPU (NVML's total less the driver's reserve): the
    /// most its leases' quotas may add up to, and what a fraction of a GPU is of.
    pub memory_allocatable: u64,
    /// Sum of the quotas of the leases on this GPU.
    pub memory_leased: u64,
    /// With memory reclaim on: which part of `memory_leased` is lent (quotas of
    /// low-priority leases the arbiter can checkpoint off the GPU) and how far lent
    /// quotas may over-commit. None: every quota is guaranteed.
    pub lending: Option<Lending>,
    pub high_leases: u32,
    pub low_leases: u32,
    /// Leases on this GPU that span several GPUs, and so run ungated.
    pub ungated_leases: u32,
    /// Mean utilisation (0–1) over the last minute.
    pub utilization: f64,
    pub drained: bool,
    pub reserved_for: Option<&'a str>,
}

/// Memory lent to low-priority leases on one GPU (memory reclaim on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lending {
    /// Quotas of the low-priority leases that may be checkpointed (a part of
    /// `memory_leased`; the rest is guaranteed).
    pub lent: u64,
    /// How far lent quotas may add up beyond the memory guaranteed leases leave
    /// (`memory.low_overcommit`, at least 1).
    pub overcommit: f64,
}

impl GpuView<'_> {
    /// Room for more quotas, ignoring lending (what status and the preferences see).
    pub fn memory_free(&self) -> u64 {
        self.memory_allocatable.saturating_sub(self.memory_leased)
    }

    /// Room for a quota of `priority`. With lending, a high-priority quota needs only
    /// the memory no guaranteed lease holds (the lent memory is reclaimed when needed);
    /// a low-priority one shares `overcommit` times that with the lent quotas, and
    /// one quota never exceeds what is left to lend.
    pub fn memory_free_for(&self, priority: Priority) -> u64 {
        let Some(lending) = self.lending else {
            return self.memory_free();
        };
        let guaranteed = self.memory_leased.saturating_sub(lending.lent);
        let unguaranteed = self.memory_allocatable.saturating_sub(guaranteed);
        match priority {
            Priority::High => unguaranteed,
            Priority::Low => {
                let budget = (unguaranteed as f64 * lending.overcommit.max(1.0)) as u64;
                budget.saturating_sub(lending.lent).min(unguaranteed)
            }
        }
    }

    fn in_use(&self) -> bool {
        self.high_leases + self.low_leases > 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub gpu_util_limit: f64,
    pub low_nums_limit: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request<'a> {
    pub priority: Priority,
    pub memory: MemoryRequest,
    pub gpu: &'a GpuSelector,
    pub tenant: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Indices into the view slice, in the order chosen.
    pub gpus: Vec<usize>,
    /// Per GPU; a fraction is resolved against the smallest chosen GPU, so one
    /// quota fits on each of them.
    pub memory_bytes: u64,
}

/// Why one GPU was passed over.
#[derive(Debug, Clone, PartialEq)]
pub enum Skip {
    Drained,
    ReservedForAnotherTenant(String),
    TooLittleMemory {
        wanted: u64,
        free: u64,
    },
    HasHighPriorityLease,
    /// A high-priority request, and the GPU runs a multi-GPU lease (ungated).
    RunsUngatedLease,
    /// A multi-GPU request (it would run ungated), and the GPU runs a high-priority job.
    WouldRunUngatedBesideHigh,
    Busy {
        utilization: f64,
        limit: f64,
    },
    TooManyLowPriorityLeases {
        leases: u32,
        limit: u32,
    },
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::Drained => write!(f, "drained"),
            Skip::ReservedForAnotherTenant(t) => write!(f, "reserved for tenant {t:?}"),
            Skip::TooLittleMemory { wanted, free } => {
                write!(f, "{} free, {} wanted", ByteSize(*free), ByteSize(*wanted))
            }
            Skip::HasHighPriorityLease => write!(f, "already runs a high-priority job"),
            Skip::RunsUngatedLease => write!(
                f,
                "runs a multi-GPU lease, which is not time-sliced: nothing would protect a high-priority job from it"
            ),
            Skip::WouldRunUngatedBesideHigh => write!(
                f,
                "runs a high-priority job, and a multi-GPU lease is not time-sliced: nothing would protect that job from it"
            ),
            Skip::Busy { utilization, limit } => write!(
                f,
                "{:.0}% busy over the last minute (low priority allowed up to {:.0}%)",
                utilization * 100.0,
                limit * 100.0
            ),
            Skip::TooManyLowPriorityLeases { leases, limit } => {
                write!(f, "{leases} low-priority jobs already (limit {limit})")
            }
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlacementError {
    #[error("gpu {selector}: this node has no GPU {what}")]
    NoSuchGpu { selector: String, what: String },
    #[error("gpu count:{wanted}: only {available} GPU(s) on this node are open to {whom}")]
    TooFewGpus {
        wanted: usize,
        available: usize,
        whom: String,
    },
    #[error("gpu {gpu} is reserved for tenant {owner:?}; this request is from {whom}")]
    ReservedGpu {
        gpu: String,
        owner: String,
        whom: String,
    },
    #[error("memory {} per GPU is more than any candidate GPU has ({} at most)", ByteSize(*wanted), ByteSize(*largest))]
    NeverFits { wanted: u64, largest: u64 },
    #[error("memory {} per GPU cannot hold even one CUDA process: a process's own overhead (context, modules) is charged to its lease, estimated at {} (arbiter.context_memory_estimate); ask for more than that", ByteSize(*quota), ByteSize(*overhead))]
    BelowProcessOverhead { quota: u64, overhead: u64 },
    /// Transient: the request may fit after a release.
    #[error("no GPU can take {request} now: {}", reasons.join("; "))]
    NoFit {
        request: String,
        reasons: Vec<String>,
    },
}

impl PlacementError {
    /// Worth waiting in the admission queue for.
    pub fn is_transient(&self) -> bool {
        matches!(self, PlacementError::NoFit { .. })
    }
}

/// Why `gpu` cannot take `wanted` bytes for a request of `priority` spanning
/// `spans` GPUs (Algorithm 1's skip rules, and the ungated multi-GPU lease's).
pub fn skip_reason(
    gpu: &GpuView,
    priority: Priority,
    spans: usize,
    wanted: u64,
    policy: &Policy,
) -> Option<Skip> {
    if let Some(skip) = hard_skip_reason(gpu, priority, spans, wanted) {
        return Some(skip);
    }
    match priority {
        Priority::High => None,
        Priority::Low if gpu.utilization > policy.gpu_util_limit => Some(Skip::Busy {
            utilization: gpu.utilization,
            limit: policy.gpu_util_limit,
        }),
        Priority::Low if gpu.low_leases >= policy.low_nums_limit => {
            Some(Skip::TooManyLowPriorityLeases {
                leases: gpu.low_leases,
                limit: policy.low_nums_limit,
            })
        }
        Priority::Low => None,
    }
}

/// The rules every policy keeps: drained GPUs, room for the quota, one
/// high-priority lease per GPU, and no ungated multi-GPU lease beside a
/// high-priority job (either way round).
pub fn hard_skip_reason(
    gpu: &GpuView,
    priority: Priority,
    spans: usize,
    wanted: u64,
) -> Option<Skip> {
    if gpu.drained {
        return Some(Skip::Drained);
    }
    if spans > 1 && gpu.high_leases > 0 {
        return Some(Skip::WouldRunUngatedBesideHigh);
    }
    if priority == Priority::High && gpu.ungated_leases > 0 {
        return Some(Skip::RunsUngatedLease);
    }
    let free = gpu.memory_free_for(priority);
    if wanted > free {
        return Some(Skip::TooLittleMemory { wanted, free });
    }
    if priority == Priority::High && gpu.high_leases > 0 {
        return Some(Skip::HasHighPriorityLease);
    }
    None
}

/// Worst-fit preference among GPUs in use: smaller sorts first.
fn worst_fit_key(gpu: &GpuView, priority: Priority) -> (bool, u32, Reverse<u64>, u32) {
    // Eligible GPUs never hold a high-priority lease for a high-priority request,
    // so for it the first component is always false and the order is: fewest
    // low-priority jobs, most free memory. A low-priority request prefers GPUs
    // with only low-priority work, then those with a high-priority job.
    let has_high = match priority {
        Priority::High => false,
        Priority::Low => gpu.high_leases > 0,
    };
    (
        has_high,
        gpu.low_leases,
        Reverse(gpu.memory_free()),
        gpu.index,
    )
}

fn whom(tenant: Option<&str>) -> String {
    match tenant {
        Some(t) => format!("tenant {t:?}"),
        None => "requests without a tenant".into(),
    }
}

/// The per-process headroom placement keeps. Each process's overhead (its
/// context, modules, ...) is charged *within* its lease's quota, so quotas that
/// add up to the GPU still add up to what `nvidia-smi` can show: no memory beyond
/// the quotas needs setting aside on the GPU. What is left to check is the lease
/// itself: a quota no larger than one process's estimated overhead could never
/// hold a process that allocates anything, and is refused at once rather than
/// granted and failed inside the driver later. `overhead` 0 (not accounted)
/// accepts every quota.
pub fn holds_a_process(quota: u64, overhead: u64) -> Result<(), PlacementError> {
    if overhead > 0 && quota <= overhead {
        return Err(PlacementError::BelowProcessOverhead { quota, overhead });
    }
    Ok(())
}

pub fn place(
    request: &Request,
    gpus: &[GpuView],
    policy: &Policy,
) -> Result<Placement, PlacementError> {
    let screened = screen(request, gpus, |gpu, spans, wanted| {
        skip_reason(gpu, request.priority, spans, wanted, policy)
    })?;
    let chosen = match screened.named() {
        Some(named) => named,
        None => {
            let (mut in_use, mut unused): (Vec<usize>, Vec<usize>) =
                screened.eligible.iter().partition(|&&i| gpus[i].in_use());
            in_use.sort_by_key(|&i| worst_fit_key(&gpus[i], request.priority));
            // The pool fallback: an unused GPU, the roomiest first.
            unused.sort_by_key(|&i| (Reverse(gpus[i].memory_free()), gpus[i].index));
            in_use
                .into_iter()
                .chain(unused)
                .take(screened.wanted_count)
                .collect()
        }
    };
    screened.finish(request, gpus, chosen)
}

/// The candidates of a request after every policy's common narrowing: the GPUs
/// the selector and tenant allow, and which of them pass the policy's skip rules.
pub(crate) struct Screened {
    candidates: Vec<usize>,
    /// Candidates no skip rule excluded, in candidate order.
    pub(crate) eligible: Vec<usize>,
    reasons: Vec<String>,
    explicit: bool,
    pub(crate) wanted_count: usize,
}

impl Screened {
    /// For `index:`/`uuid:`: all-or-nothing, the named GPUs in the order named
    /// (empty when one is excluded). None for `count:`, which the policy orders.
    pub(crate) fn named(&self) -> Option<Vec<usize>> {
        self.explicit.then(|| {
            if self.eligible.len() == self.candidates.len() {
                self.candidates.clone()
            } else {
                Vec::new()
            }
        })
    }

    pub(crate) fn finish(
        self,
        request: &Request,
        gpus: &[GpuView],
        chosen: Vec<usize>,
    ) -> Result<Placement, PlacementError> {
        if chosen.len() < self.wanted_count {
            return Err(PlacementError::NoFit {
                request: describe(request),
                reasons: self.reasons,
            });
        }
        let memory_bytes = chosen
            .iter()
            .map(|&i| request.memory.resolve(gpus[i].memory_allocatable))
            .min()
            .unwrap_or(0);
        Ok(Placement {
            gpus: chosen,
            memory_bytes,
        })
    }
}

/// Narrows by selector and tenant, refuses what can never fit, and applies
/// `skip(gpu, spans, wanted bytes)` to each candidate.
pub(crate) fn screen(
    request: &Request,
    gpus: &[GpuView],
    skip: impl Fn(&GpuView, usize, u64) -> Option<Skip>,
) -> Result<Screened, PlacementError> {
    let candidates = candidates(request, gpus)?;
    let wanted_count = request.gpu.gpu_count();
    let bytes_on = |i: usize| request.memory.resolve(gpus[i].memory_allocatable);

    // A quota larger than the GPU itself never fits, however long it waits.
    let explicit = !matches!(request.gpu, GpuSelector::Count(_));
    let largest = candidates
        .iter()
        .map(|&i| gpus[i].memory_allocatable)
        .max()
        .unwrap_or(0);
    let too_big = |i: usize| bytes_on(i) > gpus[i].memory_allocatable;
    let never = if explicit {
        candidates.iter().copied().find(|&i| too_big(i))
    } else {
        let fitting = candidates.iter().filter(|&&i| !too_big(i)).count();
        (fitting < wanted_count).then(|| candidates.first().copied().unwrap_or(0))
    };
    if let Some(i) = never {
        if !candidates.is_empty() {
            return Err(PlacementError::NeverFits {
                wanted: bytes_on(i),
                largest,
            });
        }
    }

    let mut reasons = Vec::new();
    let mut eligible = Vec::new();
    for &i in &candidates {
        match skip(&gpus[i], wanted_count, bytes_on(i)) {
            None => eligible.push(i),
            Some(skip) => reasons.push(format!("GPU {} ({}): {skip}", gpus[i].index, gpus[i].uuid)),
        }
    }
    Ok(Screened {
        candidates,
        eligible,
        reasons,
        explicit,
        wanted_count,
    })
}

/// Memory fragmentation kept a request of `count` GPUs × `wanted` bytes out:
/// fewer than `count` of the open GPUs (`free`: each one's free memory) have
/// `wanted` free, yet their free memory added up would hold all of it.
pub fn memory_fragmented(free: &[u64], wanted: u64, count: usize) -> bool {
    let roomy = free.iter().filter(|&&f| f >= wanted).count();
    let total: u128 = free.iter().map(|&f| u128::from(f)).sum();
    roomy < count && total >= u128::from(wanted) * count as u128
}

/// "a high-priority request for 4Gi" (on any one GPU), "… for 4Gi on index:1".
pub fn describe(request: &Request) -> String {
    // `count:1` is what every request asks unless it says otherwise: naming it only
    // reads as jargon. Any other selector is said as the request spelled it.
    let on = match request.gpu {
        GpuSelector::Count(1) => String::new(),
        other => format!(" on {other}"),
    };
    format!(
        "a {}-priority request for {}{}{}",
        request.priority,
        request.memory,
        on,
        request
            .tenant
            .map(|t| format!(" from tenant {t:?}"))
            .unwrap_or_default()
    )
}

/// Narrowing by selector and tenant reservation; indices into `gpus`.
fn candidates(request: &Request, gpus: &[GpuView]) -> Result<Vec<usize>, PlacementError> {
    let selector = request.gpu;
    let open_to_tenant = |g: &GpuView| g.reserved_for.is_none() || g.reserved_for == request.tenant;
    let missing = |what: String| PlacementError::NoSuchGpu {
        selector: selector.to_string(),
        what,
    };
    let check_reserved = |i: usize| {
        let g = &gpus[i];
        if open_to_tenant(g) {
            Ok(i)
        } else {
            Err(PlacementError::ReservedGpu {
                gpu: g.uuid.to_owned(),
                owner: g.reserved_for.unwrap_or_default().to_owned(),
                whom: whom(request.tenant),
            })
        }
    };
    match selector {
        GpuSelector::Count(n) => {
            let open: Vec<usize> = (0..gpus.len())
                .filter(|&i| open_to_tenant(&gpus[i]))
                .collect();
            if (*n as usize) > open.len() {
                return Err(PlacementError::TooFewGpus {
                    wanted: *n as usize,
                    available: open.len(),
                    whom: whom(request.tenant),
                });
            }
            Ok(open)
        }
        GpuSelector::Index(indices) => indices
            .iter()
            .map(|&want| {
                gpus.iter()
                    .position(|g| g.index == want)
                    .ok_or_else(|| missing(format!("with index {want}")))
                    .and_then(check_reserved)
            })
            .collect(),
        GpuSelector::Uuid(uuids) => uuids
            .iter()
            .map(|want| {
                gpus.iter()
                    .position(|g| g.uuid == want)
                    .ok_or_else(|| missing(want.clone()))
                    .and_then(check_reserved)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
