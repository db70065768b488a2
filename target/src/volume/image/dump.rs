//! Writing an image: chunks streamed with O_DIRECT, sealed, committed last.

use super::*;

/// Bytes every dump of this process has written: progress that the service
/// manager's stop timeout is extended for.
static BYTES_DUMPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn bytes_dumped() -> u64 {
    BYTES_DUMPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How the image file is written: O_DIRECT where the filesystem takes it.
struct Output {
    file: File,
    direct: bool,
    offset: u64,
}

impl Output {
    fn create(path: &Path) -> std::io::Result<Output> {
        let open = |direct: bool| create_private(path, if direct { libc::O_DIRECT } else { 0 });
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
        BYTES_DUMPED.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Records straight from the LUN memory (see `Store::write_parts_to`).
    fn write_store(&mut self, store: &Store, parts: &[(&[u8], u64, usize)]) -> std::io::Result<()> {
        let written = store.write_parts_to(&self.file, self.offset, parts)? as u64;
        self.offset += written;
        BYTES_DUMPED.fetch_add(written, std::sync::atomic::Ordering::Relaxed);
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

/// Bytes of an image holding `chunks` (by index) of a volume of `size`
/// bytes, and `reservation_bytes` of persistent reservations.
pub fn image_len(size: u64, chunks: impl Iterator<Item = u64>, reservation_bytes: usize) -> u64 {
    let data: u64 = chunks.map(|c| BLOCK as u64 + chunk_len(size, c)).sum();
    (2 + reservation_blocks(reservation_bytes)) as u64 * BLOCK as u64 + data
}

/// Write the image of `id` holding the chunks `written` says were written,
/// and `reservations` (those to persist through power loss): to a
/// temporary file, fsync, rename, directory fsync. On error the temporary
/// file is removed and no image of this generation exists.
pub fn dump(
    dir: &Path,
    id: &ImageIdentity,
    store: &Store,
    written: &crate::volume::WrittenChunks,
    reservations: Option<&KeptReservations>,
) -> Result<DumpReport, ImageError> {
    let started = Instant::now();
    let chunks: Vec<u64> = (0..written.chunks())
        .filter(|c| written.is_marked(*c))
        .collect();
    let reservations = match reservations {
        Some(r) => serde_json::to_vec(r).map_err(|e| {
            ImageError::Mismatch(format!("persistent reservations not encodable: {e}"))
        })?,
        None => Vec::new(),
    };
    let len = image_len(id.size, chunks.iter().copied(), reservations.len());
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
    let result = write_image(&tmp, id, store, &chunks, &reservations);
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
    reservations: &[u8],
) -> Result<bool, ImageError> {
    // Checked before anything is written: its error is the dump's error.
    let header = encode_header(
        id,
        chunks.len() as u64,
        crate::volume::now_unix(),
        reservations,
    )
    .map_err(ImageError::Mismatch)?;
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
            for piece in reservations.chunks(BLOCK) {
                let mut padded = [0u8; BLOCK];
                padded[..piece.len()].copy_from_slice(piece);
                tx.send(block(&padded)?).map_err(|_| ())?;
            }
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
