//! Reading an image back: every block checked before the LUN counts as restored.

use super::*;

/// What a restore loaded.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    pub path: PathBuf,
    pub chunks: Vec<u64>,
    pub bytes: u64,
    pub seconds: f64,
    pub taken_unix: u64,
    /// The persistent reservations the image carried (APTPL), if any.
    pub reservations: Option<KeptReservations>,
}

fn open_for_read(path: &Path) -> std::io::Result<File> {
    match open_regular(path, libc::O_DIRECT) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open_regular(path, 0),
        r => r,
    }
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
    let loaded = result?;
    Ok(RestoreReport {
        path: path.into(),
        chunks: loaded.chunks,
        bytes: loaded.bytes,
        seconds: started.elapsed().as_secs_f64(),
        taken_unix: loaded.taken_unix,
        reservations: loaded.reservations,
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

/// What [`load`] found.
struct Loaded {
    chunks: Vec<u64>,
    bytes: u64,
    taken_unix: u64,
    reservations: Option<KeptReservations>,
}

/// Verify the image and, with `store`, copy each chunk into it as it
/// streams in.
fn load(
    path: &Path,
    expect: &ImageIdentity,
    store: Option<&Store>,
    cancelled: &dyn Fn() -> bool,
) -> Result<Loaded, ImageError> {
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
    let reservations = match h.reservations {
        (0, _) => None,
        (len, crc) => {
            let mut bytes = Vec::with_capacity(reservation_blocks(len) * BLOCK);
            for _ in 0..reservation_blocks(len) {
                bytes.extend_from_slice(&s.read_block("in the reservations")?);
            }
            let damaged = |what: String| ImageError::Damaged("reservations", what);
            if bytes[len..].iter().any(|&b| b != 0) || crc32c::crc32c(&bytes[..len]) != crc {
                return Err(damaged("checksum mismatch".into()));
            }
            let parsed: KeptReservations = serde_json::from_slice(&bytes[..len])
                .map_err(|e| damaged(format!("unreadable: {e}")))?;
            Some(parsed)
        }
    };
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
    Ok(Loaded {
        chunks: loaded,
        bytes: offset,
        taken_unix: h.taken_unix,
        reservations,
    })
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
