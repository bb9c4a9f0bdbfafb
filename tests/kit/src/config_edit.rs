//! `key = value` settings (as a command line or a test names them) applied to a typed
//! configuration table, e.g. `gpushare_config::SchedulerConfig`: the table is serialised,
//! the keys set, and the result deserialised back, so a setting is checked exactly as the
//! configuration file's own parser would check it (an unknown key is refused by name, a
//! value of the wrong type by key) and nobody formats configuration TOML by hand.

use serde::de::DeserializeOwned;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    #[error("{setting:?} is not a `key = value` line: {message}")]
    Syntax { setting: String, message: String },
    #[error("{setting:?}: {message}")]
    Refused { setting: String, message: String },
}

/// Applies `setting`, one or more TOML `key = value` lines, to `table`. On error `table`
/// is left as it was.
pub fn apply<T: Serialize + DeserializeOwned>(
    table: &mut T,
    setting: &str,
) -> Result<(), SettingError> {
    let keys: toml::Table = toml::from_str(setting).map_err(|e| SettingError::Syntax {
        setting: setting.into(),
        message: e.message().to_owned(),
    })?;
    let refused = |message: String| SettingError::Refused {
        setting: setting.into(),
        message,
    };
    let mut current = toml::Table::try_from(&*table).map_err(|e| refused(e.to_string()))?;
    current.extend(keys);
    *table = current
        .try_into()
        .map_err(|e: toml::de::Error| refused(e.message().to_owned()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_config::{SchedulerConfig, SchedulingPolicy};

    #[test]
    fn a_known_key_is_set_and_the_rest_kept() {
        let mut scheduler = SchedulerConfig {
            policy: SchedulingPolicy::RoundRobin,
            ..SchedulerConfig::default()
        };
        apply(&mut scheduler, "idle_us = 100").unwrap();
        apply(&mut scheduler, "admit_by_duration = false").unwrap();
        assert_eq!(
            scheduler,
            SchedulerConfig {
                policy: SchedulingPolicy::RoundRobin,
                idle_us: 100,
                admit_by_duration: false,
                ..SchedulerConfig::default()
            }
        );
    }

    #[test]
    fn unknown_keys_wrong_types_and_bad_lines_are_refused_by_name() {
        let mut scheduler = SchedulerConfig::default();
        let unknown = apply(&mut scheduler, "idle_usec = 100")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("idle_usec"), "{unknown}");
        let wrong = apply(&mut scheduler, "idle_us = \"fast\"")
            .unwrap_err()
            .to_string();
        assert!(wrong.contains("idle_us"), "{wrong}");
        let syntax = apply(&mut scheduler, "idle_us").unwrap_err();
        assert!(matches!(syntax, SettingError::Syntax { .. }), "{syntax}");
        assert_eq!(scheduler, SchedulerConfig::default());
    }
}
