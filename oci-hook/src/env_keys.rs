//! Which `GPUSHARE_*` variables a container's environment may carry.
//!
//! A misspelt request variable used to be ignored: `GPUSHARE_MEMROY=4Gi` gave a
//! container no GPU share and no error. Now a `GPUSHARE_*` name (in any case:
//! `gpushare_memory` is as silently lost) must be a request key, one of gpushare's
//! own variables, or on `requests.allowed_env`; anything else is refused, like an
//! unknown `gpushare.io/` annotation.
//!
//! gpushare's own variables stay accepted whatever their value: the runtime writes
//! them into every sharing container's spec, and a spec can come back carrying them
//! (an image `docker commit`ted from a sharing container keeps its environment).

use gpushare_config::{RequestPolicy, ENV_PREFIX, PATH_ENV};
use gpushare_types::kubernetes::{GRANT_COMPUTE_ENV, GRANT_HIGH_ENV, GRANT_MEMORY_ENV};

/// `GPUSHARE_*` variables gpushare itself writes into containers or reads in them
/// or in its own processes: never requests.
pub const OWN_VARIABLES: [&str; 12] = [
    // The runtime's edit of a sharing container (`mutate::InjectedEnv`).
    "GPUSHARE_LEASE",
    "GPUSHARE_SOCKET",
    "GPUSHARE_QUOTA_MEMORY",
    "GPUSHARE_QUOTA_PRIORITY",
    // gpushare-kube's `Allocate`, for the workload to read (the runtime takes grants
    // from annotations only).
    GRANT_MEMORY_ENV,
    GRANT_HIGH_ENV,
    GRANT_COMPUTE_ENV,
    // The interposer's log level, and the daemons'.
    "GPUSHARE_LOG",
    // gpushare's binaries' own settings, for a container that runs them (the
    // Kubernetes daemonset's): the configuration file, and the shim's.
    PATH_ENV,
    "GPUSHARE_RUNC_SHIM",
    "GPUSHARE_SHIM_RUNC_ADDRESS",
    "GPUSHARE_SHIM_RUNC_TASK_API",
];

/// A variable none of the lists accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVariable<'a> {
    pub name: &'a str,
    pub value: &'a str,
    /// The accepted name it is most likely a misspelling of.
    pub suggestion: Option<&'static str>,
}

/// The first `GPUSHARE_*` entry of `entries` (`KEY=value`, in the spec's order)
/// that is neither in `request_keys`, nor gpushare's own, nor allowed by `policy`.
/// `in_pod`: kubelet's service links are let through too (see `is_service_link`).
pub fn first_unknown<'a>(
    entries: impl IntoIterator<Item = &'a str>,
    request_keys: &[&'static str],
    policy: &RequestPolicy,
    in_pod: bool,
) -> Option<UnknownVariable<'a>> {
    entries.into_iter().find_map(|entry| {
        let (name, value) = entry.split_once('=').unwrap_or((entry, ""));
        let known = !has_prefix(name)
            || request_keys.contains(&name)
            || OWN_VARIABLES.contains(&name)
            || policy.allows_env(name)
            || (in_pod && is_service_link(name));
        (!known).then(|| UnknownVariable {
            name,
            value,
            suggestion: nearest(name, request_keys.iter().chain(&OWN_VARIABLES).copied()),
        })
    })
}

fn has_prefix(name: &str) -> bool {
    name.get(..ENV_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
}

/// kubelet puts `{SERVICE}_SERVICE_HOST`, `{SERVICE}_PORT_443_TCP` and the like into
/// every container of a namespace for each Service in it (`enableServiceLinks`, on by
/// default), so one Service named `gpushare-…` would otherwise refuse every pod in
/// its namespace. These shapes are no misspelling of a request.
fn is_service_link(name: &str) -> bool {
    if name.ends_with("_SERVICE_HOST")
        || name.ends_with("_SERVICE_PORT")
        || name.contains("_SERVICE_PORT_")
        || name.ends_with("_PORT")
    {
        return true;
    }
    // `_PORT_{number}_{protocol}`, then nothing or `_PROTO`, `_PORT`, `_ADDR`.
    name.split("_PORT_").skip(1).any(|rest| {
        let mut parts = rest.split('_');
        let number = parts.next().unwrap_or("");
        !number.is_empty()
            && number.bytes().all(|b| b.is_ascii_digit())
            && matches!(parts.next(), Some("TCP" | "UDP" | "SCTP"))
            && matches!(parts.next(), None | Some("PROTO" | "PORT" | "ADDR"))
            && parts.next().is_none()
    })
}

/// The candidate `name` is most likely a misspelling of: the closest by edit distance
/// (a swap of two neighbours counts as one edit), ignoring case, within a third of the
/// candidate's length after the prefix and at most 2 (`GPUSHARE_FOO` is no
/// misspelling of `GPUSHARE_LOG`); the first of equals.
fn nearest(name: &str, candidates: impl Iterator<Item = &'static str>) -> Option<&'static str> {
    let name = name.to_ascii_uppercase();
    candidates
        .map(|candidate| (edit_distance(&name, candidate), candidate))
        .filter(|&(distance, candidate)| {
            distance <= 2 && distance * 3 <= candidate.len() - ENV_PREFIX.len()
        })
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, candidate)| candidate)
}

/// Optimal string alignment distance over bytes: insertions, deletions,
/// substitutions and transpositions of adjacent bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    // rows[i][j]: the distance between a[..i] and b[..j].
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + substitution);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = best;
        }
    }
    rows[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const REQUEST_KEYS: [&str; 2] = ["GPUSHARE_MEMORY", "GPUSHARE_PRIORITY"];

    fn unknown<'a>(entries: &[&'a str], policy: &RequestPolicy, in_pod: bool) -> Option<&'a str> {
        first_unknown(entries.iter().copied(), &REQUEST_KEYS, policy, in_pod).map(|u| u.name)
    }

    #[test]
    fn names_are_refused_unless_a_request_gpushares_own_or_allowed() {
        let none = RequestPolicy::default();
        let allowing = RequestPolicy {
            allowed_env: vec!["GPUSHARE_MYTOOL_*".into(), "GPUSHARE_BUILD".into()],
            ..RequestPolicy::default()
        };
        let cases: &[(&str, &RequestPolicy, bool)] = &[
            ("GPUSHARE_MEMORY=4Gi", &none, true),
            ("GPUSHARE_PRIORITY=high", &none, true),
            ("GPUSHARE_LEASE=00000000000000ab", &none, true),
            ("GPUSHARE_QUOTA_MEMORY=1073741824", &none, true),
            ("GPUSHARE_GRANT=g-1", &none, true),
            ("GPUSHARE_LOG=debug", &none, true),
            ("GPUSHARE_CONFIG=/etc/gpushare/config.toml", &none, true),
            ("PATH=/bin", &none, true),
            ("NVIDIA_VISIBLE_DEVICES=all", &none, true),
            ("MY_GPUSHARE_MEMROY=1", &none, true),
            ("GPUSHAREMEMORY=1", &none, true),
            ("GPUSHARE_MEMROY=4Gi", &none, false),
            ("GPUSHARE_PRIORTY=high", &none, false),
            ("gpushare_memory=4Gi", &none, false),
            ("Gpushare_Memory=4Gi", &none, false),
            ("GPUSHARE_=1", &none, false),
            ("GPUSHARE_MEMORY_=1", &none, false),
            ("GPUSHARE_MYTOOL_X=1", &none, false),
            ("GPUSHARE_MYTOOL_X=1", &allowing, true),
            ("GPUSHARE_MYTOOL_=1", &allowing, true),
            ("GPUSHARE_BUILD=7", &allowing, true),
            ("GPUSHARE_BUILD_ID=7", &allowing, false),
            ("GPUSHARE_MEMROY=4Gi", &allowing, false),
            // An entry without `=` is a name all the same.
            ("GPUSHARE_MEMROY", &none, false),
            ("GPUSHARE_LEASE", &none, true),
        ];
        for &(entry, policy, accepted) in cases {
            assert_eq!(
                unknown(&[entry], policy, false).is_none(),
                accepted,
                "{entry} under {:?}",
                policy.allowed_env
            );
        }
    }

    #[test]
    fn the_first_unknown_entry_is_named_with_its_value() {
        let entries = [
            "PATH=/bin",
            "GPUSHARE_MEMORY=1Gi",
            "GPUSHARE_MEMROY=4Gi=x",
            "GPUSHARE_OTHER=1",
        ];
        assert_eq!(
            first_unknown(entries, &REQUEST_KEYS, &RequestPolicy::default(), false),
            Some(UnknownVariable {
                name: "GPUSHARE_MEMROY",
                value: "4Gi=x",
                suggestion: Some("GPUSHARE_MEMORY"),
            })
        );
        assert_eq!(
            first_unknown(
                ["PATH=/bin"],
                &REQUEST_KEYS,
                &RequestPolicy::default(),
                false
            ),
            None
        );
    }

    #[test]
    fn kubelets_service_links_pass_in_pods_only() {
        let links = [
            "GPUSHARE_SERVICE_HOST=10.0.0.1",
            "GPUSHARE_SERVICE_PORT=9400",
            "GPUSHARE_METRICS_SERVICE_PORT_HTTP=9400",
            "GPUSHARE_METRICS_PORT=tcp://10.0.0.1:9400",
            "GPUSHARE_METRICS_PORT_9400_TCP=tcp://10.0.0.1:9400",
            "GPUSHARE_METRICS_PORT_9400_UDP_PROTO=udp",
            "GPUSHARE_METRICS_PORT_9400_SCTP_PORT=9400",
            "GPUSHARE_METRICS_PORT_9400_TCP_ADDR=10.0.0.1",
        ];
        let none = RequestPolicy::default();
        for link in links {
            assert_eq!(unknown(&[link], &none, true), None, "{link}");
            assert!(unknown(&[link], &none, false).is_some(), "{link}");
        }
        for not_a_link in [
            "GPUSHARE_METRICS_PORT_X_TCP=1",
            "GPUSHARE_METRICS_PORT_9400_HTTP=1",
            "GPUSHARE_METRICS_PORT_9400_TCP_HOST=1",
            "GPUSHARE_METRICS_PORT_=1",
            "GPUSHARE_MEMROY=4Gi",
        ] {
            assert!(
                unknown(&[not_a_link], &none, true).is_some(),
                "{not_a_link}"
            );
        }
    }

    #[test]
    fn the_suggestion_is_the_close_name_or_none() {
        let all = || REQUEST_KEYS.iter().chain(&OWN_VARIABLES).copied();
        for (name, want) in [
            ("GPUSHARE_MEMROY", Some("GPUSHARE_MEMORY")),
            ("GPUSHARE_MEMOR", Some("GPUSHARE_MEMORY")),
            ("GPUSHARE_MEMORYY", Some("GPUSHARE_MEMORY")),
            ("GPUSHARE_MMEORY", Some("GPUSHARE_MEMORY")),
            ("gpushare_memory", Some("GPUSHARE_MEMORY")),
            ("GPUSHARE_PRIORTY", Some("GPUSHARE_PRIORITY")),
            ("GPUSHARE_LAESE", Some("GPUSHARE_LEASE")),
            ("GPUSHARE_LGO", Some("GPUSHARE_LOG")),
            ("GPUSHARE_FOO", None),
            ("GPUSHARE_MEM", None),
            ("GPUSHARE_", None),
            ("GPUSHARE_SOMETHING_ELSE", None),
        ] {
            assert_eq!(nearest(name, all()), want, "{name}");
        }
    }

    #[test]
    fn edit_distance_table() {
        for (a, b, want) in [
            ("", "", 0),
            ("abc", "abc", 0),
            ("", "abc", 3),
            ("abc", "", 3),
            ("MEMROY", "MEMORY", 1),
            ("PRIORTY", "PRIORITY", 1),
            ("abc", "abd", 1),
            ("abc", "ab", 1),
            ("ca", "abc", 3),
            ("FOO", "LOG", 2),
        ] {
            assert_eq!(edit_distance(a, b), want, "{a} {b}");
            assert_eq!(edit_distance(b, a), want, "{b} {a}");
        }
    }
}
