//! The token clock, as the arbiter, the interposer and the simulated driver read it: tests
//! compare their own timestamps with token deadlines and launch times on this clock.

pub use gpushare_types::monotonic_ns;

/// Runs a program in a time namespace of its own whose `CLOCK_MONOTONIC` is ten minutes
/// behind, as any process may wherever unprivileged user namespaces are allowed.
pub const SHIFTED_CLOCK: [&str; 6] = [
    "unshare",
    "--user",
    "--map-root-user",
    "--time",
    "--monotonic=-600",
    "--fork",
];

/// Why [`SHIFTED_CLOCK`] cannot run here (no unprivileged user or time namespaces), if so.
pub fn shifted_clock_unavailable() -> Option<String> {
    let out = std::process::Command::new(SHIFTED_CLOCK[0])
        .args(&SHIFTED_CLOCK[1..])
        .arg("true")
        .output();
    match out {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`{}` failed ({}): {}",
            SHIFTED_CLOCK.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("running {}: {e}", SHIFTED_CLOCK[0])),
    }
}
