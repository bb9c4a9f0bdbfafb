//! The GPUs this node may hand out.
//!
//! NVML discovery arrives with the full arbiter; until then (and whenever NVML
//! cannot be loaded) the configuration's declared devices are the inventory.

use gpushare_config::ArbiterConfig;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error("arbiter.shared_gpus names {0:?}, which is not a GPU of this node")]
    UnknownSharedGpu(String),
}

/// Declared devices in order, narrowed to `shared_gpus` when that list is non-empty.
pub fn from_declared(config: &ArbiterConfig) -> Result<Vec<Gpu>, InventoryError> {
    let all: Vec<Gpu> = config
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| Gpu {
            index: i as u32,
            uuid: d.uuid.clone(),
            name: d.name.clone(),
            memory_total: d.memory.0,
        })
        .collect();
    narrow_to_shared(all, &config.shared_gpus)
}

fn narrow_to_shared(all: Vec<Gpu>, shared: &[String]) -> Result<Vec<Gpu>, InventoryError> {
    if shared.is_empty() {
        return Ok(all);
    }
    if let Some(missing) = shared.iter().find(|u| !all.iter().any(|g| &g.uuid == *u)) {
        return Err(InventoryError::UnknownSharedGpu(missing.clone()));
    }
    Ok(all
        .into_iter()
        .filter(|g| shared.contains(&g.uuid))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_config::DeclaredDevice;
    use gpushare_proto::ByteSize;

    fn config(shared: &[&str]) -> ArbiterConfig {
        ArbiterConfig {
            devices: ["GPU-a", "GPU-b"]
                .iter()
                .map(|u| DeclaredDevice {
                    uuid: u.to_string(),
                    name: "x".into(),
                    memory: ByteSize(1 << 30),
                })
                .collect(),
            shared_gpus: shared.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn all_devices_when_no_shared_list() {
        let gpus = from_declared(&config(&[])).unwrap();
        assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn shared_list_narrows_and_keeps_indices() {
        let gpus = from_declared(&config(&["GPU-b"])).unwrap();
        assert_eq!(gpus.len(), 1);
        assert_eq!((gpus[0].index, gpus[0].uuid.as_str()), (1, "GPU-b"));
        assert_eq!(
            from_declared(&config(&["GPU-z"])),
            Err(InventoryError::UnknownSharedGpu("GPU-z".into()))
        );
    }
}
