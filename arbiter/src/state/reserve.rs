//! Reserving: the admission queue, placement and granting, and the requesters
//! that went away while they waited.

use super::batch_admission::BatchPlan;
use super::*;
use gpushare_proto::Fraction;

/// Pure: the compute shares of a reserve as the control socket carried them. The
/// wire's `Fraction` is any JSON number, so a request of `-5` or a limit below
/// the request reaches the arbiter unless it is refused here.
pub(super) fn check_compute_shares(request: &ReserveRequest) -> Result<(), StateError> {
    const SHARE: &str = "a share of one GPU from 0 to 1 (0.4, 40%)";
    for (field, value) in [
        ("compute_request", request.compute_request.get()),
        ("compute_limit", request.compute_limit.get()),
    ] {
        if Fraction::new(value).is_none() {
            return Err(StateError::BadRequest {
                request: "reserve",
                field,
                value: value.to_string(),
                accepted: SHARE,
            });
        }
    }
    if request.compute_limit.get() < request.compute_request.get() {
        return Err(StateError::BadRequest {
            request: "reserve",
            field: "compute_limit",
            value: format!(
                "{} (below compute_request = {})",
                request.compute_limit, request.compute_request
            ),
            accepted: "a limit at least the request",
        });
    }
    Ok(())
}

impl Arbiter {
    // ----- requesters that went away -----

    /// Removes the waiters whose requester disconnected (its control connection
    /// dropped the reply), so they take no lease nobody would be told about.
    /// Returns how many.
    pub fn withdraw_abandoned(&mut self) -> usize {
        let gone: Vec<u64> = self
            .queue
            .iter()
            .filter(|w| w.item.reply.is_closed())
            .map(|w| w.seq)
            .collect();
        for seq in &gone {
            if let Some(w) = self.queue.remove(*seq) {
                tracing::info!(container = %w.item.request.container_id, waited_ms = w.arrived.elapsed().as_millis() as u64, "withdrew a queued reserve: its requester disconnected");
            }
        }
        if !gone.is_empty() {
            // A withdrawn high-priority waiter may have held back low ones.
            self.run_admission();
        }
        gone.len()
    }

    /// A grant whose requester disconnected as it was made: nobody was told, so
    /// a lease created for it is released. A retry's existing lease is not touched.
    pub fn take_back_grant(&mut self, granted: &Granted) {
        if !granted.fresh {
            return;
        }
        let id = &granted.lease.id;
        if self
            .undurable
            .get(id)
            .is_some_and(|t| self.store.has_failed(*t))
        {
            self.take_back_lost(id);
            self.run_admission();
            return;
        }
        match self.release(id) {
            Ok(_) => {
                tracing::info!(lease = %id, container = %granted.lease.container_id, "released a lease granted as its requester disconnected")
            }
            Err(e) => {
                tracing::warn!(lease = %id, error = %e, "could not release a lease whose requester disconnected; reconciliation will")
            }
        }
    }

    // ----- reserve, confirm, release -----

    /// Validates and queues a reserve, then runs an admission pass: the reply
    /// arrives at once when the request fits (or can never fit), else when a
    /// release makes room or the admission bound passes.
    pub fn submit(&mut self, request: ReserveRequest, now: Instant) -> ReserveReply {
        let (tx, rx) = oneshot::channel();
        let id_ok = !request.container_id.is_empty()
            && request.container_id.len() <= 1024
            && !request.container_id.chars().any(char::is_control);
        if !id_ok {
            let _ = tx.send(Err(StateError::BadContainerId(request.container_id)));
            return rx;
        }
        if let Err(e) = check_compute_shares(&request) {
            let _ = tx.send(Err(e));
            return rx;
        }
        let priority = request.priority;
        let bound = self.config.admission_wait();
        self.queue.push(
            priority,
            now,
            bound,
            Waiter {
                request,
                reply: tx,
                counted_fragmented: Default::default(),
                batch: Default::default(),
            },
        );
        self.run_admission();
        rx
    }

    /// Blocking convenience for tests and tools: submit, then take the answer
    /// if it came at once.
    pub fn reserve_now(&mut self, request: ReserveRequest) -> Result<Granted, StateError> {
        let mut rx = self.submit(request, Instant::now());
        match rx.try_recv() {
            Ok(answer) => answer,
            Err(_) => Err(StateError::QueueTimeout {
                waited_ms: 0,
                reason: "the request is waiting in the admission queue".into(),
                free: self.free_summary(),
            }),
        }
    }

    pub(super) fn run_admission(&mut self) {
        // Grants first: kube-scheduler already counted them against the node.
        self.place_waiting_grants();
        loop {
            if self.queue.is_empty() {
                return;
            }
            // Off the lock, the queue waits for the search's outcome.
            if self.placement.batch && self.queue.len() > 1 && !self.plan_batch() {
                return;
            }
            let mut queue = std::mem::take(&mut self.queue);
            let left = queue.admit(|w: &Waiter| {
                if w.reply.is_closed() {
                    // Its requester is gone: nobody would be told of a lease.
                    return Attempt::Failed(StateError::RequesterGone);
                }
                let plan = w.batch.replace(BatchPlan::Alone);
                if plan == BatchPlan::Waits {
                    return Attempt::Wait;
                }
                let on = match plan {
                    BatchPlan::On(gpu) => Some(gpu),
                    _ => None,
                };
                let granted = match self.try_grant(&w.request, on) {
                    // The planned GPU no longer takes it: one at a time, as without the batch.
                    Err(StateError::Placement(e)) if e.is_transient() && on.is_some() => {
                        self.try_grant(&w.request, None)
                    }
                    other => other,
                };
                match granted {
                    Ok(granted) => Attempt::Admitted(granted),
                    Err(StateError::Placement(e)) if e.is_transient() => {
                        if !w.counted_fragmented.get()
                            && self.waits_for_fragmented_memory(&w.request)
                        {
                            w.counted_fragmented.set(true);
                            self.admission_record.waited_for_fragmented_memory();
                        }
                        Attempt::Wait
                    }
                    Err(e) => Attempt::Failed(e),
                }
            });
            self.queue = queue;
            let mut untold = Vec::new();
            for (waiter, answer) in left {
                if let Ok(g) = &answer {
                    tracing::info!(lease = %g.lease.id, container = %g.lease.container_id, gpus = ?g.lease.gpus, memory = g.lease.memory_bytes, priority = %g.lease.priority, waited_ms = waiter.arrived.elapsed().as_millis() as u64, "reserved");
                }
                // The requester went away after the check above: take a lease
                // created for it back (a retry's existing lease stays).
                if let Err(Ok(granted)) = waiter.item.reply.send(answer) {
                    if granted.fresh {
                        untold.push(granted.lease.id);
                    }
                }
            }
            if untold.is_empty() {
                return;
            }
            for id in &untold {
                // Not through release: that would recurse into admission.
                match self.release_quietly(id) {
                    Ok(()) => {
                        tracing::info!(lease = %id, "released a lease granted as its requester disconnected")
                    }
                    Err(e) => {
                        tracing::warn!(lease = %id, error = %e, "could not release a lease whose requester disconnected; reconciliation will")
                    }
                }
            }
            // The room released may admit others: go round again.
        }
    }
    /// Places and records one lease (not yet durable: see `Granted::ticket`).
    /// `on`: the inventory GPU the batch search chose for it (None: the policy decides).
    fn try_grant(
        &mut self,
        request: &ReserveRequest,
        on: Option<usize>,
    ) -> Result<Granted, StateError> {
        // A retried reserve for the same container (a wrapper that timed out after
        // the arbiter answered) gets its existing lease, not a second one.
        let key = (request.namespace.clone(), request.container_id.clone());
        if let Some(id) = self.by_container.get(&key) {
            return Ok(Granted {
                lease: self.leases[id].lease.clone(),
                ticket: self.last_ticket,
                fresh: false,
            });
        }
        // Before anything is created: a change the store cannot write leaves nothing.
        self.ensure_writable()?;
        let backing = match request.pod.as_ref().filter(|p| !p.grants.is_empty()) {
            Some(_) => Some(grants::backing(request, &self.named_grants(request)?)?),
            None => None,
        };
        let memory_grant = backing.as_ref().and_then(|b| b.memory.clone());
        let memory = self.memory_request(request);
        let chosen = if let Some((grant, bytes)) = memory_grant {
            let gpu = self.place_on_grant(request, &grant, bytes)?;
            placement::Placement {
                gpus: vec![gpu],
                memory_bytes: bytes,
            }
        } else {
            let r = placement::Request {
                priority: request.priority,
                memory,
                gpu: &request.gpu,
                tenant: request.tenant.as_deref(),
            };
            let started = Instant::now();
            let decided = match on {
                Some(gpu) => self.decide_on(&r, gpu),
                None => self.decide(&r, request.compute_request.get()),
            };
            self.admission_record.placement_decided(started.elapsed());
            let p = decided?;
            placement::holds_a_process(p.memory_bytes, self.overhead_estimate())?;
            placement::Placement {
                gpus: p.gpus,
                memory_bytes: p.memory_bytes,
            }
        };
        let lease = Lease {
            id: new_lease_id(),
            container_id: request.container_id.clone(),
            namespace: request.namespace.clone(),
            sandbox_id: request.sandbox_id.clone(),
            gpus: chosen
                .gpus
                .iter()
                .map(|&i| self.inventory.gpus[i].uuid.clone())
                .collect(),
            priority: request.priority,
            memory_bytes: chosen.memory_bytes,
            compute_request: backing
                .as_ref()
                .and_then(|b| b.compute)
                .unwrap_or(request.compute_request),
            compute_limit: request.compute_limit,
            tenant: request.tenant.clone(),
            state: LeaseState::Reserved,
            pid: None,
            created_unix_ms: unix_ms(),
            pod: request.pod.clone(),
        };
        let record = LeaseRecord {
            lease: lease.clone(),
            cgroup: None,
            pid_start_time: None,
        };
        self.endpoints.open(&lease.id)?;
        let ticket = match self.append(Record::Put {
            lease: Box::new(record.clone()),
        }) {
            Ok(t) => t,
            Err(e) => {
                self.endpoints.close(&lease.id);
                return Err(e);
            }
        };
        self.ledger.open(&lease.id, ledger_quota(&lease));
        self.reserved_at.insert(lease.id.clone(), Instant::now());
        self.by_container
            .insert(container_key(&lease), lease.id.clone());
        self.leases.insert(lease.id.clone(), record);
        self.bind_grants(&lease);
        let store = self.store.clone();
        self.undurable.retain(|_, t| !store.is_durable(*t));
        self.undurable.insert(lease.id.clone(), ticket);
        Ok(Granted {
            lease,
            ticket: Some(ticket),
            fresh: true,
        })
    }

    // ----- periodic work -----

    /// Fails the waiters whose bound has passed, saying what they asked for and
    /// what the node has.
    pub fn expire_waiters(&mut self, now: Instant) {
        for w in self.queue.take_expired(now) {
            let memory = match self.granted_memory(&w.item.request) {
                Some(bytes) => MemoryRequest::Bytes(bytes),
                None => self.memory_request(&w.item.request),
            };
            let r = &w.item.request;
            let reason = {
                let req = placement::Request {
                    priority: r.priority,
                    memory,
                    gpu: &r.gpu,
                    tenant: r.tenant.as_deref(),
                };
                match self.decide(&req, r.compute_request.get()) {
                    Err(e) => e.to_string(),
                    Ok(_) => format!(
                        "{} was held back behind a waiting high-priority request",
                        placement::describe(&req)
                    ),
                }
            };
            let err = StateError::QueueTimeout {
                waited_ms: now.duration_since(w.arrived).as_millis() as u64,
                reason,
                free: self.free_summary(),
            };
            tracing::warn!(container = %r.container_id, error = %err, "admission timed out");
            self.admission_record.timed_out(w.priority);
            let _ = w.item.reply.send(Err(err));
        }
    }

    /// Per GPU: its size, its leases, utilisation, drained/reserved. Not its free
    /// memory nor its UUID: the refusal this follows names both per GPU already
    /// (said twice, the message read as if it were two different GPUs).
    pub fn free_summary(&self) -> String {
        self.views()
            .iter()
            .map(|v| {
                let plural = |n: u32| if n == 1 { "lease" } else { "leases" };
                let leases = match (v.high_leases, v.low_leases) {
                    (0, 0) => "no leases".to_string(),
                    (h, 0) => format!("{h} high-priority {}", plural(h)),
                    (0, l) => format!("{l} low-priority {}", plural(l)),
                    (h, l) => format!("{h} high- and {l} low-priority {}", plural(h + l)),
                };
                let mut s = format!(
                    "GPU {} ({}): {}, {:.0}% busy",
                    v.index,
                    ByteSize(v.memory_allocatable),
                    leases,
                    v.utilization * 100.0
                );
                if v.drained {
                    s += ", drained";
                }
                if let Some(t) = v.reserved_for {
                    s += &format!(", reserved for {t:?}");
                }
                s
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}
