//! The device plugin's grants (Kubernetes): making, listing and releasing them,
//! placing the waiting ones as room frees, and binding them to the leases
//! reserved against them.
//!
//! A grant's binding (`Grant::lease`, and the GPU of a high or compute grant) is
//! kept in memory only: the store holds the grant without it and the leases' own
//! `pod.grants`, from which `Arbiter::open` derives it, so the two never disagree.

use gpushare_proto::grant::{Grant, GrantAmount, GrantId, GrantRequest};
use gpushare_proto::{Fraction, GpuSelector};
use gpushare_types::kubernetes::{COMPUTE_RESOURCE, HIGH_RESOURCE, MEMORY_RESOURCE};

use super::*;
use crate::grants::{place_memory_grant, resource_name};

/// Kubelet's device ids are opaque names it made up; this bounds what is logged
/// and stored for one.
const DEVICE_ID_MAX: usize = 128;

/// The runtime's annotations, named in the errors a container's owner reads.
const COMPUTE_REQUEST_ANNOTATION: &str = "gpushare.io/compute-request";
const GPU_ANNOTATION: &str = "gpushare.io/gpu";

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("grant request {field} = {value}: {accepted}")]
    Invalid {
        field: &'static str,
        value: String,
        accepted: &'static str,
    },
    #[error("grant {0} does not exist: its allocation is gone (released, superseded by a newer allocation of the same devices, or never made); kubelet allocates again when the pod is recreated")]
    Gone(GrantId),
    #[error("grants {first} and {second} are both {resource} grants: a container is reserved against at most one grant of each resource")]
    TwoOfAKind {
        first: GrantId,
        second: GrantId,
        resource: &'static str,
    },
    #[error("grant {grant} already backs lease {lease} of container {container:?}: a grant backs one live lease at a time")]
    InUse {
        grant: GrantId,
        lease: LeaseId,
        container: String,
    },
    #[error("grant request amount.bytes = {bytes}: a memory grant is placed on one GPU; accepted: at most the largest GPU's allocatable memory here, {largest} bytes")]
    BeyondEveryGpu { bytes: u64, largest: u64 },
    /// The request asks for more than, or something other than, its grants hold.
    #[error("{0}")]
    Exceeds(String),
}

impl GrantError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            GrantError::Gone(_) => ErrorKind::NotFound,
            GrantError::Invalid { .. }
            | GrantError::BeyondEveryGpu { .. }
            | GrantError::TwoOfAKind { .. }
            | GrantError::InUse { .. }
            | GrantError::Exceeds(_) => ErrorKind::InvalidRequest,
        }
    }
}

/// Pure: the checks a grant request must pass before anything is recorded.
pub fn validate(request: &GrantRequest) -> Result<(), GrantError> {
    if request.device_ids.is_empty() {
        return Err(GrantError::Invalid {
            field: "device_ids",
            value: "[]".into(),
            accepted: "at least one device id (kubelet's Allocate names the devices it allocated)",
        });
    }
    for id in &request.device_ids {
        let printable = !id.is_empty()
            && id.chars().count() <= DEVICE_ID_MAX
            && !id.chars().any(char::is_control);
        if !printable {
            return Err(GrantError::Invalid {
                field: "device_ids",
                value: format!("{id:?}"),
                accepted: "each device id must be 1 to 128 printable characters",
            });
        }
    }
    match request.amount {
        GrantAmount::Memory { bytes: 0 } => Err(GrantError::Invalid {
            field: "amount.bytes",
            value: "0".into(),
            accepted: "a memory grant holds more than 0 bytes",
        }),
        GrantAmount::Compute { percent } if !(1..=100).contains(&percent) => {
            Err(GrantError::Invalid {
                field: "amount.percent",
                value: percent.to_string(),
                accepted: "a compute grant holds 1 to 100 percent of one GPU",
            })
        }
        _ => Ok(()),
    }
}

/// Pure: whether `new` takes over `old`'s allocation: same resource, and a device
/// id in common (kubelet hands an id out again only once its pod is gone).
pub fn supersedes(new: &GrantRequest, old: &Grant) -> bool {
    std::mem::discriminant(&new.amount) == std::mem::discriminant(&old.amount)
        && new.device_ids.iter().any(|d| old.device_ids.contains(d))
}

/// What a container's grants decide about its lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Backing {
    /// The memory grant and its bytes: the lease's quota, on the grant's GPU.
    pub memory: Option<(GrantId, u64)>,
    /// The compute grant's share: the lease's compute request.
    pub compute: Option<Fraction>,
}

/// Pure: checks a reserve against the grants it names (found, not in use by
/// another lease) and says what they decide. The runtime passes the annotations
/// it read as they are, so each is checked against what the grants hold.
pub fn backing(request: &ReserveRequest, grants: &[&Grant]) -> Result<Backing, GrantError> {
    let mut memory: Option<&Grant> = None;
    let mut high: Option<&Grant> = None;
    let mut compute: Option<&Grant> = None;
    for &g in grants {
        let slot = match g.amount {
            GrantAmount::Memory { .. } => &mut memory,
            GrantAmount::High => &mut high,
            GrantAmount::Compute { .. } => &mut compute,
        };
        if let Some(first) = slot {
            return Err(GrantError::TwoOfAKind {
                first: first.id.clone(),
                second: g.id.clone(),
                resource: resource_name(&g.amount),
            });
        }
        *slot = Some(g);
    }
    if request.priority == Priority::High && high.is_none() {
        return Err(GrantError::Exceeds(format!(
            "priority high needs a {HIGH_RESOURCE} grant: the container was allocated only {} (ask for {HIGH_RESOURCE}: 1 in the pod's resources, or run at low priority)",
            named(grants)
        )));
    }
    let compute_share = match compute.map(|g| g.amount) {
        Some(GrantAmount::Compute { percent }) => {
            Some(Fraction::new(f64::from(percent) / 100.0).expect("validated as 1 to 100 percent"))
        }
        _ => None,
    };
    let asked = request.compute_request;
    match (compute, compute_share) {
        (Some(g), Some(share)) if asked > share => {
            return Err(GrantError::Exceeds(format!(
                "{COMPUTE_REQUEST_ANNOTATION} = {asked} asks for more than grant {} holds ({share})",
                g.id
            )))
        }
        (None, _) if asked > Fraction::ZERO => {
            return Err(GrantError::Exceeds(format!(
                "{COMPUTE_REQUEST_ANNOTATION} = {asked} needs a {COMPUTE_RESOURCE} grant: the container was allocated only {} (ask for {COMPUTE_RESOURCE} in the pod's resources)",
                named(grants)
            )))
        }
        _ => {}
    }
    let memory = match memory {
        Some(g) => {
            let GrantAmount::Memory { bytes } = g.amount else {
                unreachable!("sorted by kind above")
            };
            if request.gpu != GpuSelector::Count(1) {
                return Err(GrantError::Exceeds(format!(
                    "gpu {} with memory grant {}: the grant holds room on one GPU the node chose; drop the {GPU_ANNOTATION} annotation",
                    request.gpu, g.id
                )));
            }
            check_memory_request(request.memory, None, &g.id, bytes)?;
            Some((g.id.clone(), bytes))
        }
        None => None,
    };
    Ok(Backing {
        memory,
        compute: compute_share,
    })
}

/// Pure: a memory request (resolved against `gpu_total`, the grant's GPU, when
/// known) may not exceed the memory grant. A fraction is checked once the GPU is.
pub fn check_memory_request(
    asked: Option<MemoryRequest>,
    gpu_total: Option<u64>,
    grant: &GrantId,
    bytes: u64,
) -> Result<(), GrantError> {
    let resolved = match (asked, gpu_total) {
        (Some(MemoryRequest::Bytes(b)), _) => b,
        (Some(m @ MemoryRequest::Fraction(_)), Some(total)) => m.resolve(total),
        _ => return Ok(()),
    };
    if resolved > bytes {
        return Err(GrantError::Exceeds(format!(
            "{MEMORY_RESOURCE} = {} asks for more than grant {grant} holds ({})",
            asked.expect("matched Some above"),
            ByteSize(bytes)
        )));
    }
    Ok(())
}

fn named(grants: &[&Grant]) -> String {
    grants
        .iter()
        .map(|g| format!("{} ({})", g.id, resource_name(&g.amount)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The record a grant is stored as: without its binding, which is derived.
fn stored(grant: &Grant) -> Grant {
    let mut g = grant.clone();
    g.lease = None;
    if !matches!(g.amount, GrantAmount::Memory { .. }) {
        g.gpu = None;
    }
    g
}

/// 64 random bits, as lease ids are.
fn new_grant_id() -> GrantId {
    GrantId(format!("g-{}", new_lease_id().0))
}

impl Arbiter {
    /// Derives every grant's binding from the leases' `pod.grants` (at open).
    pub(super) fn bind_grants_from_leases(&mut self) {
        let bindings: Vec<(LeaseId, Vec<GrantId>, Option<String>)> = self
            .leases
            .values()
            .filter_map(|r| {
                let pod = r.lease.pod.as_ref()?;
                Some((
                    r.lease.id.clone(),
                    pod.grants.clone(),
                    r.lease.gpus.first().cloned(),
                ))
            })
            .collect();
        for (lease, grants, gpu) in bindings {
            for id in grants {
                if let Some(grant) = self.grants.get_mut(&id) {
                    if let Some(other) = &grant.lease {
                        tracing::warn!(grant = %id, lease = %lease, other = %other, "two reloaded leases name one grant; binding the later");
                    }
                    bind(grant, &lease, gpu.clone());
                }
            }
        }
    }

    /// Every grant, oldest first.
    pub fn grants(&self) -> Vec<Grant> {
        let mut grants: Vec<Grant> = self.grants.values().cloned().collect();
        grants.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
        grants
    }

    /// The grants as the store holds them (a recovery's snapshot).
    pub(super) fn stored_grants(&self) -> BTreeMap<GrantId, Grant> {
        self.grants
            .iter()
            .map(|(id, g)| (id.clone(), stored(g)))
            .collect()
    }

    pub fn grant(&self, id: &GrantId) -> Option<&Grant> {
        self.grants.get(id)
    }

    /// `ControlRequest::Grant`: supersedes the grants of the same resource whose
    /// device ids it shares, then places a memory grant (worst fit) or records it
    /// as waiting. Never refused for want of room.
    pub fn make_grant(
        &mut self,
        request: GrantRequest,
    ) -> Result<(Grant, Option<Ticket>), StateError> {
        validate(&request)?;
        if let GrantAmount::Memory { bytes } = request.amount {
            let largest = self.views().iter().map(|g| g.memory_allocatable).max();
            if let Some(largest) = largest.filter(|&largest| bytes > largest) {
                return Err(GrantError::BeyondEveryGpu { bytes, largest }.into());
            }
        }
        self.ensure_writable()?;
        let superseded: Vec<GrantId> = self
            .grants
            .values()
            .filter(|old| supersedes(&request, old))
            .map(|old| old.id.clone())
            .collect();
        for id in &superseded {
            // The new grant's record follows in the log: its ticket covers this one.
            let _ = self.append(Record::DeleteGrant { id: id.clone() })?;
            if let Some(old) = self.grants.remove(id) {
                tracing::info!(grant = %id, resource = resource_name(&old.amount), lease = ?old.lease.as_ref().map(|l| &l.0), devices = ?old.device_ids, "grant superseded: kubelet allocated its devices again (a lease reserved against it keeps running)");
            }
        }
        // Older waiting grants come first to the room the superseded ones left.
        if !superseded.is_empty() {
            self.place_waiting_grants();
        }
        let mut grant = Grant {
            id: new_grant_id(),
            amount: request.amount,
            device_ids: request.device_ids,
            gpu: None,
            lease: None,
            created_unix_ms: self.next_grant_time(),
        };
        if let GrantAmount::Memory { bytes } = grant.amount {
            let views = self.views();
            grant.gpu = place_memory_grant(bytes, &views).map(|i| views[i].uuid.to_owned());
        }
        let ticket = self.append(Record::PutGrant {
            grant: Box::new(stored(&grant)),
        })?;
        match &grant.gpu {
            Some(gpu) => {
                tracing::info!(grant = %grant.id, amount = ?grant.amount, gpu, "granted")
            }
            None => {
                tracing::info!(grant = %grant.id, amount = ?grant.amount, "granted; waiting for room")
            }
        }
        self.grants.insert(grant.id.clone(), grant.clone());
        if !superseded.is_empty() {
            self.run_admission();
        }
        Ok((grant, Some(ticket)))
    }

    /// Creation times strictly increase, so they order grants (oldest first, the
    /// order waiting grants are placed in) across restarts too.
    fn next_grant_time(&mut self) -> u64 {
        let newest = self
            .grants
            .values()
            .map(|g| g.created_unix_ms)
            .max()
            .unwrap_or(0);
        unix_ms().max(newest + 1)
    }

    /// Idempotent: whether the grant existed. A lease reserved against it keeps
    /// running; its room, if no lease used it, is free at once.
    pub fn release_grant(&mut self, id: &GrantId) -> Result<(bool, Option<Ticket>), StateError> {
        if !self.grants.contains_key(id) {
            return Ok((false, self.last_ticket));
        }
        self.ensure_writable()?;
        let ticket = self.append(Record::DeleteGrant { id: id.clone() })?;
        if let Some(g) = self.grants.remove(id) {
            tracing::info!(grant = %id, lease = ?g.lease.as_ref().map(|l| &l.0), "grant released");
        }
        self.run_admission();
        Ok((true, Some(ticket)))
    }

    /// Places waiting memory grants, oldest first, where room has freed. A grant
    /// that still does not fit does not hold back a younger, smaller one.
    pub(super) fn place_waiting_grants(&mut self) {
        let mut waiting: Vec<(u64, GrantId, u64)> = self
            .grants
            .values()
            .filter(|g| g.gpu.is_none())
            .filter_map(|g| match g.amount {
                GrantAmount::Memory { bytes } => Some((g.created_unix_ms, g.id.clone(), bytes)),
                _ => None,
            })
            .collect();
        waiting.sort();
        for (_, id, bytes) in waiting {
            let gpu = {
                let views = self.views();
                match place_memory_grant(bytes, &views) {
                    Some(i) => views[i].uuid.to_owned(),
                    None => continue,
                }
            };
            if let Err(e) = self.move_grant(&id, gpu.clone()) {
                // The store refuses changes: it stays waiting until it can write.
                tracing::warn!(grant = %id, error = %e, "could not record a waiting grant's placement");
                return;
            }
            tracing::info!(grant = %id, gpu, "placed a waiting grant");
        }
    }

    /// The grants a reserve names, looked up: each must exist and back no other
    /// live lease (a retry from the lease's own container never gets here).
    pub(super) fn named_grants(&self, request: &ReserveRequest) -> Result<Vec<&Grant>, GrantError> {
        let Some(pod) = &request.pod else {
            return Ok(Vec::new());
        };
        pod.grants
            .iter()
            .map(|id| {
                let grant = self
                    .grants
                    .get(id)
                    .ok_or_else(|| GrantError::Gone(id.clone()))?;
                match &grant.lease {
                    Some(lease) => Err(GrantError::InUse {
                        grant: id.clone(),
                        lease: lease.clone(),
                        container: self
                            .leases
                            .get(lease)
                            .map(|r| r.lease.container_id.clone())
                            .unwrap_or_default(),
                    }),
                    None => Ok(grant),
                }
            })
            .collect()
    }

    /// The bytes of the memory grant a reserve names, if it names one that exists:
    /// what it waits for (its own annotation is only checked against them).
    pub(super) fn granted_memory(&self, request: &ReserveRequest) -> Option<u64> {
        let pod = request.pod.as_ref()?;
        pod.grants
            .iter()
            .filter_map(|id| self.grants.get(id))
            .find_map(|g| match g.amount {
                GrantAmount::Memory { bytes } => Some(bytes),
                _ => None,
            })
    }

    /// The GPU a lease against memory grant `id` goes to: the grant's own when it
    /// can take the lease under the placement rules, else wherever the rules place
    /// the grant's bytes now (its own room counted free), the grant moving there.
    /// A NoFit waits in the admission queue like any other.
    pub(super) fn place_on_grant(
        &mut self,
        request: &ReserveRequest,
        id: &GrantId,
        bytes: u64,
    ) -> Result<usize, StateError> {
        let held_on = self.grants[id].gpu.clone();
        let chosen = {
            let mut views = self.views();
            let own = held_on
                .as_deref()
                .and_then(|gpu| views.iter().position(|v| v.uuid == gpu));
            if let Some(i) = own {
                views[i].memory_leased = views[i].memory_leased.saturating_sub(bytes);
            }
            let policy = self.policy();
            fn on<'a>(
                request: &'a ReserveRequest,
                bytes: u64,
                gpu: &'a GpuSelector,
            ) -> placement::Request<'a> {
                placement::Request {
                    priority: request.priority,
                    memory: MemoryRequest::Bytes(bytes),
                    gpu,
                    tenant: request.tenant.as_deref(),
                }
            }
            let stays = own.and_then(|i| {
                let mine = GpuSelector::Uuid(vec![views[i].uuid.to_owned()]);
                placement::place(&on(request, bytes, &mine), &views, &policy)
                    .ok()
                    .map(|_| i)
            });
            match stays {
                Some(i) => i,
                None => {
                    placement::place(&on(request, bytes, &GpuSelector::Count(1)), &views, &policy)?
                        .gpus[0]
                }
            }
        };
        let uuid = self.inventory.gpus[chosen].uuid.clone();
        check_memory_request(
            request.memory,
            Some(self.inventory.gpus[chosen].memory_allocatable),
            id,
            bytes,
        )?;
        placement::holds_a_process(bytes, self.overhead_estimate())?;
        if held_on.as_deref() != Some(uuid.as_str()) {
            // Its lease's record follows in the log: that ticket covers this one.
            let _ = self.move_grant(id, uuid.clone())?;
            tracing::info!(grant = %id, from = ?held_on, to = uuid, "moved a memory grant to where its container's lease can run");
        }
        Ok(chosen)
    }

    /// Records a memory grant's (new) GPU.
    pub(super) fn move_grant(&mut self, id: &GrantId, gpu: String) -> Result<Ticket, StateError> {
        let mut grant = self.grants[id].clone();
        grant.gpu = Some(gpu);
        let ticket = self.append(Record::PutGrant {
            grant: Box::new(stored(&grant)),
        })?;
        self.grants.insert(id.clone(), grant);
        Ok(ticket)
    }

    /// Binds the grants `lease` names to it (in memory: derived state).
    pub(super) fn bind_grants(&mut self, lease: &Lease) {
        let Some(pod) = &lease.pod else { return };
        for id in &pod.grants {
            if let Some(grant) = self.grants.get_mut(id) {
                bind(grant, &lease.id, lease.gpus.first().cloned());
            }
        }
    }

    /// The lease is gone: its grants keep their room for a restart of the container.
    pub(super) fn unbind_grants(&mut self, lease: &LeaseId) {
        for grant in self.grants.values_mut() {
            if grant.lease.as_ref() == Some(lease) {
                grant.lease = None;
                if !matches!(grant.amount, GrantAmount::Memory { .. }) {
                    grant.gpu = None;
                }
            }
        }
    }

    /// The bytes of placed memory grants no live lease uses, per GPU: room promised
    /// to a container not started yet.
    pub(super) fn unbound_grant_room(&self) -> impl Iterator<Item = (&str, u64)> {
        self.grants
            .values()
            .filter_map(|g| match (&g.amount, &g.gpu, &g.lease) {
                (GrantAmount::Memory { bytes }, Some(gpu), None) => Some((gpu.as_str(), *bytes)),
                _ => None,
            })
    }
}

fn bind(grant: &mut Grant, lease: &LeaseId, gpu: Option<String>) {
    grant.lease = Some(lease.clone());
    if !matches!(grant.amount, GrantAmount::Memory { .. }) {
        grant.gpu = gpu;
    }
}
