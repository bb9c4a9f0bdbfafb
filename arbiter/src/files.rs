//! Files the daemon keeps beside its store (the paused processes, the reclaim journal),
//! written whole or not at all.

use std::path::Path;

/// Writes `path` whole or not at all (a crash leaves the old file or the new one).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    file.write_all(bytes)?;
    file.as_file().sync_all()?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}
