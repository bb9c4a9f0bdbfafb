//! The suspended leases, on disk before each driver step: an arbiter killed in the middle
//! of a reclaim or a restore must find, when it starts again, every process it may have
//! left locked or checkpointed (a locked process's CUDA calls wait for ever, and a
//! checkpointed one is not even listed by NVML). Recovery asks the driver where each
//! one stands (`cuCheckpointProcessGetState`) and finishes or undoes the step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpushare_proto::LeaseId;

use super::Suspension;

/// `reclaim.json` in the state directory.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("reclaim.json")
}

/// Replaces the journal with `suspensions` (durably: written, synced, renamed).
pub fn write(path: &Path, suspensions: &BTreeMap<LeaseId, Suspension>) -> std::io::Result<()> {
    let entries: BTreeMap<String, &Suspension> = suspensions
        .iter()
        .map(|(l, s)| (l.to_string(), s))
        .collect();
    let bytes = serde_json::to_vec_pretty(&entries).map_err(std::io::Error::other)?;
    crate::files::write_atomically(path, &bytes)
}

/// What the journal holds; empty when there is none. A journal that cannot be read is
/// an error: starting without it could leave processes locked for ever.
pub fn read(path: &Path) -> Result<BTreeMap<LeaseId, Suspension>, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let entries: BTreeMap<String, Suspension> = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a reclaim journal: {e}", path.display()))?;
    entries
        .into_iter()
        .map(|(l, s)| {
            LeaseId::parse(&l)
                .map(|id| (id, s))
                .map_err(|e| format!("{}: lease {l:?}: {e}", path.display()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reclaim::SuspensionPhase;

    #[test]
    fn a_journal_reads_back_what_was_written_and_none_reads_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = path(dir.path());
        assert!(read(&path).unwrap().is_empty());
        let mut s = BTreeMap::new();
        s.insert(
            LeaseId("0123456789abcdef".into()),
            Suspension {
                gpu: "GPU-1".into(),
                pids: vec![10, 11],
                bytes: 1 << 30,
                phase: SuspensionPhase::Suspending,
                since_unix_ms: 5,
            },
        );
        write(&path, &s).unwrap();
        assert_eq!(read(&path).unwrap(), s);
        std::fs::write(&path, b"{").unwrap();
        assert!(read(&path).unwrap_err().contains("reclaim.json"));
    }
}
