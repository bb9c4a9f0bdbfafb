//! The three resources gpushare advertises: their names, endpoint sockets, device
//! ids, answer keys, and the grant amount a number of their devices stands for.

use gpushare_proto::grant::GrantAmount;
use gpushare_types::kubernetes::{
    COMPUTE_RESOURCE, GRANT_COMPUTE_ANNOTATION, GRANT_COMPUTE_ENV, GRANT_HIGH_ANNOTATION,
    GRANT_HIGH_ENV, GRANT_MEMORY_ANNOTATION, GRANT_MEMORY_ENV, HIGH_RESOURCE, MEMORY_RESOURCE,
};

/// Compute is granted in percent of one GPU.
pub const COMPUTE_PER_GPU: u32 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resource {
    Memory,
    High,
    Compute,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("{resource}: {units} devices asked for one container; accepted: {accepted}")]
    TooMany {
        resource: &'static str,
        units: usize,
        accepted: &'static str,
    },
    #[error("{resource}: a container asked for no devices; accepted: at least 1")]
    None { resource: &'static str },
    #[error(
        "{resource}: {units} units of {unit} bytes overflow 64 bits; accepted: at most {} units",
        u64::MAX / unit
    )]
    Overflow {
        resource: &'static str,
        units: usize,
        unit: u64,
    },
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Memory, Resource::High, Resource::Compute];

    /// The extended resource name kubelet and kube-scheduler know it by.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Memory => MEMORY_RESOURCE,
            Resource::High => HIGH_RESOURCE,
            Resource::Compute => COMPUTE_RESOURCE,
        }
    }

    /// The plugin endpoint's socket, in kubelet's device plugin directory.
    pub fn socket_name(self) -> &'static str {
        match self {
            Resource::Memory => "gpushare-memory.sock",
            Resource::High => "gpushare-high.sock",
            Resource::Compute => "gpushare-compute.sock",
        }
    }

    /// What its device ids start with (`memory-0`, `high-1`, `compute-199`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Resource::Memory => "memory",
            Resource::High => "high",
            Resource::Compute => "compute",
        }
    }

    pub fn annotation(self) -> &'static str {
        match self {
            Resource::Memory => GRANT_MEMORY_ANNOTATION,
            Resource::High => GRANT_HIGH_ANNOTATION,
            Resource::Compute => GRANT_COMPUTE_ANNOTATION,
        }
    }

    pub fn env(self) -> &'static str {
        match self {
            Resource::Memory => GRANT_MEMORY_ENV,
            Resource::High => GRANT_HIGH_ENV,
            Resource::Compute => GRANT_COMPUTE_ENV,
        }
    }

    pub fn from_name(name: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The grant `units` of its devices stand for, for one container.
    pub fn amount(self, units: usize, memory_unit: u64) -> Result<GrantAmount, AmountError> {
        let resource = self.name();
        if units == 0 {
            return Err(AmountError::None { resource });
        }
        match self {
            Resource::Memory => (units as u64)
                .checked_mul(memory_unit)
                .map(|bytes| GrantAmount::Memory { bytes })
                .ok_or(AmountError::Overflow {
                    resource,
                    units,
                    unit: memory_unit,
                }),
            // One slot per GPU, and a container runs on one GPU: two slots would
            // block a second GPU's high job for nothing.
            Resource::High if units > 1 => Err(AmountError::TooMany {
                resource,
                units,
                accepted: "1 (one high-priority slot per container)",
            }),
            Resource::High => Ok(GrantAmount::High),
            // A container runs on one GPU, which has 100 percent.
            Resource::Compute if units > COMPUTE_PER_GPU as usize => Err(AmountError::TooMany {
                resource,
                units,
                accepted: "1 to 100 (percent of one GPU)",
            }),
            Resource::Compute => Ok(GrantAmount::Compute {
                percent: units as u32,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn units_become_grant_amounts() {
        for (resource, units, expected) in [
            (Resource::Memory, 1, GrantAmount::Memory { bytes: GIB }),
            (
                Resource::Memory,
                12,
                GrantAmount::Memory { bytes: 12 * GIB },
            ),
            (Resource::High, 1, GrantAmount::High),
            (Resource::Compute, 1, GrantAmount::Compute { percent: 1 }),
            (
                Resource::Compute,
                100,
                GrantAmount::Compute { percent: 100 },
            ),
        ] {
            assert_eq!(
                resource.amount(units, GIB),
                Ok(expected),
                "{resource:?} {units}"
            );
        }
    }

    #[test]
    fn amounts_one_container_cannot_use_are_refused_by_name_and_value() {
        for (resource, units, words) in [
            (
                Resource::High,
                2,
                ["gpushare.io/high", "2 devices", "accepted: 1"],
            ),
            (
                Resource::Compute,
                101,
                ["gpushare.io/compute", "101", "1 to 100"],
            ),
            (
                Resource::Memory,
                0,
                ["gpushare.io/memory", "no devices", "at least 1"],
            ),
        ] {
            let message = resource.amount(units, GIB).unwrap_err().to_string();
            for word in words {
                assert!(message.contains(word), "{message:?} lacks {word:?}");
            }
        }
        assert!(matches!(
            Resource::Memory.amount(usize::MAX, GIB),
            Err(AmountError::Overflow { .. })
        ));
    }

    #[test]
    fn names_round_trip_and_keys_differ() {
        for r in Resource::ALL {
            assert_eq!(Resource::from_name(r.name()), Some(r));
        }
        assert_eq!(Resource::from_name("nvidia.com/gpu"), None);
        let sockets: std::collections::HashSet<_> =
            Resource::ALL.iter().map(|r| r.socket_name()).collect();
        let annotations: std::collections::HashSet<_> =
            Resource::ALL.iter().map(|r| r.annotation()).collect();
        assert_eq!((sockets.len(), annotations.len()), (3, 3));
    }
}
