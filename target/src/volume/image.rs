//! The image a volume is dumped to at a clean stop and restored from at
//! start. All integers little-endian; every block a multiple of 4 KiB so
//! the file can be written and read with O_DIRECT.
//!
//! ```text
//! header   4 KiB   "RAMSLOGI", format, generation, size, block size,
//!                  chunk size, chunk count, LUN, NAA, taken-at, serial,
//!                  target; CRC32C of the block's first 4092 bytes at 4092
//! chunk    4 KiB   "RLCHUNK\0", index, generation, data length,
//!                  CRC32C(index, generation, data); CRC of the prefix
//!          data    the chunk's bytes (1 MiB, less for the LUN's last chunk)
//! ...      chunks in strictly increasing index order, written ones only
//! commit   4 KiB   "RLCOMMIT", generation, chunk count, CRC32C over every
//!                  chunk CRC in order, CRC of the block
//! ```
//! The file's length is exactly the sum of these; anything else is refused.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use thiserror::Error;

use super::{Identity, CHUNK_SIZE};
use crate::state::naa_hex;
use crate::store::Store;

const BLOCK: usize = 4096;
const FORMAT: u32 = 1;
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

/// Create the image directory (0700) if needed and tighten a looser one.
pub fn prepare_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o777;
    if mode != 0o700 {
        tracing::warn!(dir = %dir.display(), "image directory had mode {mode:o}; setting 0700");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
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
            tracing::info!(file = %e.path().display(), "removing a stale image");
            std::fs::remove_file(e.path())?;
            removed = true;
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

fn encode_header(id: &ImageIdentity, chunk_count: u64, taken_unix: u64) -> Result<Vec<u8>, String> {
    if id.target.len() > MAX_TARGET || id.identity.serial.len() > MAX_SERIAL {
        return Err("target name or serial too long for the image header".into());
    }
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(HEADER_MAGIC);
    put_u32(&mut b, 8, FORMAT);
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
}

fn decode_header(b: &[u8]) -> Result<Header, ImageError> {
    let damaged = |what: &str| ImageError::Damaged("header", what.to_string());
    if &b[..8] != HEADER_MAGIC {
        return Err(damaged("not a ramslog image"));
    }
    if !sealed(b) {
        return Err(damaged("checksum mismatch"));
    }
    if get_u32(b, 8) != FORMAT {
        return Err(damaged("unknown format version"));
    }
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
    })
}

/// How the image file is written: O_DIRECT where the filesystem takes it.
struct Output {
    file: File,
    direct: bool,
    offset: u64,
}

impl Output {
    fn create(path: &Path) -> std::io::Result<Output> {
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.write(true).create_new(true).mode(0o600);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        match open(true) {
            Ok(file) => Ok(Output {
                file,
                direct: true,
                offset: 0,
            }),
            // tmpfs before Linux 6.6 refuses O_DIRECT, after creating the
            // file: start again without it.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let _ = std::fs::remove_file(path);
                Ok(Output {
                    file: open(false)?,
                    direct: false,
                    offset: 0,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self.file.write_all_at(data, self.offset) {
            Err(e) if self.direct && self.offset == 0 && e.raw_os_error() == Some(libc::EINVAL) => {
                // O_DIRECT accepted at open but not for writes: go buffered.
                self.direct = false;
                // /proc/self/fd/N names the same file, opened without O_DIRECT.
                self.file = OpenOptions::new().write(true).open(fd_path(&self.file))?;
                self.file.write_all_at(data, self.offset)?;
            }
            r => r?,
        }
        self.offset += data.len() as u64;
        Ok(())
    }

    /// Records straight from the LUN memory (see `Store::write_parts_to`).
    fn write_store(&mut self, store: &Store, parts: &[(&[u8], u64, usize)]) -> std::io::Result<()> {
        self.offset += store.write_parts_to(&self.file, self.offset, parts)? as u64;
        Ok(())
    }
}

/// Records the dump writes per `pwritev`.
const RECORDS_PER_WRITE: usize = 8;
/// Batches in flight between the checksummer and the writer.
const WRITES_IN_FLIGHT: usize = 3;

/// What the dump's writer thread writes next.
enum Job {
    /// One 4 KiB block (the header, the commit record).
    Block(Aligned),
    /// Records: `prefixes` holds their 4 KiB prefixes in order; each
    /// record's data is `len` bytes of the LUN at `offset`.
    Records {
        prefixes: Aligned,
        data: [(u64, usize); RECORDS_PER_WRITE],
        count: usize,
    },
}

/// What a dump did.
#[derive(Debug, Clone)]
pub struct DumpReport {
    pub path: PathBuf,
    pub chunks: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub direct: bool,
}

/// Free bytes for an unprivileged writer on the filesystem of `dir`.
pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    let st = rustix::fs::statvfs(dir).map_err(std::io::Error::from)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Bytes of an image holding `chunks` (by index) of a volume of `size` bytes.
pub fn image_len(size: u64, chunks: impl Iterator<Item = u64>) -> u64 {
    let data: u64 = chunks.map(|c| BLOCK as u64 + chunk_len(size, c)).sum();
    2 * BLOCK as u64 + data
}

/// Write the image of `id` holding the chunks `written` says were written:
/// to a temporary file, fsync, rename, directory fsync. On error the
/// temporary file is removed and no image of this generation exists.
pub fn dump(
    dir: &Path,
    id: &ImageIdentity,
    store: &Store,
    written: &super::WrittenChunks,
) -> Result<DumpReport, ImageError> {
    let started = Instant::now();
    let chunks: Vec<u64> = (0..written.chunks())
        .filter(|c| written.is_marked(*c))
        .collect();
    let len = image_len(id.size, chunks.iter().copied());
    let free = free_space(dir)?;
    let need = len + SPACE_MARGIN;
    if free < need {
        return Err(ImageError::NoSpace {
            dir: dir.into(),
            need,
            free,
        });
    }
    let tmp = dir.join(tmp_name(&id.identity.naa, id.generation));
    let path = dir.join(image_name(&id.identity.naa, id.generation));
    let _ = std::fs::remove_file(&tmp);
    let result = write_image(&tmp, id, store, &chunks);
    let direct = match result {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()?;
    Ok(DumpReport {
        path,
        chunks: chunks.len() as u64,
        bytes: len,
        seconds: started.elapsed().as_secs_f64(),
        direct,
    })
}

/// The image file: header, records, commit, fsync. The checksums are
/// computed here while a writer thread writes the previous batch straight
/// from the LUN memory, so the disk never waits for the CPU.
fn write_image(
    tmp: &Path,
    id: &ImageIdentity,
    store: &Store,
    chunks: &[u64],
) -> Result<bool, ImageError> {
    // Checked before anything is written: its error is the dump's error.
    let header =
        encode_header(id, chunks.len() as u64, super::now_unix()).map_err(ImageError::Mismatch)?;
    let out = Output::create(tmp)?;
    let batch_bytes = RECORDS_PER_WRITE * BLOCK;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(WRITES_IN_FLIGHT);
        let (back, spare) = std::sync::mpsc::sync_channel::<Aligned>(WRITES_IN_FLIGHT + 1);
        for _ in 0..=WRITES_IN_FLIGHT {
            let _ = back.send(Aligned::new(batch_bytes));
        }
        let writer = std::thread::Builder::new()
            .name("image-write".into())
            .spawn_scoped(scope, move || -> std::io::Result<Output> {
                let mut out = out;
                for job in rx {
                    let buf = match job {
                        Job::Block(buf) => {
                            out.write(buf.get(BLOCK))?;
                            buf
                        }
                        Job::Records {
                            prefixes,
                            data,
                            count,
                        } => {
                            let mut parts = [(&[][..], 0u64, 0usize); RECORDS_PER_WRITE];
                            for (i, part) in parts.iter_mut().enumerate().take(count) {
                                let prefix = &prefixes.get(batch_bytes)[i * BLOCK..(i + 1) * BLOCK];
                                *part = (prefix, data[i].0, data[i].1);
                            }
                            out.write_store(store, &parts[..count])?;
                            prefixes
                        }
                    };
                    let _ = back.send(buf);
                }
                Ok(out)
            })?;
        // Stops early (returning the writer's error) if the writer is gone.
        let produce = || -> Result<(), ()> {
            let block = |bytes: &[u8]| -> Result<Job, ()> {
                let mut buf = spare.recv().map_err(|_| ())?;
                buf.get_mut(BLOCK).copy_from_slice(bytes);
                Ok(Job::Block(buf))
            };
            tx.send(block(&header)?).map_err(|_| ())?;
            let mut chain = commit_seed(&header);
            for group in chunks.chunks(RECORDS_PER_WRITE) {
                let mut prefixes = spare.recv().map_err(|_| ())?;
                let mut data = [(0u64, 0usize); RECORDS_PER_WRITE];
                for (i, &c) in group.iter().enumerate() {
                    let n = chunk_len(id.size, c) as usize;
                    let crc = store
                        .crc32c_append(chunk_seed(c, id.generation), c * CHUNK_SIZE, n)
                        .map_err(|_| ())?;
                    let p = &mut prefixes.get_mut(batch_bytes)[i * BLOCK..(i + 1) * BLOCK];
                    p.fill(0);
                    p[..8].copy_from_slice(CHUNK_MAGIC);
                    put_u64(p, 8, c);
                    put_u64(p, 16, id.generation);
                    put_u64(p, 24, n as u64);
                    put_u32(p, 32, crc);
                    seal(p);
                    chain = crc32c::crc32c_append(chain, &crc.to_le_bytes());
                    data[i] = (c * CHUNK_SIZE, n);
                }
                tx.send(Job::Records {
                    prefixes,
                    data,
                    count: group.len(),
                })
                .map_err(|_| ())?;
            }
            let mut commit = vec![0u8; BLOCK];
            commit[..8].copy_from_slice(COMMIT_MAGIC);
            put_u64(&mut commit, 8, id.generation);
            put_u64(&mut commit, 16, chunks.len() as u64);
            put_u32(&mut commit, 24, chain);
            seal(&mut commit);
            tx.send(block(&commit)?).map_err(|_| ())
        };
        let produced = produce();
        drop(tx);
        let out = match writer.join() {
            Ok(r) => r?,
            Err(_) => {
                return Err(ImageError::Io(std::io::Error::other(
                    "image writer panicked",
                )))
            }
        };
        if produced.is_err() {
            return Err(ImageError::Io(std::io::Error::other(
                "image header or checksums could not be produced",
            )));
        }
        out.file.sync_all()?;
        Ok(out.direct)
    })
}

/// What a restore loaded.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    pub path: PathBuf,
    pub chunks: Vec<u64>,
    pub bytes: u64,
    pub seconds: f64,
    pub taken_unix: u64,
}

fn open_for_read(path: &Path) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).custom_flags(libc::O_DIRECT);
    match o.open(path) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => File::open(path),
        r => r,
    }
}

fn fd_path(f: &File) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/self/fd/{}", f.as_raw_fd())
}

/// Verify the image at `path` against `expect` while loading it into
/// `store`, which must be freshly zeroed. On any error the store is zeroed
/// again: nothing of a refused image stays. `cancelled` is polled between
/// chunks (a stop during restore).
pub fn restore(
    path: &Path,
    expect: &ImageIdentity,
    store: &Store,
    cancelled: &dyn Fn() -> bool,
) -> Result<RestoreReport, ImageError> {
    let started = Instant::now();
    let result = load(path, expect, Some(store), cancelled);
    if result.is_err() {
        let _ = store.zero(0, store.len() as usize);
    }
    let (chunks, bytes, taken_unix) = result?;
    Ok(RestoreReport {
        path: path.into(),
        chunks,
        bytes,
        seconds: started.elapsed().as_secs_f64(),
        taken_unix,
    })
}

/// Bytes read ahead of the verifier in one go, and how many such windows
/// may be in flight.
const READ_WINDOW: usize = 8 << 20;
const READ_WINDOWS: usize = 3;

/// The image read sequentially in large windows on a helper thread, so the
/// disk keeps working while the caller verifies and copies.
struct Stream {
    rx: std::sync::mpsc::Receiver<std::io::Result<(Aligned, usize)>>,
    back: std::sync::mpsc::SyncSender<Aligned>,
    cur: Option<(Aligned, usize)>,
    pos: usize,
    /// File offset of the next byte handed out.
    offset: u64,
}

impl Stream {
    fn start(file: File) -> std::io::Result<Stream> {
        let (tx, rx) = std::sync::mpsc::sync_channel(READ_WINDOWS);
        let (back, spare) = std::sync::mpsc::sync_channel::<Aligned>(READ_WINDOWS);
        for _ in 0..READ_WINDOWS {
            let _ = back.send(Aligned::new(READ_WINDOW));
        }
        std::thread::Builder::new()
            .name("image-read".into())
            .spawn(move || {
                let mut file = file;
                let mut offset = 0u64;
                // Ends when the reader is dropped (both channels close).
                while let Ok(mut buf) = spare.recv() {
                    let r = read_window(&mut file, buf.get_mut(READ_WINDOW), offset);
                    let done = !matches!(r, Ok(n) if n == READ_WINDOW);
                    if let Ok(n) = r {
                        offset += n as u64;
                    }
                    if tx.send(r.map(|n| (buf, n))).is_err() || done {
                        return;
                    }
                }
            })?;
        Ok(Stream {
            rx,
            back,
            cur: None,
            pos: 0,
            offset: 0,
        })
    }

    /// Make bytes available; false at the end of the file.
    fn fill(&mut self) -> Result<bool, ImageError> {
        loop {
            if let Some((_, len)) = &self.cur {
                if self.pos < *len {
                    return Ok(true);
                }
                if *len < READ_WINDOW {
                    return Ok(false);
                }
                if let Some((buf, _)) = self.cur.take() {
                    let _ = self.back.send(buf);
                }
            }
            match self.rx.recv() {
                Ok(Ok((buf, len))) => {
                    self.cur = Some((buf, len));
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e.into()),
                // The reader ended after a short window: the end of the file.
                Err(_) => return Ok(false),
            }
        }
    }

    /// Hand the next `n` bytes to `sink`, in pieces.
    fn read(
        &mut self,
        mut n: usize,
        what: &'static str,
        mut sink: impl FnMut(&[u8]) -> Result<(), ImageError>,
    ) -> Result<(), ImageError> {
        while n > 0 {
            if !self.fill()? {
                return Err(ImageError::Truncated(what));
            }
            let Some((buf, len)) = &self.cur else {
                return Err(ImageError::Truncated(what));
            };
            let take = n.min(len - self.pos);
            sink(&buf.get(READ_WINDOW)[self.pos..self.pos + take])?;
            self.pos += take;
            self.offset += take as u64;
            n -= take;
        }
        Ok(())
    }

    fn read_block(&mut self, what: &'static str) -> Result<[u8; BLOCK], ImageError> {
        let mut block = [0u8; BLOCK];
        let mut at = 0;
        self.read(BLOCK, what, |piece| {
            block[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
            Ok(())
        })?;
        Ok(block)
    }
}

/// Fill `buf` from `offset` as far as the file goes; O_DIRECT where the
/// file was opened with it, buffered if the kernel refuses a read.
fn read_window(file: &mut File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    let mut reopened = false;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && !reopened => {
                *file = File::open(fd_path(file))?;
                reopened = true;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Check a written image end to end without loading it (the dump's check
/// when data may still have been arriving while it was written).
pub fn verify(path: &Path, expect: &ImageIdentity) -> Result<(), ImageError> {
    load(path, expect, None, &|| false).map(|_| ())
}

/// Verify the image and, with `store`, copy each chunk into it as it
/// streams in.
fn load(
    path: &Path,
    expect: &ImageIdentity,
    store: Option<&Store>,
    cancelled: &dyn Fn() -> bool,
) -> Result<(Vec<u64>, u64, u64), ImageError> {
    let f = open_for_read(path)?;
    let file_len = f.metadata()?.len();
    let mut s = Stream::start(f)?;
    let header = s.read_block("in the header")?;
    let h = decode_header(&header)?;
    let mut chain = commit_seed(&header);
    if h.id != *expect {
        return Err(ImageError::Mismatch(describe_mismatch(&h.id, expect)));
    }
    if u64::from(h.chunk_size) != CHUNK_SIZE {
        return Err(ImageError::Damaged(
            "header",
            "unexpected chunk size".into(),
        ));
    }
    let total_chunks = expect.size.div_ceil(CHUNK_SIZE);
    if h.chunk_count > total_chunks {
        return Err(ImageError::Damaged(
            "header",
            "more chunks than the volume has".into(),
        ));
    }
    let mut loaded = Vec::with_capacity(h.chunk_count as usize);
    for _ in 0..h.chunk_count {
        if cancelled() {
            return Err(ImageError::Cancelled);
        }
        let at = s.offset;
        let prefix = s.read_block("in a chunk")?;
        if &prefix[..8] != CHUNK_MAGIC || !sealed(&prefix) {
            return Err(ImageError::Damaged(
                "chunk",
                format!("bad chunk header at byte {at}"),
            ));
        }
        let (index, generation, n, crc) = (
            get_u64(&prefix, 8),
            get_u64(&prefix, 16),
            get_u64(&prefix, 24),
            get_u32(&prefix, 32),
        );
        if generation != expect.generation {
            return Err(ImageError::Damaged(
                "chunk",
                format!("chunk {index} of generation {generation}"),
            ));
        }
        if index >= total_chunks || loaded.last().is_some_and(|l| *l >= index) {
            return Err(ImageError::Damaged(
                "chunk",
                format!("chunk {index} out of order or repeated"),
            ));
        }
        if n != chunk_len(expect.size, index) {
            return Err(ImageError::Damaged(
                "chunk",
                format!("chunk {index} has the wrong length"),
            ));
        }
        // Copied as it streams in; a chunk that then fails its checksum
        // fails the whole restore, and the caller zeroes the memory again.
        let mut sum = chunk_seed(index, generation);
        let mut to = index * CHUNK_SIZE;
        s.read(n as usize, "in chunk data", |piece| {
            sum = crc32c::crc32c_append(sum, piece);
            if let Some(store) = store {
                store
                    .write(to, piece)
                    .map_err(|e| ImageError::Io(std::io::Error::other(e)))?;
            }
            to += piece.len() as u64;
            Ok(())
        })?;
        if sum != crc {
            return Err(ImageError::Damaged(
                "chunk",
                format!("chunk {index}: checksum mismatch"),
            ));
        }
        chain = crc32c::crc32c_append(chain, &crc.to_le_bytes());
        loaded.push(index);
    }
    let commit = s.read_block("before the commit record")?;
    if &commit[..8] != COMMIT_MAGIC || !sealed(&commit) {
        return Err(ImageError::Damaged(
            "commit record",
            "missing or corrupt".into(),
        ));
    }
    if get_u64(&commit, 8) != expect.generation
        || get_u64(&commit, 16) != h.chunk_count
        || get_u32(&commit, 24) != chain
    {
        return Err(ImageError::Damaged(
            "commit record",
            "does not match the chunks".into(),
        ));
    }
    let offset = s.offset;
    if file_len != offset || s.fill()? {
        return Err(ImageError::Damaged(
            "file",
            format!("{file_len} bytes where the records end at {offset}"),
        ));
    }
    Ok((loaded, offset, h.taken_unix))
}

fn describe_mismatch(found: &ImageIdentity, expect: &ImageIdentity) -> String {
    let mut d = Vec::new();
    if found.target != expect.target || found.lun != expect.lun {
        d.push(format!("it is {} LUN {}", found.target, found.lun));
    }
    if found.identity != expect.identity {
        d.push(format!(
            "its identity is naa.{}",
            naa_hex(&found.identity.naa)
        ));
    }
    if found.size != expect.size || found.block_size != expect.block_size {
        d.push(format!(
            "it is {} bytes of {}-byte blocks, this volume {} of {}",
            found.size, found.block_size, expect.size, expect.block_size
        ));
    }
    if found.generation != expect.generation {
        d.push(format!(
            "it is generation {}, the state's is {}",
            found.generation, expect.generation
        ));
    }
    d.join("; ")
}
