//! Records the commit the arbiter is built from, for `gpushare_build_info`: `git
//! rev-parse --short HEAD`, or "unknown" outside a git tree (a source tarball, a
//! vendored build) or without git.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GPUSHARE_COMMIT={commit}");
    // A new commit changes HEAD (or the branch it names); rebuild then, not on every
    // change of the tree.
    if let Ok(git_dir) = Command::new("git")
        .args(["rev-parse", "--git-dir"])
        .output()
    {
        if git_dir.status.success() {
            let dir = String::from_utf8_lossy(&git_dir.stdout).trim().to_owned();
            println!("cargo:rerun-if-changed={dir}/HEAD");
            println!("cargo:rerun-if-changed={dir}/refs/heads");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
