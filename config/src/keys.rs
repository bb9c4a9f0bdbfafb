//! A configuration as its settings, one per dotted key (`scheduler.slice_ms`): what
//! differs between two configurations, and one made of the settings of two. The
//! arbiter's reload on SIGHUP decides per key from these; `check-config` counts
//! what a file changes from the defaults.

use std::collections::BTreeMap;

use crate::Config;

/// Every setting of `config` by dotted key, as TOML values. A list (`arbiter.devices`,
/// `arbiter.reservations`) is one setting; an unset optional key
/// (`arbiter.metrics_address`) is missing.
pub fn settings(config: &Config) -> BTreeMap<String, toml::Value> {
    let mut flat = BTreeMap::new();
    for (section, value) in as_table(config) {
        match value {
            toml::Value::Table(table) => {
                for (key, value) in table {
                    flat.insert(format!("{section}.{key}"), value);
                }
            }
            other => {
                flat.insert(section, other);
            }
        }
    }
    flat
}

/// The keys whose settings differ between `a` and `b`, in key order.
pub fn changed(a: &Config, b: &Config) -> Vec<String> {
    let (a, b) = (settings(a), settings(b));
    let mut keys: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|key| a.get(*key) != b.get(*key))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// `base` with the settings of `other` for the keys `take` picks (set or unset as
/// in `other`). `None` only if the mix does not read as a configuration, which
/// settings of two configurations always do.
pub fn merged(base: &Config, other: &Config, take: impl Fn(&str) -> bool) -> Option<Config> {
    let mut table = as_table(base);
    let theirs = settings(other);
    for key in changed(base, other).into_iter().filter(|k| take(k)) {
        let (section, name) = key.split_once('.')?;
        let toml::Value::Table(section) = table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        else {
            return None;
        };
        match theirs.get(&key) {
            Some(value) => section.insert(name.to_owned(), value.clone()),
            None => section.remove(name),
        };
    }
    toml::Value::Table(table).try_into().ok()
}

fn as_table(config: &Config) -> toml::Table {
    // Every field serializes (the round-trip test in lib.rs covers each one).
    toml::Table::try_from(config).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PlacementPolicy;

    #[test]
    fn settings_name_every_field_by_its_dotted_key() {
        let keys: Vec<String> = settings(&Config::default()).into_keys().collect();
        for key in [
            "arbiter.run_dir",
            "arbiter.devices",
            "arbiter.default_memory",
            "requests.allowed_env",
            "runtime.library",
            "scheduler.slice_ms",
            "kubernetes.memory_unit",
            "placement.policy",
        ] {
            assert!(keys.contains(&key.to_string()), "{key}: {keys:?}");
        }
        // Unset optional keys are absent, not empty.
        assert!(!keys.contains(&"arbiter.metrics_address".to_string()));
    }

    #[test]
    fn changed_lists_each_differing_key_once_including_set_and_unset_options() {
        let a = Config::default();
        assert!(changed(&a, &a).is_empty());
        let mut b = a.clone();
        b.scheduler.slice_ms = 10;
        b.arbiter.metrics_address = Some("127.0.0.1:9400".into());
        b.placement.policy = PlacementPolicy::Wang;
        b.arbiter.devices.push(crate::DeclaredDevice {
            uuid: "GPU-1".into(),
            name: "x".into(),
            memory: gpushare_types::ByteSize(1 << 30),
        });
        let expected = [
            "arbiter.devices",
            "arbiter.metrics_address",
            "placement.policy",
            "scheduler.slice_ms",
        ];
        assert_eq!(changed(&a, &b), expected);
        assert_eq!(changed(&b, &a), expected);
    }

    #[test]
    fn merged_takes_exactly_the_picked_keys() {
        let base = Config::default();
        let mut other = base.clone();
        other.scheduler.slice_ms = 10;
        other.arbiter.low_nums_limit = 2;
        other.arbiter.metrics_address = Some("127.0.0.1:9400".into());
        let mix = merged(&base, &other, |k| k.starts_with("arbiter.")).unwrap();
        assert_eq!(
            changed(&base, &mix),
            ["arbiter.low_nums_limit", "arbiter.metrics_address"]
        );
        assert_eq!(changed(&mix, &other), ["scheduler.slice_ms"]);
        // Unsetting an option is taken too.
        let back = merged(&other, &base, |k| k == "arbiter.metrics_address").unwrap();
        assert_eq!(back.arbiter.metrics_address, None);
        assert_eq!(back.scheduler.slice_ms, 10);
    }
}
