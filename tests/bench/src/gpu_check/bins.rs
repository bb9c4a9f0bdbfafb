//! Which binaries the run checks. A check of a real GPU is only worth its figures on the
//! build that ships, so: `GPUSHARE_BIN_DIR` when set (binaries copied to a GPU machine
//! without cargo), else the release build beside this program, built with cargo when cargo
//! and the workspace are here. Never a debug build unless `GPUSHARE_BIN_DIR` names one.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The programs every step needs, in the binary directory.
pub const PROGRAMS: [&str; 3] = ["gpushare-arbiter", "gpushare-cuda-probe", "simgpu-workload"];
/// The crates that build them, the interposer and this program.
const PACKAGES: [&str; 5] = [
    "gpushare-arbiter",
    "gpushare-cuda-probe",
    "simgpu-workload",
    "gpushare-preload",
    "gpushare-bench",
];

#[derive(Debug, Clone, serde::Serialize)]
pub struct Bins {
    pub dir: PathBuf,
    pub preload: PathBuf,
    /// How `dir` was chosen, for the report.
    pub source: String,
    /// The build's git revision, or why it is unknown.
    pub revision: String,
}

impl Bins {
    /// The binaries of this run, building the release ones first where that is how they
    /// are found.
    pub fn resolve() -> Result<Bins, String> {
        let (dir, source) = match std::env::var_os("GPUSHARE_BIN_DIR") {
            Some(dir) => (PathBuf::from(dir), "GPUSHARE_BIN_DIR".to_string()),
            None => (release_dir()?, build_release()?),
        };
        let dir = dir
            .canonicalize()
            .map_err(|e| format!("binary directory {}: {e}", dir.display()))?;
        let preload = std::env::var_os("GPUSHARE_PRELOAD_LIB")
            .map_or_else(|| dir.join("libgpushare.so"), PathBuf::from);
        let bins = Bins {
            revision: revision(&dir),
            dir,
            preload,
            source,
        };
        bins.check()?;
        Ok(bins)
    }

    /// The environment a step process needs to find the same binaries.
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [
            ("GPUSHARE_BIN_DIR", self.dir.as_path()),
            ("GPUSHARE_PRELOAD_LIB", self.preload.as_path()),
        ]
    }

    fn check(&self) -> Result<(), String> {
        let missing: Vec<String> = PROGRAMS
            .iter()
            .map(|p| self.dir.join(p))
            .chain([self.preload.clone()])
            .filter(|p| !p.exists())
            .map(|p| p.display().to_string())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "missing {}: build them (cargo build --release -p {}) or point GPUSHARE_BIN_DIR at a directory holding {} and libgpushare.so",
                missing.join(", "),
                PACKAGES.join(" -p "),
                PROGRAMS.join(", ")
            ))
        }
    }
}

/// `target/release` of the build this program belongs to.
fn release_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let profile = exe
        .parent()
        .ok_or("this program has no directory")?
        .to_path_buf();
    if profile.ends_with("release") {
        return Ok(profile);
    }
    let target = profile
        .parent()
        .ok_or("this program's build has no target directory")?;
    Ok(target.join("release"))
}

/// Builds the release binaries with cargo when cargo and this workspace are here; says how
/// the directory was chosen.
fn build_release() -> Result<String, String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let has_cargo = Command::new("cargo")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cargo || !workspace.join("Cargo.toml").exists() {
        return Ok("release build beside this program (no cargo here to rebuild it)".into());
    }
    let target = release_dir()?
        .parent()
        .map(Path::to_path_buf)
        .ok_or("no target directory")?;
    let mut cargo = Command::new("cargo");
    cargo
        .current_dir(&workspace)
        .args(["build", "--release", "--target-dir"])
        .arg(&target);
    for package in PACKAGES {
        cargo.args(["-p", package]);
    }
    let status = cargo
        .status()
        .map_err(|e| format!("running cargo build --release: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build --release failed ({status})"));
    }
    Ok("release build (cargo build --release)".into())
}

/// `REVISION` in the directory (write it when copying binaries to a GPU machine), else
/// git's description of the checkout the directory is in.
fn revision(dir: &Path) -> String {
    if let Ok(text) = std::fs::read_to_string(dir.join("REVISION")) {
        return text.trim().to_string();
    }
    Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| {
            format!(
                "unknown (not in a git checkout and no {}/REVISION)",
                dir.display()
            )
        })
}
