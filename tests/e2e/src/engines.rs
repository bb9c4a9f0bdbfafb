//! Which containerd the tests drive. Debian 12 ships containerd 1.6.20, the default;
//! nodes in the field also run containerd 2.x, whose shims answer differently (2.3's
//! runc shim prints its bootstrap in protobuf). `GPUSHARE_E2E_CONTAINERD=2.3.4` runs
//! the same suites against the containerd 2.3.4 build in the project's shared
//! `engines/` directory (`make test` does so when the archive is there, and says so
//! when it is not): unpacked once, after its checksum is checked, and first on the
//! private daemon's PATH so that it finds its own `containerd-shim-runc-v2`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::bin_dir;

/// The variable that picks the containerd build.
pub const CONTAINERD_VARIABLE: &str = "GPUSHARE_E2E_CONTAINERD";
/// The one non-Debian build the tests know.
pub const CONTAINERD_2_3: &str = "2.3.4";
const ARCHIVE: &str = "containerd-2.3.4-linux-amd64.tar.xz";

/// containerd and ctr, and the directory to put first on containerd's PATH.
#[derive(Debug)]
pub struct ContainerdBuild {
    pub version: String,
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    /// Where its own `containerd-shim-runc-v2` is (None: the system's).
    pub shim_dir: Option<PathBuf>,
}

/// The build this test process drives (the variable, read once).
pub fn containerd_build() -> &'static ContainerdBuild {
    static BUILD: OnceLock<ContainerdBuild> = OnceLock::new();
    BUILD.get_or_init(|| match std::env::var(CONTAINERD_VARIABLE).as_deref() {
        Err(_) | Ok("") | Ok("debian") => ContainerdBuild {
            version: "Debian's".into(),
            containerd: "/usr/bin/containerd".into(),
            ctr: "/usr/bin/ctr".into(),
            shim_dir: None,
        },
        Ok(CONTAINERD_2_3) => {
            let dir = unpacked_2_3();
            ContainerdBuild {
                version: CONTAINERD_2_3.into(),
                containerd: dir.join("containerd"),
                ctr: dir.join("ctr"),
                shim_dir: Some(dir),
            }
        }
        Ok(other) => panic!(
            "{CONTAINERD_VARIABLE}={other:?}: accepted are \"debian\" (the default) and \
             {CONTAINERD_2_3:?}"
        ),
    })
}

/// The shared `engines/` directory: `GPUSHARE_ENGINES_DIR`, else `../shared/engines`
/// beside the repository.
pub fn engines_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("GPUSHARE_ENGINES_DIR") {
        return Some(PathBuf::from(dir));
    }
    let repository = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = repository.join("../shared/engines");
    dir.join(ARCHIVE).exists().then_some(dir)
}

fn unpacked_2_3() -> PathBuf {
    containerd_2_3_dir().unwrap_or_else(|| {
        panic!(
            "{CONTAINERD_VARIABLE}={CONTAINERD_2_3}, but {ARCHIVE} is not in ../shared/engines \
             (or GPUSHARE_ENGINES_DIR)"
        )
    })
}

/// The unpacked containerd 2.3.4 build (`containerd`, `ctr`, `containerd-shim-runc-v2`),
/// or None when its archive is not there: a test then says it skipped.
pub fn containerd_2_3_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| engines_dir().map(|engines| unpack(&engines)))
        .clone()
}

fn unpack(engines: &Path) -> PathBuf {
    let target = bin_dir().join("../engines/containerd-2.3.4");
    let done = target.join(".unpacked");
    if done.exists() {
        return target;
    }
    let run = |command: &mut Command, what: &str| {
        let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            out.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(
        Command::new("sha256sum")
            .args(["--check", "--ignore-missing", "--quiet", "SHA256SUMS"])
            .current_dir(engines),
        "checking the containerd 2.3.4 archive against SHA256SUMS",
    );
    std::fs::create_dir_all(&target).unwrap();
    run(
        Command::new("tar")
            .arg("-xJf")
            .arg(engines.join(ARCHIVE))
            .arg("-C")
            .arg(&target),
        "unpacking the containerd 2.3.4 archive",
    );
    std::fs::write(&done, "").unwrap();
    target
}
