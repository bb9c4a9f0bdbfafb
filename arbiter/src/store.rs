//! Durable lease records: one JSON file, replaced atomically.
//!
//! Write to a temporary file, fsync it, rename over the old one, fsync the
//! directory: after a crash at any point the file holds either the old or the new
//! table, never a torn one. A lease is acknowledged only after this returns.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use gpushare_proto::Lease;

const FILE_NAME: &str = "leases.json";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("lease store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lease store {path} is corrupt: {source}")]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
}

pub struct LeaseStore {
    dir: PathBuf,
}

impl LeaseStore {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        fs::create_dir_all(dir).map_err(|source| StoreError::Io {
            path: dir.to_owned(),
            source,
        })?;
        Ok(LeaseStore {
            dir: dir.to_owned(),
        })
    }

    pub fn load(&self) -> Result<Vec<Lease>, StoreError> {
        let path = self.dir.join(FILE_NAME);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|source| StoreError::Corrupt { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(StoreError::Io { path, source }),
        }
    }

    pub fn save(&self, leases: &[&Lease]) -> Result<(), StoreError> {
        let path = self.dir.join(FILE_NAME);
        let tmp = self.dir.join(format!("{FILE_NAME}.tmp"));
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| StoreError::Io { path, source }
        };
        let body = serde_json::to_vec_pretty(leases).expect("leases always serialise");
        let mut file = File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(&body).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        fs::rename(&tmp, &path).map_err(io(&path))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&self.dir))?;
        Ok(())
    }
}
