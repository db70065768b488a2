//! The image a volume is dumped to at a clean stop and restored from at
//! start. All integers little-endian; every block a multiple of 4 KiB so
//! the file can be written and read with O_DIRECT.
//!
//! ```text
//! header   4 KiB   "RAMSLOGI", format, generation, size, block size,
//!                  chunk size, chunk count, LUN, NAA, taken-at, serial,
//!                  target, reservations length and CRC32C (format 2);
//!                  CRC32C of the block's first 4092 bytes at 4092
//! reservations     format 2 only: the persistent reservations a host asked
//!          n × 4 KiB to keep through power loss (APTPL), as JSON, zero
//!                  padded to whole blocks
//! chunk    4 KiB   "RLCHUNK\0", index, generation, data length,
//!                  CRC32C(index, generation, data); CRC of the prefix
//!          data    the chunk's bytes (1 MiB, less for the LUN's last chunk)
//! ...      chunks in strictly increasing index order, written ones only
//! commit   4 KiB   "RLCOMMIT", generation, chunk count, CRC32C over every
//!                  chunk CRC in order, CRC of the block
//! ```
//! The file's length is exactly the sum of these; anything else is refused.
//! An image without reservations is written as format 1, which every
//! earlier release reads.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use thiserror::Error;

use super::kept::KeptReservations;
use super::{naa_hex, Identity, CHUNK_SIZE};
use crate::private_dir::{create_private, open_regular};
use crate::store::Store;

const BLOCK: usize = 4096;
const FORMAT: u32 = 1;
/// Format 1 followed by the reservations' blocks.
const FORMAT_WITH_RESERVATIONS: u32 = 2;
/// Where the header keeps the reservations' length and checksum.
const RESERVATIONS_AT: usize = 400;
/// The most the reservations may take: 64 registrations with the longest
/// iSCSI names fit in a quarter of it.
const MAX_RESERVATIONS: usize = 128 << 10;
const HEADER_MAGIC: &[u8; 8] = b"RAMSLOGI";
const CHUNK_MAGIC: &[u8; 8] = b"RLCHUNK\0";
const COMMIT_MAGIC: &[u8; 8] = b"RLCOMMIT";
/// Longest target name (RFC 7143: 223 bytes) and serial the header holds.
const MAX_TARGET: usize = 223;
const MAX_SERIAL: usize = 64;
/// Free space kept beyond the image: the state file's rewrite and slack.
pub const SPACE_MARGIN: u64 = 16 << 20;

/// Everything an image says about the volume it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageIdentity {
    pub target: String,
    pub lun: u64,
    pub identity: Identity,
    pub size: u64,
    pub block_size: u32,
    pub generation: u64,
}

#[derive(Debug, Error)]
pub enum ImageError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("image is truncated ({0})")]
    Truncated(&'static str),
    #[error("image {0} is damaged: {1}")]
    Damaged(&'static str, String),
    #[error("image belongs to another volume or generation: {0}")]
    Mismatch(String),
    #[error("not enough space in {dir}: the image needs {need} bytes, {free} are free")]
    NoSpace { dir: PathBuf, need: u64, free: u64 },
    #[error("interrupted")]
    Cancelled,
}

/// The file name of an image: by NAA and generation.
pub fn image_name(naa: &[u8; 8], generation: u64) -> String {
    format!("{}-g{generation}.img", naa_hex(naa))
}

fn tmp_name(naa: &[u8; 8], generation: u64) -> String {
    format!("{}.tmp", image_name(naa, generation))
}

/// Unlink one stale image; true if this call removed it. One another tidy
/// removed first (the take-over's background tidy beside a dump) is gone,
/// as wanted.
fn remove_stale(path: &Path) -> std::io::Result<bool> {
    tracing::info!(file = %path.display(), "removing a stale image");
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Remove this identity's temporary files and its images of every
/// generation except `keep`. Files of other identities are never touched:
/// two daemons may share one image directory.
pub fn remove_images(dir: &Path, naa: &[u8; 8], keep: Option<u64>) -> std::io::Result<()> {
    let prefix = format!("{}-g", naa_hex(naa));
    let keep = keep.map(|g| image_name(naa, g));
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut removed = false;
    for e in entries {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(&prefix) || keep.as_deref() == Some(name) {
            continue;
        }
        if name.ends_with(".img") || name.ends_with(".img.tmp") {
            removed |= remove_stale(&e.path())?;
        }
    }
    if removed {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Remove this identity's images (and temporary files) of generations
/// below `below`, leaving every later one: safe beside a dump of a later
/// generation, so it can run in the background (a 4 GiB image takes
/// seconds to unlink, which a restart's take-over must not wait for).
pub fn remove_older_images(dir: &Path, naa: &[u8; 8], below: u64) -> std::io::Result<()> {
    let prefix = format!("{}-g", naa_hex(naa));
    let mut removed = false;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let Some(generation) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|n| {
                n.strip_suffix(".img")
                    .or_else(|| n.strip_suffix(".img.tmp"))
            })
            .and_then(|g| g.parse::<u64>().ok())
        else {
            continue;
        };
        if generation < below {
            removed |= remove_stale(&e.path())?;
        }
    }
    if removed {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// A 4 KiB-aligned buffer (O_DIRECT needs aligned memory), safely: an
/// over-allocated vector and the aligned window inside it.
struct Aligned {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let raw = vec![0u8; len + BLOCK];
        let start = raw.as_ptr().align_offset(BLOCK).min(BLOCK);
        Aligned { raw, start, len }
    }
    fn get(&self, len: usize) -> &[u8] {
        &self.raw[self.start..self.start + len.min(self.len)]
    }
    fn get_mut(&mut self, len: usize) -> &mut [u8] {
        let end = self.start + len.min(self.len);
        &mut self.raw[self.start..end]
    }
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Seal a 4 KiB block: CRC32C of its first 4092 bytes in the last four.
fn seal(block: &mut [u8]) {
    let crc = crc32c::crc32c(&block[..BLOCK - 4]);
    put_u32(block, BLOCK - 4, crc);
}
fn sealed(block: &[u8]) -> bool {
    crc32c::crc32c(&block[..BLOCK - 4]) == get_u32(block, BLOCK - 4)
}

/// The commit record's chain of chunk checksums starts from the header's
/// own checksum: a commit record only closes the header it was written with.
fn commit_seed(header: &[u8]) -> u32 {
    get_u32(header, BLOCK - 4)
}

/// A chunk's checksum covers its index and generation, then its data:
/// this is the CRC32C state before the data.
fn chunk_seed(index: u64, generation: u64) -> u32 {
    crc32c::crc32c_append(
        crc32c::crc32c(&index.to_le_bytes()),
        &generation.to_le_bytes(),
    )
}

/// Bytes of chunk `index` of a volume of `size` bytes.
fn chunk_len(size: u64, index: u64) -> u64 {
    (size - index * CHUNK_SIZE).min(CHUNK_SIZE)
}

/// Whole blocks for `len` bytes of reservations.
fn reservation_blocks(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

fn encode_header(
    id: &ImageIdentity,
    chunk_count: u64,
    taken_unix: u64,
    reservations: &[u8],
) -> Result<Vec<u8>, String> {
    if id.target.len() > MAX_TARGET || id.identity.serial.len() > MAX_SERIAL {
        return Err("target name or serial too long for the image header".into());
    }
    if reservations.len() > MAX_RESERVATIONS {
        return Err(format!(
            "{} bytes of persistent reservations, more than an image holds",
            reservations.len()
        ));
    }
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(HEADER_MAGIC);
    if reservations.is_empty() {
        put_u32(&mut b, 8, FORMAT);
    } else {
        put_u32(&mut b, 8, FORMAT_WITH_RESERVATIONS);
        put_u32(&mut b, RESERVATIONS_AT, reservations.len() as u32);
        put_u32(&mut b, RESERVATIONS_AT + 4, crc32c::crc32c(reservations));
    }
    put_u64(&mut b, 16, id.generation);
    put_u64(&mut b, 24, id.size);
    put_u32(&mut b, 32, id.block_size);
    put_u32(&mut b, 36, CHUNK_SIZE as u32);
    put_u64(&mut b, 40, chunk_count);
    put_u64(&mut b, 48, id.lun);
    b[56..64].copy_from_slice(&id.identity.naa);
    put_u64(&mut b, 64, taken_unix);
    b[72..74].copy_from_slice(&(id.identity.serial.len() as u16).to_le_bytes());
    b[74..74 + id.identity.serial.len()].copy_from_slice(id.identity.serial.as_bytes());
    let t = 74 + MAX_SERIAL;
    b[t..t + 2].copy_from_slice(&(id.target.len() as u16).to_le_bytes());
    b[t + 2..t + 2 + id.target.len()].copy_from_slice(id.target.as_bytes());
    seal(&mut b);
    Ok(b)
}

struct Header {
    id: ImageIdentity,
    chunk_size: u32,
    chunk_count: u64,
    taken_unix: u64,
    /// Length and CRC32C of the reservations that follow (0 and 0: none).
    reservations: (usize, u32),
}

fn decode_header(b: &[u8]) -> Result<Header, ImageError> {
    let damaged = |what: &str| ImageError::Damaged("header", what.to_string());
    if &b[..8] != HEADER_MAGIC {
        return Err(damaged("not a ramslog image"));
    }
    if !sealed(b) {
        return Err(damaged("checksum mismatch"));
    }
    let reservations = match get_u32(b, 8) {
        FORMAT => (0, 0),
        FORMAT_WITH_RESERVATIONS => {
            let len = get_u32(b, RESERVATIONS_AT) as usize;
            if len == 0 || len > MAX_RESERVATIONS {
                return Err(damaged("bad reservations length"));
            }
            (len, get_u32(b, RESERVATIONS_AT + 4))
        }
        _ => return Err(damaged("unknown format version")),
    };
    let serial_len = usize::from(get_u16(b, 72));
    let t = 74 + MAX_SERIAL;
    let target_len = usize::from(get_u16(b, t));
    if serial_len > MAX_SERIAL || target_len > MAX_TARGET {
        return Err(damaged("bad string length"));
    }
    let text = |s: &[u8]| String::from_utf8(s.to_vec()).map_err(|_| damaged("bad text"));
    let mut naa = [0u8; 8];
    naa.copy_from_slice(&b[56..64]);
    Ok(Header {
        id: ImageIdentity {
            generation: get_u64(b, 16),
            size: get_u64(b, 24),
            block_size: get_u32(b, 32),
            lun: get_u64(b, 48),
            identity: Identity {
                naa,
                serial: text(&b[74..74 + serial_len])?,
            },
            target: text(&b[t + 2..t + 2 + target_len])?,
        },
        chunk_size: get_u32(b, 36),
        chunk_count: get_u64(b, 40),
        taken_unix: get_u64(b, 64),
        reservations,
    })
}

fn fd_path(f: &File) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/self/fd/{}", f.as_raw_fd())
}

mod dump;
mod restore;

pub use dump::*;
pub use restore::*;

#[cfg(test)]
mod tests {
    use super::*;

    /// A start-up stop dumps (removing every image of the identity) while
    /// the take-over's background tidy removes the older ones: a file the
    /// other removed first is gone, as wanted, not a failed dump.
    #[test]
    fn two_tidies_racing_over_the_same_images_both_succeed() {
        let dir = std::env::temp_dir().join(format!("ramslog-race-{}", std::process::id()));
        let naa = [3u8; 8];
        let mut failures = Vec::new();
        for _ in 0..20 {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("mkdir");
            for g in 0..300 {
                std::fs::write(dir.join(image_name(&naa, g)), b"x").expect("write");
            }
            let background = {
                let dir = dir.clone();
                std::thread::spawn(move || remove_older_images(&dir, &naa, u64::MAX))
            };
            let dump = remove_images(&dir, &naa, None);
            let tidy = background.join().expect("the tidy thread");
            failures.extend(dump.err().into_iter().chain(tidy.err()));
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            failures.is_empty(),
            "a tidy failed on a file the other removed: {failures:?}"
        );
    }

    /// Only this identity's older generations go: the current one, a later
    /// one (a dump under way beside the tidy) and other identities stay.
    #[test]
    fn older_images_go_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("ramslog-older-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let (mine, other) = ([1u8; 8], [2u8; 8]);
        let names = [
            image_name(&mine, 3),
            tmp_name(&mine, 4),
            image_name(&mine, 5),
            image_name(&mine, 6),
            tmp_name(&mine, 6),
            image_name(&other, 1),
            format!("{}-gX.img", naa_hex(&mine)),
        ];
        for n in &names {
            std::fs::write(dir.join(n), b"x").expect("write");
        }
        remove_older_images(&dir, &mine, 5).expect("tidy");
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = names[2..].to_vec();
        want.sort();
        assert_eq!(left, want);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
