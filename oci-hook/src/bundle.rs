//! A bundle's config.json, replaced atomically and restorable byte for byte.
//!
//! A failed create must leave the spec on disk exactly as it was, so the original
//! bytes are kept and written back (again atomically) on any failure after an edit.

use std::fs::{self, File, Permissions};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::spec::Spec;

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// A JSON file (a bundle's config.json, or an exec process.json) that is
/// replaced atomically and can be put back byte for byte.
#[derive(Debug)]
pub struct BundleSpec {
    path: PathBuf,
    original: Vec<u8>,
    permissions: Permissions,
}

impl BundleSpec {
    /// A bundle's spec.
    pub fn open(bundle_dir: &Path) -> Result<(BundleSpec, Spec), BundleError> {
        Self::open_file(&bundle_dir.join("config.json"))
    }

    /// Any JSON document: a spec, an exec process (`spec::Process`).
    pub fn open_file<D: DeserializeOwned>(path: &Path) -> Result<(BundleSpec, D), BundleError> {
        let path = path.to_owned();
        let io = |source| BundleError::Io {
            path: path.clone(),
            source,
        };
        let original = fs::read(&path).map_err(io)?;
        let permissions = fs::metadata(&path).map_err(io)?.permissions();
        let spec = serde_json::from_slice(&original).map_err(|source| BundleError::Json {
            path: path.clone(),
            source,
        })?;
        Ok((
            BundleSpec {
                path,
                original,
                permissions,
            },
            spec,
        ))
    }

    pub fn write(&self, document: &impl Serialize) -> Result<(), BundleError> {
        let body = serde_json::to_vec(document).expect("a JSON document always serialises");
        self.replace_with(&body)
    }

    /// Puts the original bytes back.
    pub fn restore(&self) -> Result<(), BundleError> {
        self.replace_with(&self.original)
    }

    fn replace_with(&self, body: &[u8]) -> Result<(), BundleError> {
        let tmp = self
            .path
            .with_file_name(format!(".config.json.gpushare-{}", std::process::id()));
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| BundleError::Io { path, source }
        };
        let result = (|| {
            let mut file = File::create(&tmp).map_err(io(&tmp))?;
            file.set_permissions(Permissions::from_mode(self.permissions.mode()))
                .map_err(io(&tmp))?;
            file.write_all(body).map_err(io(&tmp))?;
            file.sync_all().map_err(io(&tmp))?;
            fs::rename(&tmp, &self.path).map_err(io(&self.path))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_restore_gives_back_the_exact_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let original = b"{ \"ociVersion\" : \"1.0.2\",\n  \"x\": [1,2] }\n";
        fs::write(dir.path().join("config.json"), original).unwrap();
        fs::set_permissions(
            dir.path().join("config.json"),
            Permissions::from_mode(0o640),
        )
        .unwrap();
        let (bundle, mut spec) = BundleSpec::open(dir.path()).unwrap();
        spec.annotations_mut().unwrap().set("k", "v");
        bundle.write(&spec).unwrap();
        assert_ne!(fs::read(dir.path().join("config.json")).unwrap(), original);
        bundle.restore().unwrap();
        assert_eq!(fs::read(dir.path().join("config.json")).unwrap(), original);
        let mode = fs::metadata(dir.path().join("config.json"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o640);
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left behind"
        );
    }

    #[test]
    fn invalid_json_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("config.json"), b"{nope").unwrap();
        let err = BundleSpec::open(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("config.json") && err.contains("not valid JSON"),
            "{err}"
        );
    }
}
