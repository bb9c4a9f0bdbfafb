//! Where a private arbiter's files are under its run directory
//! (`<run_dir>/leases/<lease>/arbiter.sock`), as `gpushare_types::layout` lays them out
//! for the arbiter and the runtime: the suites take the same names from there.

use std::path::{Path, PathBuf};

use gpushare_types::layout::HostLayout;
pub use gpushare_types::layout::{LEASES_DIR, LEASE_SOCKET};

/// The directory of lease directories.
pub fn leases_dir(run_dir: &Path) -> PathBuf {
    HostLayout::new(run_dir).leases_dir()
}

/// A lease's directory (what its container sees as /run/gpushare). Tests name leases
/// that escape it on purpose, so unlike `HostLayout::lease_dir` the id is not checked here.
pub fn lease_dir(run_dir: &Path, lease: &str) -> PathBuf {
    leases_dir(run_dir).join(lease)
}

/// A lease's socket, as the host sees it.
pub fn lease_socket(run_dir: &Path, lease: &str) -> PathBuf {
    lease_dir(run_dir, lease).join(LEASE_SOCKET)
}

/// The names of the lease directories present, sorted (none when there is no leases
/// directory at all).
pub fn lease_dirs(run_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(leases_dir(run_dir))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_arbiters_layout() {
        let run = Path::new("/run/gs");
        assert_eq!(leases_dir(run), Path::new("/run/gs/leases"));
        assert_eq!(
            lease_socket(run, "00ab"),
            Path::new("/run/gs/leases/00ab/arbiter.sock")
        );
    }
}
