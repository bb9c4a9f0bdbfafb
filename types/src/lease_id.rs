//! The lease id: what names a lease on the wire, on disk and in annotations.

use std::fmt;

/// Opaque, unique across arbiter restarts (random), safe as a directory name.
///
/// Any string deserialises (a control request naming an unknown id is answered
/// "not found", not refused as malformed). Where an id becomes a path it must be
/// checked (`parse`, `is_well_formed`): the arbiter's store refuses to load a
/// record whose id is not a plain name, and its lease directories refuse to make
/// a path from one, so `../../x` never names a place outside the run directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct LeaseId(pub String);

/// What a lease id may look like, for error messages.
pub const LEASE_ID_FORM: &str = "1 to 64 characters of a-z, 0-9 and '-'";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLeaseId {
    pub value: String,
}

impl fmt::Display for BadLeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "lease id {:?} is not a plain name: expected {LEASE_ID_FORM}",
            self.value
        )
    }
}

impl std::error::Error for BadLeaseId {}

impl LeaseId {
    /// Lease ids become directory names and annotation values: only `[a-z0-9-]`, bounded length.
    pub fn is_well_formed(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }

    pub fn parse(s: impl Into<String>) -> Result<LeaseId, BadLeaseId> {
        let s = s.into();
        if LeaseId::is_well_formed(&s) {
            Ok(LeaseId(s))
        } else {
            Err(BadLeaseId { value: s })
        }
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_parse_and_the_error_names_the_value_and_the_form() {
        for good in ["0123456789abcdef", "l1", "a-b"] {
            assert_eq!(LeaseId::parse(good).unwrap().0, good);
        }
        for bad in ["../../x", "", "A", "a/b", ".", "..", "a b", &"a".repeat(65)] {
            let err = LeaseId::parse(bad).unwrap_err().to_string();
            assert!(
                err.contains(&format!("{bad:?}")) && err.contains(LEASE_ID_FORM),
                "{bad:?}: {err}"
            );
        }
    }
}
