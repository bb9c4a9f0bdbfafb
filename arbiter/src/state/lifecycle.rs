//! A lease after it is granted: confirming, binding and releasing it.

use super::*;

impl Arbiter {
    /// The lease `container` names, if any: by the lease it names (which must be
    /// that container's), by its namespace and id, or by the id alone where only one
    /// namespace holds that id (a caller that knows no namespace: podman's hooks).
    pub fn lease_of(&self, container: &ContainerRef) -> Result<Option<LeaseId>, StateError> {
        if let Some(lease) = &container.lease {
            return Ok(self
                .leases
                .get(lease)
                .filter(|r| r.lease.container_id == container.container_id)
                .map(|r| r.lease.id.clone()));
        }
        if container.namespace.is_some() {
            let key = (container.namespace.clone(), container.container_id.clone());
            return Ok(self.by_container.get(&key).cloned());
        }
        let mut holders = self
            .by_container
            .iter()
            .filter(|((_, id), _)| *id == container.container_id);
        match (holders.next(), holders.next()) {
            (None, _) => Ok(None),
            (Some((_, lease)), None) => Ok(Some(lease.clone())),
            (Some(_), Some(_)) => Err(StateError::AmbiguousContainer {
                container: container.container_id.clone(),
                namespaces: self
                    .by_container
                    .keys()
                    .filter(|(_, id)| *id == container.container_id)
                    .map(|(ns, _)| ns.as_deref().unwrap_or("none").to_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// Records the container's init pid (and, from /proc, its start time and cgroup).
    pub fn confirm(&mut self, container_id: &str, pid: u32) -> Result<Option<Ticket>, StateError> {
        self.confirm_in(&ContainerRef::id(container_id.to_owned()), pid)
    }

    pub fn confirm_in(
        &mut self,
        container: &ContainerRef,
        pid: u32,
    ) -> Result<Option<Ticket>, StateError> {
        check_container_pid("confirm", pid)?;
        let id = self
            .lease_of(container)?
            .ok_or_else(|| StateError::NoLeaseForContainer(container.container_id.clone()))?;
        let mut record = self.leases[&id].clone();
        if record.lease.state == LeaseState::Confirmed && record.lease.pid == Some(pid) {
            return Ok(self.last_ticket);
        }
        self.ensure_writable()?;
        let ticket = self.record_confirmed(&mut record, pid)?;
        self.findings.clear_suspicion(&id);
        self.leases.insert(id, record);
        Ok(Some(ticket))
    }

    /// Marks `record` confirmed by `pid` (its start time and cgroup from /proc, so
    /// a reused pid and a foreign peer can be told) and appends it.
    fn record_confirmed(
        &mut self,
        record: &mut LeaseRecord,
        pid: u32,
    ) -> Result<Ticket, StateError> {
        record.lease.state = LeaseState::Confirmed;
        record.lease.pid = Some(pid);
        record.pid_start_time = self.probe.start_time(pid);
        record.cgroup = self.probe.cgroup(pid);
        self.append(Record::Put {
            lease: Box::new(record.clone()),
        })
    }

    /// Binds a pending lease (reserved by podman's precreate hook, which sees no
    /// container id) to its container, and confirms it.
    pub fn bind(
        &mut self,
        id: &LeaseId,
        container_id: &str,
        pid: u32,
    ) -> Result<Option<Ticket>, StateError> {
        check_container_pid("bind", pid)?;
        let pending = self
            .leases
            .get(id)
            .is_some_and(|r| r.lease.container_id.starts_with(PENDING_PREFIX));
        if !pending {
            return Err(StateError::NotPending(id.clone()));
        }
        let namespace = self.leases[id].lease.namespace.clone();
        if self
            .by_container
            .contains_key(&(namespace.clone(), container_id.to_owned()))
        {
            return Err(StateError::AlreadyHoldsLease(container_id.to_owned()));
        }
        self.ensure_writable()?;
        let mut record = self.leases[id].clone();
        let pending_name =
            std::mem::replace(&mut record.lease.container_id, container_id.to_owned());
        let ticket = self.record_confirmed(&mut record, pid)?;
        self.by_container.remove(&(namespace.clone(), pending_name));
        self.by_container
            .insert((namespace, container_id.to_owned()), id.clone());
        self.findings.clear_suspicion(id);
        self.leases.insert(id.clone(), record);
        Ok(Some(ticket))
    }

    /// Idempotent: returns whether the lease existed.
    pub fn release(&mut self, id: &LeaseId) -> Result<(bool, Option<Ticket>), StateError> {
        if !self.leases.contains_key(id) {
            return Ok((false, self.last_ticket));
        }
        let ticket = self.release_record(id)?;
        self.run_admission();
        Ok((true, Some(ticket)))
    }

    /// Release without an admission pass (for admission itself).
    pub(super) fn release_quietly(&mut self, id: &LeaseId) -> Result<(), StateError> {
        if self.leases.contains_key(id) {
            // Nobody was told of this lease, so nobody waits for its release.
            let _ = self.release_record(id)?;
        }
        Ok(())
    }

    fn release_record(&mut self, id: &LeaseId) -> Result<Ticket, StateError> {
        self.ensure_writable()?;
        let ticket = self.append(Record::Delete { id: id.clone() })?;
        self.forget(id);
        Ok(ticket)
    }

    pub fn release_container(
        &mut self,
        container_id: &str,
    ) -> Result<(bool, Option<Ticket>), StateError> {
        self.release_container_in(&ContainerRef::id(container_id.to_owned()))
    }

    pub fn release_container_in(
        &mut self,
        container: &ContainerRef,
    ) -> Result<(bool, Option<Ticket>), StateError> {
        match self.lease_of(container)? {
            Some(id) => self.release(&id),
            None => Ok((false, self.last_ticket)),
        }
    }
}

/// Pure: a container's init pid as a confirm or bind names it. Pid 0 is no
/// process: to kill(2) it means the caller's own process group, so a lease
/// confirmed with it would look alive for ever.
fn check_container_pid(request: &'static str, pid: u32) -> Result<(), StateError> {
    if pid == 0 {
        return Err(StateError::BadRequest {
            request,
            field: "pid",
            value: pid.to_string(),
            accepted: "the container's init pid, 1 or more",
        });
    }
    Ok(())
}
