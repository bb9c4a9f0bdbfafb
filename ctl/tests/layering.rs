//! gpusharectl is a client of the daemon, not a part of it: it may use the protocol, the
//! configuration and the shared types, never the daemon's crate (whose internals would
//! then leak into the client and tie the two builds together).

#[test]
fn the_client_depends_on_the_protocol_not_on_the_daemon() {
    let manifest: toml::Table = include_str!("../Cargo.toml").parse().unwrap();
    let gpushare_crates: Vec<&String> = ["dependencies", "dev-dependencies", "build-dependencies"]
        .iter()
        .filter_map(|section| manifest.get(*section).and_then(|t| t.as_table()))
        .flat_map(|table| table.keys())
        .filter(|name| name.starts_with("gpushare-"))
        .collect();
    assert!(
        gpushare_crates.iter().any(|name| *name == "gpushare-proto"),
        "{gpushare_crates:?}"
    );
    for name in &gpushare_crates {
        assert!(
            ["gpushare-proto", "gpushare-config", "gpushare-types"].contains(&name.as_str()),
            "gpusharectl depends on {name}: only the protocol, the configuration and the shared \
             types are its to use"
        );
    }
}
