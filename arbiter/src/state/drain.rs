//! Draining a GPU: no new leases on it until it is undrained.

use super::*;

impl Arbiter {
    /// `gpu`: a UUID or an index of a shared GPU.
    pub fn drain(&mut self, gpu: &str, drain: bool) -> Result<(String, Ticket), StateError> {
        let uuid = self
            .inventory
            .gpus
            .iter()
            .find(|g| g.uuid == gpu || g.index.to_string() == gpu)
            .map(|g| g.uuid.clone())
            .ok_or_else(|| StateError::UnknownGpu {
                asked: gpu.to_owned(),
                available: self
                    .inventory
                    .gpus
                    .iter()
                    .map(|g| format!("{} ({})", g.index, g.uuid))
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        self.ensure_writable()?;
        let ticket = self.append(Record::Drain {
            gpu: uuid.clone(),
            drained: drain,
        })?;
        if drain {
            self.drained.insert(uuid.clone());
        } else {
            self.drained.remove(&uuid);
            self.run_admission();
        }
        Ok((uuid, ticket))
    }
}
