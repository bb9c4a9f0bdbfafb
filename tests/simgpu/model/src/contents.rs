//! What simulated device memory holds. Each process's bytes live in a sparse file, its
//! *device image* `SIMGPU_DIR/memory/device-<slot>-<generation>` (the process's slot and
//! generation in the shared model), at offset = device address − the process's first device
//! address. Unwritten bytes read as zero and cost no disk: an 8 GiB allocation of which 1 MiB
//! was written holds 1 MiB.
//!
//! A checkpoint renames the device image to `host-<slot>-<generation>` (the bytes leave the
//! device; no device image exists meanwhile) and a restore renames it back; each move counts
//! in the process's `images_moved`, so its driver reopens the image by name afterwards and
//! reads what the restore put there, not an inode it kept open. A process that dies or
//! detaches has both images removed.
//!
//! The naming is pure ([`image_name`]); [`Images`] and [`DeviceImage`] do the file I/O.

use crate::device::ProcessId;
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

/// The directory under `SIMGPU_DIR` that holds the images.
pub const MEMORY_DIR: &str = "memory";
/// Bytes moved per read and write of a device-to-device copy or a memset, so that copying
/// GiBs needs no more RAM than this.
pub const CHUNK_BYTES: u64 = 4 << 20;

/// Where a process's memory contents are: on the device, or moved to the host by a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Device,
    Host,
}

/// The file name of `p`'s image on `side`.
pub fn image_name(side: Side, p: ProcessId) -> String {
    let prefix = match side {
        Side::Device => "device",
        Side::Host => "host",
    };
    format!("{prefix}-{}-{}", p.slot, p.generation)
}

/// `[offset, offset + len)` cut into pieces of at most [`CHUNK_BYTES`]: (offset, length).
pub fn chunks(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(CHUNK_BYTES)).map(move |i| {
        let start = i * CHUNK_BYTES;
        (offset + start, CHUNK_BYTES.min(len - start))
    })
}

/// A buffer of `len` bytes repeating `pattern` from its first byte (`len` a multiple of the
/// pattern's length, as every chunk of a memset is).
pub fn repeated(pattern: &[u8], len: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(len);
    buf.extend_from_slice(&pattern[..pattern.len().min(len)]);
    // Doubling: a handful of memcpys even for a whole chunk.
    while buf.len() < len {
        let take = buf.len().min(len - buf.len());
        buf.extend_from_within(..take);
    }
    buf
}

#[derive(Debug, thiserror::Error)]
#[error("simulated device memory image {path}: {source}")]
pub struct ImageError {
    pub path: String,
    #[source]
    pub source: std::io::Error,
}

fn image_error(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError {
        path: path.display().to_string(),
        source,
    }
}

/// The images of every process, in `SIMGPU_DIR/memory`.
#[derive(Debug, Clone)]
pub struct Images {
    dir: PathBuf,
}

impl Images {
    /// The image directory of the simulated machine in `simgpu_dir`, created if missing.
    pub fn open(simgpu_dir: &Path) -> Result<Images, ImageError> {
        let dir = simgpu_dir.join(MEMORY_DIR);
        // Every process of the machine, whatever its user, creates and removes images here
        // (the state file is as open).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o777)
            .create(&dir)
            .map_err(image_error(&dir))?;
        Ok(Images { dir })
    }

    pub fn path(&self, side: Side, p: ProcessId) -> PathBuf {
        self.dir.join(image_name(side, p))
    }

    /// Renames `p`'s image from `from` to `to`; nothing to do when it has none (it never
    /// wrote to its memory).
    pub fn move_image(&self, p: ProcessId, from: Side, to: Side) -> Result<(), ImageError> {
        let (source, target) = (self.path(from, p), self.path(to, p));
        match std::fs::rename(&source, &target) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(image_error(&source)(e)),
            _ => Ok(()),
        }
    }

    /// Removes both of `p`'s images (those that exist).
    pub fn remove(&self, p: ProcessId) {
        for side in [Side::Device, Side::Host] {
            // Best effort: a missing image is the usual case, and a failure here must not
            // stop the reaping of a dead process.
            let _ = std::fs::remove_file(self.path(side, p));
        }
    }

    /// `p`'s device image, created empty (all zeros) if it does not exist.
    pub fn open_device(&self, p: ProcessId) -> Result<DeviceImage, ImageError> {
        let path = self.path(Side::Device, p);
        let file = crate::shared::open_shared_file(&path).map_err(image_error(&path))?;
        Ok(DeviceImage { file, path })
    }
}

/// One process's device image, open: reads and writes by offset (`pread`/`pwrite`), so
/// threads share it without a lock.
#[derive(Debug)]
pub struct DeviceImage {
    file: File,
    path: PathBuf,
}

impl DeviceImage {
    fn error(&self) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
        image_error(&self.path)
    }

    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.file.write_all_at(data, offset).map_err(self.error())
    }

    /// Fills `buf` from `offset`; bytes never written (holes, or past the end) read as zero.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.error()(e)),
            }
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` to `dst` (a device-to-device copy), a chunk at a time.
    /// A chunk of the source that was never written is a hole: the destination's becomes one
    /// too, so copying unwritten memory costs neither reads nor disk.
    pub fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), ImageError> {
        let mut buf = Vec::new();
        for (from, n) in chunks(src, len) {
            let to = dst + (from - src);
            if self.is_hole(from, n)? {
                self.zero(to, n)?;
                continue;
            }
            buf.resize(n as usize, 0);
            self.read(from, &mut buf)?;
            self.write(to, &buf)?;
        }
        Ok(())
    }

    /// Writes `len` bytes repeating `pattern` (a memset's element) from `offset`; `len` is a
    /// multiple of the pattern's length.
    pub fn fill(&self, offset: u64, len: u64, pattern: &[u8]) -> Result<(), ImageError> {
        if pattern.iter().all(|&b| b == 0) {
            return self.zero(offset, len);
        }
        let buf = repeated(pattern, CHUNK_BYTES.min(len) as usize);
        for (at, n) in chunks(offset, len) {
            self.write(at, &buf[..n as usize])?;
        }
        Ok(())
    }

    /// Whether `[offset, offset + len)` holds no data (never written, or zeroed by a hole).
    fn is_hole(&self, offset: u64, len: u64) -> Result<bool, ImageError> {
        // SAFETY: lseek on a descriptor this image owns; it only moves the file offset,
        // which nothing here uses (all I/O is positional).
        let next_data = unsafe {
            libc::lseek(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                libc::SEEK_DATA,
            )
        };
        if next_data < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // No data at or after `offset`.
                Some(libc::ENXIO) => Ok(true),
                // A file system without hole reporting: treat it all as data.
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
                _ => Err(self.error()(e)),
            };
        }
        Ok(next_data as u64 >= offset + len)
    }

    /// Zeroes `[offset, offset + len)` by punching a hole (no disk), or by writing zeros where
    /// the file system cannot punch.
    fn zero(&self, offset: u64, len: u64) -> Result<(), ImageError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: fallocate on a descriptor this image owns, over a range of it; KEEP_SIZE
        // leaves the length alone (past the end, reads are zero anyway).
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(self.error()(e));
        }
        let zeros = vec![0u8; CHUNK_BYTES.min(len) as usize];
        for (at, n) in chunks(offset, len) {
            self.write(at, &zeros[..n as usize])?;
        }
        Ok(())
    }

    /// Bytes of disk the image takes (its allocated blocks), for tests of sparseness.
    pub fn disk_bytes(path: &Path) -> std::io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(std::fs::metadata(path)?.blocks() * 512)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: ProcessId = ProcessId {
        slot: 3,
        generation: 17,
    };

    #[test]
    fn images_are_named_by_side_slot_and_generation() {
        let table = [
            (Side::Device, P, "device-3-17"),
            (Side::Host, P, "host-3-17"),
            (
                Side::Device,
                ProcessId {
                    slot: 0,
                    generation: 1,
                },
                "device-0-1",
            ),
        ];
        for (side, p, want) in table {
            assert_eq!(image_name(side, p), want, "{side:?} {p:?}");
        }
    }

    #[test]
    fn ranges_are_cut_into_whole_chunks_and_a_remainder() {
        let c = CHUNK_BYTES;
        /// (offset, length)
        type Piece = (u64, u64);
        // A range and its pieces.
        let table: [(Piece, &[Piece]); 4] = [
            ((0, 0), &[]),
            ((10, 5), &[(10, 5)]),
            ((100, c), &[(100, c)]),
            (
                (100, 2 * c + 1),
                &[(100, c), (100 + c, c), (100 + 2 * c, 1)],
            ),
        ];
        for ((offset, len), want) in table {
            assert_eq!(
                chunks(offset, len).collect::<Vec<_>>(),
                want,
                "{offset}+{len}"
            );
        }
    }

    #[test]
    fn a_pattern_repeats_from_the_first_byte() {
        assert_eq!(repeated(&[7], 3), vec![7, 7, 7]);
        assert_eq!(repeated(&[1, 2, 3, 4], 8), vec![1, 2, 3, 4, 1, 2, 3, 4]);
        assert_eq!(repeated(&[1, 2, 3, 4], 0), Vec::<u8>::new());
        assert_eq!(
            repeated(&[9, 8, 7, 6], CHUNK_BYTES as usize).len(),
            CHUNK_BYTES as usize
        );
    }

    fn image() -> (tempfile::TempDir, Images, DeviceImage) {
        let dir = tempfile::tempdir().unwrap();
        let images = Images::open(dir.path()).unwrap();
        let image = images.open_device(P).unwrap();
        (dir, images, image)
    }

    fn read(image: &DeviceImage, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0xaa; len];
        image.read(offset, &mut buf).unwrap();
        buf
    }

    #[test]
    fn unwritten_bytes_read_as_zero_and_cost_no_disk() {
        let (_dir, images, image) = image();
        let far = 8u64 << 30;
        image.write(far, &[1, 2, 3]).unwrap();
        assert_eq!(read(&image, 0, 4), vec![0; 4], "a hole");
        assert_eq!(
            read(&image, far - 1, 5),
            vec![0, 1, 2, 3, 0],
            "and past the end"
        );
        let disk = DeviceImage::disk_bytes(&images.path(Side::Device, P)).unwrap();
        assert!(
            disk <= 1 << 20,
            "8 GiB in, 3 bytes written: {disk} bytes of disk"
        );
    }

    #[test]
    fn a_copy_moves_bytes_and_copies_holes_as_holes() {
        let (_dir, _images, image) = image();
        let data: Vec<u8> = (0..(CHUNK_BYTES + 10)).map(|i| (i % 251) as u8).collect();
        image.write(1000, &data).unwrap();
        image
            .copy(CHUNK_BYTES * 4, 1000, data.len() as u64)
            .unwrap();
        assert_eq!(read(&image, CHUNK_BYTES * 4, data.len()), data);
        // An unwritten source zeroes what the destination held.
        image.copy(1000, CHUNK_BYTES * 64, 100).unwrap();
        assert_eq!(read(&image, 1000, 100), vec![0; 100]);
        assert_eq!(read(&image, 1100, 10), data[100..110].to_vec());
    }

    #[test]
    fn a_fill_repeats_its_element_and_zero_fills_clear() {
        let (_dir, _images, image) = image();
        image.fill(8, 12, &[0xde, 0xad, 0xbe, 0xef]).unwrap();
        assert_eq!(
            read(&image, 4, 20),
            [&[0; 4][..], &[0xde, 0xad, 0xbe, 0xef].repeat(3), &[0; 4]].concat()
        );
        image.fill(12, 4, &[0]).unwrap();
        assert_eq!(
            read(&image, 8, 12),
            [
                &[0xde, 0xad, 0xbe, 0xef][..],
                &[0; 4],
                &[0xde, 0xad, 0xbe, 0xef]
            ]
            .concat()
        );
        image.fill(0, CHUNK_BYTES + 3, &[5]).unwrap();
        assert!(read(&image, 0, (CHUNK_BYTES + 3) as usize)
            .iter()
            .all(|&b| b == 5));
        assert_eq!(read(&image, CHUNK_BYTES + 3, 1), vec![0]);
    }

    #[test]
    fn moving_an_image_renames_it_and_a_missing_one_is_nothing_to_move() {
        let (_dir, images, image) = image();
        image.write(0, b"kept").unwrap();
        drop(image);
        images.move_image(P, Side::Device, Side::Host).unwrap();
        assert!(!images.path(Side::Device, P).exists());
        assert_eq!(std::fs::read(images.path(Side::Host, P)).unwrap(), b"kept");
        images.move_image(P, Side::Host, Side::Device).unwrap();
        assert_eq!(
            std::fs::read(images.path(Side::Device, P)).unwrap(),
            b"kept"
        );
        let other = ProcessId {
            slot: 4,
            generation: 1,
        };
        images.move_image(other, Side::Device, Side::Host).unwrap();
        assert!(!images.path(Side::Host, other).exists());
        images.remove(P);
        assert!(!images.path(Side::Device, P).exists());
    }
}
