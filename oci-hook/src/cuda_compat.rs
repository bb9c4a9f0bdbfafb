//! Does the image's CUDA fit the host driver? (Xiao et al.: reject at start, not
//! with an obscure error deep inside the job.)
//!
//! Images declare what they need in `NVIDIA_REQUIRE_CUDA` (the NVIDIA toolkit's
//! grammar: space-separated alternatives are OR'd, comma-separated constraints
//! within one alternative are AND'd, e.g. `cuda>=12.4 brand=tesla,driver>=470,driver<471`)
//! or, in older images, only `CUDA_VERSION=12.4.1`. The driver reports the newest
//! CUDA it supports (NVML, e.g. 12040). An image is rejected only when every
//! alternative is decidably false: alternatives with terms this check cannot
//! evaluate (brand, driver branch, arch) may hold — they are how forward-compat
//! packages let new CUDA run on old drivers — so they are given the benefit of the doubt.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CudaVersion {
    pub major: u32,
    pub minor: u32,
}

impl CudaVersion {
    /// NVML's encoding: 1000 × major + 10 × minor (12040 is 12.4).
    pub fn from_driver(encoded: u32) -> Self {
        CudaVersion {
            major: encoded / 1000,
            minor: (encoded % 1000) / 10,
        }
    }

    /// `12`, `12.4` or `12.4.1` (the patch level does not change compatibility).
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = match parts.next() {
            Some(m) => m.parse().ok()?,
            None => 0,
        };
        if let Some(patch) = parts.next() {
            patch.parse::<u32>().ok()?;
        }
        parts
            .next()
            .is_none()
            .then_some(CudaVersion { major, minor })
    }
}

impl fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompatError {
    #[error(
        "the image needs CUDA {needed} ({source_var}) but the host driver supports CUDA {driver} at most; \
         use an image built for CUDA {driver} or older, or update the driver (NVIDIA_DISABLE_REQUIRE=1 skips this check)"
    )]
    DriverTooOld {
        needed: String,
        source_var: String,
        driver: CudaVersion,
    },
    #[error("invalid {key}={value:?}: expected constraints such as `cuda>=12.4` (or a version such as `12.4.1` for CUDA_VERSION)")]
    Unreadable { key: &'static str, value: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Ge,
    Gt,
    Le,
    Lt,
    Eq,
}

/// `Some(true/false)` when decidable, `None` for a term about something else.
fn evaluate(term: &str, driver: CudaVersion) -> Result<Option<bool>, ()> {
    let Some(rest) = term.strip_prefix("cuda") else {
        return Ok(None);
    };
    let (op, version) = [
        (">=", Op::Ge),
        ("<=", Op::Le),
        ("==", Op::Eq),
        (">", Op::Gt),
        ("<", Op::Lt),
        ("=", Op::Eq),
    ]
    .iter()
    .find_map(|(text, op)| rest.strip_prefix(text).map(|v| (*op, v)))
    .ok_or(())?;
    let wanted = CudaVersion::parse(version).ok_or(())?;
    Ok(Some(match op {
        Op::Ge => driver >= wanted,
        Op::Gt => driver > wanted,
        Op::Le => driver <= wanted,
        Op::Lt => driver < wanted,
        Op::Eq => driver == wanted,
    }))
}

/// Checks a container spec against the driver's CUDA version as NVML reports it
/// (e.g. 12040); nothing to check when the driver's version is unknown.
pub fn check_spec(
    spec: &crate::spec::Spec,
    driver_cuda_version: Option<u32>,
) -> Result<(), CompatError> {
    match driver_cuda_version {
        Some(encoded) => check(
            &spec.env().entries().collect::<Vec<_>>(),
            CudaVersion::from_driver(encoded),
        ),
        None => Ok(()),
    }
}

/// Checks the image environment `env` against the driver's CUDA version.
pub fn check(env: &[&str], driver: CudaVersion) -> Result<(), CompatError> {
    let value = |key: &str| {
        env.iter()
            .find_map(|e| e.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
    };
    if matches!(
        value("NVIDIA_DISABLE_REQUIRE")
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("1" | "true" | "yes")
    ) {
        return Ok(());
    }
    if let Some(require) = value("NVIDIA_REQUIRE_CUDA").filter(|v| !v.trim().is_empty()) {
        let unreadable = || CompatError::Unreadable {
            key: "NVIDIA_REQUIRE_CUDA",
            value: require.to_owned(),
        };
        let mut any_may_hold = false;
        for alternative in require.split_whitespace() {
            let mut holds = Some(true);
            for term in alternative.split(',') {
                match evaluate(term, driver).map_err(|()| unreadable())? {
                    Some(false) => holds = Some(false),
                    None if holds == Some(true) => holds = None,
                    _ => {}
                }
            }
            any_may_hold |= holds != Some(false);
        }
        if any_may_hold {
            return Ok(());
        }
        return Err(CompatError::DriverTooOld {
            needed: require.to_owned(),
            source_var: format!("NVIDIA_REQUIRE_CUDA={require}"),
            driver,
        });
    }
    if let Some(version) = value("CUDA_VERSION").filter(|v| !v.is_empty()) {
        let needed = CudaVersion::parse(version).ok_or_else(|| CompatError::Unreadable {
            key: "CUDA_VERSION",
            value: version.to_owned(),
        })?;
        if needed > driver {
            return Err(CompatError::DriverTooOld {
                needed: format!(">= {needed}"),
                source_var: format!("CUDA_VERSION={version}"),
                driver,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER_12_2: CudaVersion = CudaVersion {
        major: 12,
        minor: 2,
    };

    #[test]
    fn driver_encoding() {
        assert_eq!(
            CudaVersion::from_driver(12040),
            CudaVersion {
                major: 12,
                minor: 4
            }
        );
        assert_eq!(CudaVersion::from_driver(11080).to_string(), "11.8");
    }

    #[test]
    fn table() {
        let cases: &[(&[&str], bool)] = &[
            (&[], true),
            (&["PATH=/bin"], true),
            (&["NVIDIA_REQUIRE_CUDA=cuda>=12.0"], true),
            (&["NVIDIA_REQUIRE_CUDA=cuda>=12.2"], true),
            (&["NVIDIA_REQUIRE_CUDA=cuda>=12.4"], false),
            (&["NVIDIA_REQUIRE_CUDA=cuda>12.2"], false),
            (&["NVIDIA_REQUIRE_CUDA=cuda<13"], true),
            (&["NVIDIA_REQUIRE_CUDA=cuda=12.2"], true),
            // An alternative about the driver branch may hold: forward compatibility.
            (
                &["NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,driver>=470,driver<471"],
                true,
            ),
            // …unless its own cuda term already fails.
            (
                &["NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,cuda>=12.3"],
                false,
            ),
            (&["CUDA_VERSION=12.2.2"], true),
            (&["CUDA_VERSION=12.4.1"], false),
            (&["CUDA_VERSION=11.8.0"], true),
            // NVIDIA_REQUIRE_CUDA is the authority when both are present.
            (
                &["CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.1"],
                true,
            ),
            (&["CUDA_VERSION=12.4.1", "NVIDIA_DISABLE_REQUIRE=1"], true),
            (
                &[
                    "NVIDIA_REQUIRE_CUDA=cuda>=12.4",
                    "NVIDIA_DISABLE_REQUIRE=true",
                ],
                true,
            ),
        ];
        for (env, ok) in cases {
            assert_eq!(
                check(env, DRIVER_12_2).is_ok(),
                *ok,
                "{env:?}: {:?}",
                check(env, DRIVER_12_2)
            );
        }
    }

    #[test]
    fn error_names_both_versions_and_the_variable() {
        let msg = check(&["CUDA_VERSION=12.4.1"], DRIVER_12_2)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("12.4")
                && msg.contains("CUDA 12.2")
                && msg.contains("CUDA_VERSION=12.4.1"),
            "{msg}"
        );
        let msg = check(&["NVIDIA_REQUIRE_CUDA=cuda>=12.4"], DRIVER_12_2)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("NVIDIA_REQUIRE_CUDA=cuda>=12.4") && msg.contains("12.2"),
            "{msg}"
        );
    }

    #[test]
    fn spec_level_check() {
        let spec = crate::spec::Spec::from_value(
            serde_json::json!({"process": {"env": ["CUDA_VERSION=12.4.1"]}}),
        )
        .unwrap();
        assert!(
            check_spec(&spec, None).is_ok(),
            "unknown driver: nothing to check"
        );
        assert!(check_spec(&spec, Some(12040)).is_ok());
        assert!(check_spec(&spec, Some(12020)).is_err());
    }

    #[test]
    fn unreadable_values_are_named() {
        for env in [
            &["NVIDIA_REQUIRE_CUDA=cuda>=twelve"][..],
            &["NVIDIA_REQUIRE_CUDA=cuda~12"],
            &["CUDA_VERSION=latest"],
        ] {
            let err = check(env, DRIVER_12_2).unwrap_err();
            assert!(
                matches!(err, CompatError::Unreadable { .. }),
                "{env:?}: {err}"
            );
        }
    }
}
