//! A single-layer OCI image from a root filesystem directory, written as an OCI
//! image-layout archive and imported into containerd's CRI namespace with `ctr`:
//! the test machines reach no registry, and the CRI plugin runs only images its
//! own store (namespace `k8s.io`) holds, the pod's sandbox (pause) image included.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::CRI_NAMESPACE;

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed ({status}): {stderr}")]
    Command {
        what: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// What the image runs when a container names no command (the pause container
/// never does: the CRI plugin runs its image's entrypoint and command).
pub struct ImageConfig<'a> {
    /// A full reference, e.g. `docker.io/gpushare/busybox:e2e`: the CRI plugin
    /// normalises the names it is given, and finds the image only under the
    /// normalised one.
    pub name: &'a str,
    pub cmd: &'a [&'a str],
}

/// Writes an OCI image-layout archive (a tar) at `archive` holding `rootfs` as its
/// one uncompressed layer; `work` is a scratch directory for the layout.
pub fn write_archive(
    rootfs: &Path,
    image: &ImageConfig,
    work: &Path,
    archive: &Path,
) -> Result<(), ImageError> {
    let blobs = work.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(io("create", &blobs))?;
    let layer_tar = work.join("layer.tar");
    run(
        Command::new("tar")
            .arg("-C")
            .arg(rootfs)
            .arg("--numeric-owner")
            .arg("-cf")
            .arg(&layer_tar)
            .arg("."),
        "tar of the root filesystem",
    )?;
    let layer = std::fs::read(&layer_tar).map_err(io("read", &layer_tar))?;
    let layer = add_blob(&blobs, &layer)?;
    std::fs::remove_file(&layer_tar).map_err(io("remove", &layer_tar))?;
    // An uncompressed layer's diff id is its own digest.
    let config = json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Cmd": image.cmd,
        },
        "rootfs": { "type": "layers", "diff_ids": [layer.digest] },
    });
    let config = add_blob(&blobs, config.to_string().as_bytes())?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config.descriptor(CONFIG_MEDIA_TYPE),
        "layers": [layer.descriptor(LAYER_MEDIA_TYPE)],
    });
    let manifest = add_blob(&blobs, manifest.to_string().as_bytes())?;
    let mut entry = manifest.descriptor(MANIFEST_MEDIA_TYPE);
    // ctr's importer names an image after io.containerd.image.name as it stands;
    // the OCI ref.name alone is only a tag it would prefix with a name of its own.
    entry["annotations"] = json!({ "io.containerd.image.name": image.name });
    let index = json!({ "schemaVersion": 2, "manifests": [entry] });
    write(&work.join("index.json"), index.to_string().as_bytes())?;
    write(
        &work.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    run(
        Command::new("tar")
            .arg("-C")
            .arg(work)
            .arg("-cf")
            .arg(archive)
            .args(["oci-layout", "index.json", "blobs"]),
        "tar of the image layout",
    )
}

/// `ctr images import` of `archive` into the CRI plugin's namespace of the
/// containerd at `address`, unpacked for `snapshotter` (the one the CRI plugin uses).
pub fn import(address: &Path, archive: &Path, snapshotter: &str) -> Result<(), ImageError> {
    run(
        Command::new("ctr")
            .arg("--address")
            .arg(address)
            .args(["--namespace", CRI_NAMESPACE, "images", "import"])
            .args(["--snapshotter", snapshotter])
            .arg(archive),
        "ctr images import",
    )
}

struct Blob {
    digest: String,
    size: usize,
}

impl Blob {
    fn descriptor(&self, media_type: &str) -> serde_json::Value {
        json!({ "mediaType": media_type, "digest": self.digest, "size": self.size })
    }
}

fn add_blob(blobs: &Path, content: &[u8]) -> Result<Blob, ImageError> {
    let hex = format!("{:x}", Sha256::digest(content));
    write(&blobs.join(&hex), content)?;
    Ok(Blob {
        digest: format!("sha256:{hex}"),
        size: content.len(),
    })
}

fn write(path: &Path, content: &[u8]) -> Result<(), ImageError> {
    std::fs::write(path, content).map_err(io("write", path))
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ImageError {
    let path = path.to_owned();
    move |source| ImageError::Io { what, path, source }
}

fn run(command: &mut Command, what: &str) -> Result<(), ImageError> {
    let out = command.output().map_err(|source| ImageError::Io {
        what: "run",
        path: PathBuf::from(command.get_program()),
        source,
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(ImageError::Command {
        what: what.to_owned(),
        status: out.status,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// The platform's architecture as OCI spells it: containerd unpacks only images
/// whose config matches the host's platform.
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(layout: &Path, descriptor: &serde_json::Value) -> Vec<u8> {
        let digest = descriptor["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let content = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
        assert_eq!(format!("{:x}", Sha256::digest(&content)), hex);
        assert_eq!(descriptor["size"], content.len());
        content
    }

    /// The archive, unpacked, is a layout whose index leads through the manifest to
    /// a config and a layer that are what their digests say, the layer holding the
    /// root filesystem: what containerd's importer checks before it takes the image.
    #[test]
    fn the_archive_is_an_oci_layout_of_the_root_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("bin")).unwrap();
        std::fs::write(rootfs.join("bin/hello"), "hi").unwrap();
        let archive = dir.path().join("image.tar");
        let image = ImageConfig {
            name: "docker.io/test/image:tag",
            cmd: &["/bin/hello", "world"],
        };
        write_archive(&rootfs, &image, &dir.path().join("work"), &archive).unwrap();

        let layout = dir.path().join("unpacked");
        std::fs::create_dir(&layout).unwrap();
        run(
            Command::new("tar")
                .arg("-C")
                .arg(&layout)
                .arg("-xf")
                .arg(&archive),
            "untar",
        )
        .unwrap();
        let read = |p: &str| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(layout.join(p)).unwrap()).unwrap()
        };
        assert_eq!(read("oci-layout")["imageLayoutVersion"], "1.0.0");
        let index = read("index.json");
        let entry = &index["manifests"][0];
        assert_eq!(entry["mediaType"], MANIFEST_MEDIA_TYPE);
        assert_eq!(
            entry["annotations"]["io.containerd.image.name"],
            "docker.io/test/image:tag"
        );
        let manifest: serde_json::Value = serde_json::from_slice(&blob(&layout, entry)).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(&blob(&layout, &manifest["config"])).unwrap();
        assert_eq!(config["config"]["Cmd"], json!(["/bin/hello", "world"]));
        assert_eq!(config["os"], "linux");
        let layer = &manifest["layers"][0];
        assert_eq!(layer["mediaType"], LAYER_MEDIA_TYPE);
        assert_eq!(config["rootfs"]["diff_ids"][0], layer["digest"]);
        let layer_tar = dir.path().join("layer.tar");
        std::fs::write(&layer_tar, blob(&layout, layer)).unwrap();
        let listing = Command::new("tar")
            .arg("-tf")
            .arg(&layer_tar)
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        assert!(listing.lines().any(|l| l == "./bin/hello"), "{listing}");
    }
}
