//! `gpusharectl list`: the leases as an aligned table, each container named as `status`,
//! `top` and `timeline` name it, its lease id beside (what `release` takes). Pure.

use std::fmt::Write as _;

use gpushare_proto::{ByteSize, GpuStatus, Lease, LeaseUsage};

use crate::render::{container_of, fit, wrap};

/// The CONTAINER column, as in `status`.
const NAME_COLUMN: usize = 28;

/// One row a lease, under a header; "no leases" when there are none (a blank answer reads
/// as a hung or broken command). `usage` gives the arbiter's names for the containers,
/// `gpus` the GPUs' indices (a GPU it does not list is shown by its UUID).
pub fn render(leases: &[Lease], usage: &[LeaseUsage], gpus: &[GpuStatus]) -> String {
    if leases.is_empty() {
        return "no leases\n".into();
    }
    let with_grants = leases
        .iter()
        .any(|l| l.pod.as_ref().is_some_and(|p| !p.grants.is_empty()));
    let mut out = format!(
        "{:<NAME_COLUMN$} {:<16}  {:<8} {:<8} {:>8}  {:<9}{}\n",
        "CONTAINER",
        "LEASE",
        "GPUS",
        "PRIORITY",
        "MEMORY",
        "STATE",
        if with_grants { " GRANTS" } else { "" }
    );
    for l in leases {
        let gpus_of: Vec<String> = l
            .gpus
            .iter()
            .map(|uuid| {
                gpus.iter().find(|g| &g.uuid == uuid).map_or_else(
                    || crate::terminal::shown_name(uuid),
                    |g| g.index.to_string(),
                )
            })
            .collect();
        let grants = l
            .pod
            .as_ref()
            .map(|p| {
                p.grants
                    .iter()
                    .map(|g| crate::terminal::shown_name(&g.0))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<NAME_COLUMN$} {:<16}  {:<8} {:<8} {:>8}  {:<9}{}",
            fit(
                &container_of(l, usage.iter().find(|u| u.lease == l.id)),
                NAME_COLUMN
            ),
            fit(&l.id.to_string(), 16),
            gpus_of.join(","),
            l.priority.to_string(),
            ByteSize(l.memory_bytes).to_string(),
            format!("{:?}", l.state).to_lowercase(),
            if with_grants {
                format!(" {grants}")
            } else {
                String::new()
            }
        );
    }
    // Trailing spaces of the last column are noise in a pipe.
    let trimmed: String = out
        .lines()
        .map(|l| l.trim_end().to_owned() + "\n")
        .collect();
    wrap(&trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;
    use gpushare_proto::Priority;

    fn lease(id: &str, container_id: &str, gpus: &[&str]) -> Lease {
        let mut lease = fixtures::lease(id, container_id, gpus[0], Priority::High);
        lease.gpus = gpus.iter().map(|g| g.to_string()).collect();
        lease
    }

    #[test]
    fn a_table_names_each_container_as_status_does_with_its_lease_beside() {
        assert_eq!(render(&[], &[], &[]), "no leases\n");
        let gpus = [GpuStatus {
            index: 1,
            uuid: "GPU-1".into(),
            ..Default::default()
        }];
        let docker_id = "ab".repeat(32);
        let leases = [
            lease("0123456789abcdef", &docker_id, &["GPU-1"]),
            lease("fedcba9876543210", "c-2", &["GPU-1", "GPU-0a0b0c0d-1"]),
            lease("1111222233334444", "c-3", &["GPU-1"]),
        ];
        // The engine's name the arbiter knows wins over the short id, as in status.
        let usage = [fixtures::usage(
            "fedcba9876543210",
            "my-trainer",
            0,
            0,
            None,
        )];
        let text = render(&leases, &usage, &gpus);
        let want = [
            "CONTAINER                    LEASE             GPUS     PRIORITY   MEMORY  STATE",
            "abababababab                 0123456789abcdef  1        high          4Gi  confirmed",
            "my-trainer                   fedcba9876543210  1,GPU-0a0b0c0d-1 high          4Gi  confirmed",
            "c-3                          1111222233334444  1        high          4Gi  confirmed",
        ];
        assert_eq!(text.lines().collect::<Vec<_>>(), want, "{text}");
    }

    #[test]
    fn hostile_or_long_names_keep_one_row_and_the_width() {
        let mut hostile = lease("l3", "c", &["GPU-0"]);
        hostile.pod = Some(gpushare_proto::grant::PodBinding {
            namespace: Some("ns\x1b[2J".into()),
            name: Some(format!(
                "evil\x1b]0;owned\x07\r\nl9 fake{}",
                "x".repeat(200)
            )),
            container: Some("main\u{9b}31m".into()),
            grants: vec![gpushare_proto::grant::GrantId("g-1".into())],
        });
        let text = render(&[hostile], &[], &[]);
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.lines().next().unwrap().ends_with("GRANTS"), "{text}");
        assert!(text.lines().nth(1).unwrap().ends_with("g-1"), "{text}");
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        assert!(text
            .lines()
            .all(|l| l.chars().count() <= crate::render::WIDTH));
    }
}
