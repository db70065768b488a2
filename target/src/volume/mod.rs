//! A volume: one unit of served memory (a SCSI LU today, an NVMe namespace
//! next), its identity, its readiness, the shutdown fence and its
//! persistence across restarts. It names nothing of the front ends on top
//! of it: a refused write is a [`VolumeError`], which each front end says in
//! its own protocol.
//!
//! Persistence in one paragraph (docs/persistence.md has the whole story):
//! the state directory keeps a generation per volume. The first command of a
//! run that changes the medium bumps it (durably) before it is acknowledged,
//! and every write marks its chunks as written before its status goes out.
//! At a clean stop the volume is fenced and its written chunks are dumped to
//! an image of that generation, which the state then marks clean. At start an
//! image is loaded only if it is the current, clean generation of this very
//! identity and every byte of it verifies.

mod facts;
mod fd_store;
mod identity;
pub mod image;
pub mod kept;
pub mod pages;
mod placing;
pub mod state;

use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use crate::notify;
use crate::store::Store;
use kept::{KeptRecord, KeptReservations, KeptState, RecordArea, Written};
use state::StateDir;

pub use facts::{next_start, VolumeFacts, KEPT_MEMORY};
pub use identity::{naa_hex, Identity};
pub use placing::PlacingWrite;

/// Why a volume refused a write. Each front end says it in its own protocol
/// (SCSI sense, an NVMe status) or, for [`VolumeError::Fenced`], not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    /// Shutdown fenced the volume after the write's bytes landed. The write
    /// must get no status at all: the front end ends the connection, so the
    /// host retries it against the next run (see [`Volume::fence`]).
    #[error("the volume is fenced for shutdown")]
    Fenced,
    /// The content is not trusted (lost at start, or this run's generation
    /// could not be made durable) until the admin accepts the empty volume.
    #[error("the volume is not ready: manual intervention required")]
    NotReady,
}

/// Why a READY volume's memory cannot be handed over in a planned restart.
#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    #[error("it has no kept-memory record")]
    NoRecord,
    #[error("its kept-memory record was not written: {0}")]
    Record(#[from] kept::KeptError),
}

/// A volume's place in the daemon's [`Volumes`]: what the I/O path names
/// memory by (with an offset and a length the front end already checked),
/// and what drivers index their per-volume resources (RDMA registrations)
/// with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VolumeId(u32);

impl VolumeId {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Every volume of the daemon, indexed by [`VolumeId`]. Built once at start;
/// front ends (SCSI LUs today) hold the same `Arc<Volume>`s.
#[derive(Debug, Default)]
pub struct Volumes {
    list: Vec<Arc<Volume>>,
}

impl Volumes {
    /// Number the volumes in order: the `i`th gets `VolumeId(i)`.
    pub fn new(volumes: Vec<Volume>) -> Volumes {
        let list = volumes
            .into_iter()
            .enumerate()
            .map(|(i, mut v)| {
                v.id = VolumeId(u32::try_from(i).expect("fewer than 2^32 volumes"));
                Arc::new(v)
            })
            .collect();
        Volumes { list }
    }

    #[inline]
    pub fn get(&self, id: VolumeId) -> Option<&Arc<Volume>> {
        self.list.get(id.index())
    }

    /// In [`VolumeId`] order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Volume>> {
        self.list.iter()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Copy `out.len()` bytes of volume `id` from `offset`; false when the
    /// range is not there (nothing must then be sent in its place).
    #[inline]
    pub fn read(&self, id: VolumeId, offset: u64, out: &mut [u8]) -> bool {
        self.get(id)
            .is_some_and(|v| v.store().read(offset, out).is_ok())
    }
}

/// Granularity of written-chunk tracking and of the image.
pub const CHUNK_SIZE: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// Content lost (or not trusted): every medium access fails with NOT
    /// READY, MANUAL INTERVENTION REQUIRED until `accept_empty`.
    NeedsAcceptance,
}

/// Where a volume's content came from at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The image of `generation` (for kept memory: the one written before
    /// the handover, if it was).
    pub image: PathBuf,
    /// The content is memory an earlier run kept (a planned restart handed
    /// it over, or systemd's fd store held it across a crash), not a copy
    /// read from the image: who wrote it last, and how that run ended.
    pub kept_from: Option<KeptFrom>,
    /// When the image was written (seconds since the epoch).
    pub taken_unix: u64,
    pub generation: u64,
}

/// The run whose memory a volume took over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptFrom {
    /// The process that wrote the memory last.
    pub writer_pid: u32,
    /// How it ended, as far as its record tells.
    pub ended: &'static str,
}

/// What a volume's owner sets up at start.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    pub target: String,
    pub lun: u64,
    /// 512 or 4096.
    pub block_size: u32,
    pub identity: Identity,
    pub readiness: Readiness,
    /// Keep a checksum of every 4 KiB page beside the memory
    /// (`--verify-kept-memory`; see [`pages`]).
    pub page_crcs: bool,
}

/// The state directory and image directory a daemon's volumes share.
pub struct Persistence {
    state: Mutex<StateDir>,
    pub image_dir: PathBuf,
}

impl Persistence {
    pub fn new(state: StateDir, image_dir: PathBuf) -> Persistence {
        Persistence {
            state: Mutex::new(state),
            image_dir,
        }
    }

    pub fn state(&self) -> MutexGuard<'_, StateDir> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One bit per chunk, set on the write path without allocating or locking.
pub struct WrittenChunks {
    words: Box<[AtomicU64]>,
    chunks: u64,
}

impl WrittenChunks {
    fn new(size: u64) -> WrittenChunks {
        let chunks = size.div_ceil(CHUNK_SIZE);
        WrittenChunks {
            words: (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            chunks,
        }
    }

    /// Mark every chunk `len` bytes at `offset` touch.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / CHUNK_SIZE;
        let last = (offset.saturating_add(len) - 1) / CHUNK_SIZE;
        for c in first..=last.min(self.chunks.saturating_sub(1)) {
            let (w, bit) = ((c / 64) as usize, 1u64 << (c % 64));
            // Always the read-modify-write, also when the bit is set: it
            // publishes this writer's bytes before it reads the fence (see
            // `Volume::commit_write`).
            self.words[w].fetch_or(bit, Ordering::SeqCst);
        }
    }

    pub fn is_marked(&self, chunk: u64) -> bool {
        chunk < self.chunks
            && self.words[(chunk / 64) as usize].load(Ordering::SeqCst) & (1 << (chunk % 64)) != 0
    }

    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::SeqCst).count_ones()))
            .sum()
    }

    fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::SeqCst);
        }
    }

    pub fn chunks(&self) -> u64 {
        self.chunks
    }
}

/// What the admin does about a NOT READY volume, as `status` advises it:
/// never advice that throws away content that may still be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remedy {
    /// The content is gone for good (no clean image after a crash, a
    /// failed dump, a damaged image, memory discarded or written by a
    /// faulted process): accept the empty device, then replace the log half.
    AcceptEmpty,
    /// Kept memory is held back for a doubt the reason names, and stays in
    /// systemd's fd store: put that right and restart.
    KeptMemoryHeld,
    /// The image is missing or cannot be read: put it back and restart.
    ImageBack,
    /// A stop came during the restore: the image is intact.
    StartAgain,
    /// The LUN could not get its memory (RAM, the memory lock limit, huge
    /// pages): its image or kept memory is untouched and decides again at
    /// the next start that has the memory.
    FreeMemory,
    /// Kept memory is held back because its writer (or another process in
    /// the unit's cgroup) still runs: once it ends, `take-over`.
    WriterToEnd,
    /// Kept memory was held back because its writer still ran at start,
    /// and that writer has ended since: `take-over`.
    TakeOver,
}

impl Remedy {
    /// The advice `status` prints after the reason.
    pub fn advice(self) -> &'static str {
        match self {
            Remedy::AcceptEmpty => {
                "its content is lost: once ZFS no longer uses this half, run accept-empty, then \
                 zpool replace"
            }
            Remedy::KeptMemoryHeld => {
                "its memory is kept in systemd's fd store: put right what the reason names and \
                 restart the daemon (accept-empty would discard that memory)"
            }
            Remedy::ImageBack => {
                "put the image back (or make it readable) and restart the daemon (accept-empty \
                 would make this a new, empty device)"
            }
            Remedy::StartAgain => "start the daemon again: its image is intact",
            Remedy::WriterToEnd => {
                "the process the reason names may still write this memory: let it end or kill it \
                 (`systemctl status ramslog-target` lists the unit's processes); `status` then \
                 offers take-over, which serves the memory (accept-empty would discard that memory)"
            }
            Remedy::TakeOver => {
                "run `ramslog-target take-over`: the daemon ends as after a crash, and systemd \
                 starts it again with its fd store, which holds every LUN's memory; that start \
                 takes this memory over (accept-empty would discard it)"
            }
            Remedy::FreeMemory => {
                "free memory (or reserve the huge pages, or raise the limit, the reason names) and \
                 restart the daemon: its content is intact in its image or kept memory, which \
                 decides again at that start (accept-empty would throw it away)"
            }
        }
    }
}

struct Meta {
    identity: Identity,
    readiness: Readiness,
    /// Why the volume is NOT READY, for `status` and the log, and what to
    /// do about it.
    not_ready_reason: Option<String>,
    remedy: Option<Remedy>,
    restored: Option<Restored>,
    /// This run's generation, once bumped (or the restored one until then).
    generation: u64,
    /// The generation a bump under way makes durable.
    pending_generation: Option<u64>,
    /// What the memory is, as its kept-memory record says.
    kept: KeptState,
    /// The LU's persistent reservations, recorded beside the memory.
    reservations: KeptReservations,
    /// The checksum of the INQUIRY and VPD data served (until the LU is
    /// built: the previous run's, if its memory was taken over).
    inquiry: Option<u32>,
}

/// A volume's state as `status` shows it.
#[derive(Debug, Clone)]
pub struct VolumeStatus {
    pub identity: Identity,
    pub readiness: Readiness,
    pub not_ready_reason: Option<String>,
    pub remedy: Option<Remedy>,
    pub restored: Option<Restored>,
    pub generation: u64,
    /// Bytes the next dump writes: the written chunks × chunk size once
    /// anything changed since the last clean image (restored chunks count
    /// as written: a dump after a change carries them again), else none.
    pub written_bytes: u64,
    pub fenced: bool,
}

pub struct Volume {
    /// Its index in the daemon's [`Volumes`].
    id: VolumeId,
    target: String,
    lun: u64,
    block_size: u32,
    store: Arc<Store>,
    written: WrittenChunks,
    /// Set when the medium changed since the last clean image (or since
    /// start for a volume never imaged).
    dirty: AtomicBool,
    /// The generation of this run was bumped and made durable.
    generation_open: AtomicBool,
    /// Shutdown began: nothing more is acknowledged.
    fenced: AtomicBool,
    /// Mirrors `Meta::readiness` for the I/O path.
    ready: AtomicBool,
    meta: Mutex<Meta>,
    persistence: Option<Arc<Persistence>>,
    /// One image write of this volume at a time (a dump, accept-empty's
    /// empty image): two would share one temporary file.
    imaging: Mutex<()>,
    /// The kept-memory record (`kept`), rewritten whenever what the memory
    /// is changes, always under the `meta` lock; `None` if its memory could
    /// not be had (logged), which a successor reads as "not servable".
    record: Option<RecordArea>,
    /// The record area's page checksums are kept current.
    page_crcs: bool,
    /// Its memory and record are in systemd's fd store: confirmed by a
    /// barrier after this run pushed them, or passed back by the store at
    /// this start (`fd_store`).
    in_fd_store: AtomicBool,
    /// Pidfds of the writers found still running at start, for which this
    /// NOT READY volume's kept memory is held back (empty otherwise).
    held_for: Mutex<Vec<std::os::fd::OwnedFd>>,
    /// Commands, bytes, service times and errors, whichever front end
    /// served them.
    metrics: Arc<crate::metrics::LunMetrics>,
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume")
            .field("target", &self.target)
            .field("lun", &self.lun)
            .field("size", &self.store.len())
            .finish()
    }
}

impl Volume {
    /// A volume over `store`. With `persistence`, its generation lives in the
    /// state directory; `generation` is the state's current one.
    pub fn new(
        cfg: VolumeConfig,
        store: Arc<Store>,
        persistence: Option<Arc<Persistence>>,
        generation: u64,
    ) -> Volume {
        let record_name = format!("ramslog {} LUN {} record", cfg.target, cfg.lun);
        let table = if cfg.page_crcs {
            pages::table_words(store.len())
        } else {
            0
        };
        let record = RecordArea::new(&record_name, table)
            .inspect_err(|e| {
                tracing::error!(target = %cfg.target, lun = cfg.lun, "no kept-memory record ({e}): this memory can never be handed on")
            })
            .ok();
        let volume = Volume::with_record(
            cfg,
            store,
            persistence,
            generation,
            (record, KeptReservations::default(), None),
        );
        // New memory is zero.
        if let Some(p) = volume.pages() {
            p.zeroed();
        }
        volume
    }

    /// A volume over kept memory, writing its records on in the area its
    /// predecessor wrote (the one a holder such as systemd's fd store has),
    /// with the persistent reservations that record carried and the
    /// checksum of the INQUIRY data its writer served.
    pub fn with_record(
        cfg: VolumeConfig,
        store: Arc<Store>,
        persistence: Option<Arc<Persistence>>,
        generation: u64,
        (record, reservations, inquiry): (Option<RecordArea>, KeptReservations, Option<u32>),
    ) -> Volume {
        let ready = cfg.readiness == Readiness::Ready;
        let page_crcs = cfg.page_crcs
            && record
                .as_ref()
                .is_some_and(|r| r.page_crcs(&store).is_some());
        let volume = Volume {
            id: VolumeId(0),
            target: cfg.target,
            lun: cfg.lun,
            block_size: cfg.block_size,
            written: WrittenChunks::new(store.len()),
            store,
            dirty: AtomicBool::new(false),
            generation_open: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            in_fd_store: AtomicBool::new(false),
            held_for: Mutex::new(Vec::new()),
            ready: AtomicBool::new(ready),
            meta: Mutex::new(Meta {
                identity: cfg.identity,
                readiness: cfg.readiness,
                not_ready_reason: None,
                remedy: None,
                restored: None,
                generation,
                pending_generation: None,
                // Being filled until a restore says otherwise.
                kept: if ready {
                    KeptState::Valid
                } else {
                    KeptState::Restoring
                },
                reservations,
                inquiry,
            }),
            persistence,
            imaging: Mutex::new(()),
            record,
            page_crcs,
            metrics: Arc::default(),
        };
        volume.write_record(&volume.meta());
        volume
    }

    /// Write the kept-memory record from `m` (its lock held, so records are
    /// written in the order of the changes they describe).
    fn write_record(&self, m: &Meta) {
        // A failure is logged: the area then holds no record in force,
        // which no successor serves.
        let _ = self.write_record_with(m, Written::All);
    }

    fn write_record_with(&self, m: &Meta, written: Written) -> Result<(), HandOverError> {
        let Some(area) = &self.record else {
            return Err(HandOverError::NoRecord);
        };
        let record = KeptRecord {
            format: kept::FORMAT,
            naa: naa_hex(&m.identity.naa),
            serial: m.identity.serial.clone(),
            target: self.target.clone(),
            lun: self.lun,
            lun_bytes: self.store.len(),
            memfd_bytes: self.store.mapped_len(),
            memfd_inode: self.store.inode(),
            block_size: self.block_size,
            generation: m.generation,
            pending_generation: m.pending_generation,
            state: m.kept.clone(),
            boot_id: kept::boot_id().into(),
            owner: kept::this_process(),
            written,
            reservations: m.reservations.clone(),
            inquiry: m.inquiry,
            page_crcs: self.page_crcs,
        };
        area.write(&record).map_err(|e| {
            tracing::error!(target = %self.target, lun = self.lun, "kept-memory record not written ({e}): no successor will serve this memory");
            HandOverError::Record(e)
        })
    }

    /// Record what the memory is now.
    fn set_kept(&self, m: &mut Meta, state: KeptState) {
        m.kept = state;
        self.write_record(m);
    }

    /// A planned restart: record this fenced, READY volume's memory as
    /// handed over under `token`, with the chunks the next dump must carry,
    /// and return its memfd and its record's, for the successor. `None`
    /// (and nothing recorded) for a volume that is not fenced, not READY or
    /// has no record: the successor takes those from their images, as a
    /// start after a stop does. An error for a READY volume whose memory
    /// cannot go on (no record area, or its record not written): the caller
    /// must make its image current or give the restart up; [`Self::take_back`]
    /// writes the record again.
    pub fn hand_over(
        &self,
        token: u64,
    ) -> Result<Option<(BorrowedFd<'_>, BorrowedFd<'_>)>, HandOverError> {
        let mut m = self.meta();
        if !self.fenced.load(Ordering::SeqCst) || m.readiness != Readiness::Ready {
            return Ok(None);
        }
        let area = self.record.as_ref().ok_or(HandOverError::NoRecord)?;
        m.kept = KeptState::HandedOver { token, ready: true };
        let written = Written::from_chunks(CHUNK_SIZE, self.written.chunks(), |c| {
            self.written.is_marked(c)
        });
        self.write_record_with(&m, written)?;
        // This living process hands the memory on: whatever panic it
        // survived before, it vouches for the content, as a dump would.
        area.clear_fault_mark();
        Ok(Some((self.store.memory(), area.memory())))
    }

    /// The persistent reservations the record carries (those a predecessor
    /// left, until the LU's first change).
    pub fn kept_reservations(&self) -> KeptReservations {
        self.meta().reservations.clone()
    }

    /// Record the LU's persistent reservations as they are to be: called
    /// under the LU's lock for each change, before the LU takes it and
    /// before its GOOD, so a successor serving this memory has them too.
    /// A change the image carries (APTPL set before or after it) is a
    /// change of the medium's content: like a write, it makes the last
    /// image stale (the generation bump) before it is acknowledged, so a
    /// crash cannot bring the old reservations back, and the next dump
    /// writes the new ones. An error: the change must not be taken. While
    /// accept-empty makes the memory a new, empty device (the record says
    /// initialising, until the LU has cleared its own reservations) every
    /// change is refused: it would be the old device's state.
    pub fn keep_reservations(&self, reservations: KeptReservations) -> Result<(), VolumeError> {
        let imaged = {
            let m = self.meta();
            if m.kept == KeptState::Initialising {
                return Err(VolumeError::NotReady);
            }
            if m.reservations == reservations {
                return Ok(());
            }
            m.reservations.aptpl || reservations.aptpl
        };
        if imaged {
            if self.fenced.load(Ordering::SeqCst) {
                return Err(VolumeError::Fenced);
            }
            self.dirty.store(true, Ordering::SeqCst);
            if !self.generation_open.load(Ordering::Acquire) {
                self.open_generation()?;
            }
        }
        let mut m = self.meta();
        // Checked under the lock the dump takes its snapshot with: either
        // the dump sees this change, or the change is refused.
        if imaged && self.fenced.load(Ordering::SeqCst) {
            return Err(VolumeError::Fenced);
        }
        if m.kept == KeptState::Initialising {
            return Err(VolumeError::NotReady);
        }
        m.reservations = reservations;
        self.write_record(&m);
        Ok(())
    }

    /// Record the checksum of the INQUIRY and VPD data this run's LU
    /// serves; returns the one recorded before (the previous run's, for
    /// memory taken over), so the LU can tell hosts when it changed.
    pub fn keep_inquiry(&self, digest: u32) -> Option<u32> {
        let mut m = self.meta();
        let before = m.inquiry.replace(digest);
        if before != Some(digest) {
            self.write_record(&m);
        }
        before
    }

    /// A planned restart that did not happen (the new program could not be
    /// executed): serve this volume again. Its record says valid once more
    /// and the fence is lifted; a dump the restart made marked this
    /// generation clean and reset the bump, so the next write makes that
    /// image stale before it is acknowledged, as after any dump.
    pub fn take_back(&self) {
        let mut m = self.meta();
        if matches!(m.kept, KeptState::HandedOver { .. }) {
            self.set_kept(&mut m, KeptState::Valid);
        }
        self.fenced.store(false, Ordering::SeqCst);
    }

    /// The page checksums, when this run keeps them.
    fn pages(&self) -> Option<pages::PageCrcs<'_>> {
        if !self.page_crcs {
            return None;
        }
        self.record.as_ref()?.page_crcs(&self.store)
    }

    /// Whether this run keeps page checksums (`--verify-kept-memory`).
    pub fn keeps_page_crcs(&self) -> bool {
        self.page_crcs
    }

    /// Record the checksum of every page as the memory is now (after a
    /// restore filled it); how long it took, if this run keeps them.
    pub fn rebuild_page_crcs(&self) -> Option<std::time::Duration> {
        self.pages().map(|p| p.rebuild())
    }

    /// The kept-memory record in force, read back from its memory.
    pub fn kept_record(&self) -> Option<Result<kept::Current, kept::KeptError>> {
        self.record.as_ref().map(RecordArea::read)
    }

    /// A volume with no state directory (tests, `--ephemeral`).
    pub fn in_memory(cfg: VolumeConfig, store: Arc<Store>) -> Volume {
        Volume::new(cfg, store, None, 0)
    }

    fn meta(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the daemon's [`Volumes`] keep it (0 for a volume outside one).
    #[inline]
    pub fn id(&self) -> VolumeId {
        self.id
    }
    pub fn target(&self) -> &str {
        &self.target
    }
    pub fn lun(&self) -> u64 {
        self.lun
    }
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn size(&self) -> u64 {
        self.store.len()
    }
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
    /// Its counters: every front end's commands on it.
    pub fn metrics(&self) -> &Arc<crate::metrics::LunMetrics> {
        &self.metrics
    }

    pub fn written(&self) -> &WrittenChunks {
        &self.written
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn identity(&self) -> (Identity, Readiness) {
        let m = self.meta();
        (m.identity.clone(), m.readiness)
    }

    pub fn status(&self) -> VolumeStatus {
        let m = self.meta();
        // Said as it is now: a writer that held the kept memory back at
        // start may have ended since.
        let (not_ready_reason, remedy) = if self.held_writers_ended() {
            (
                m.not_ready_reason
                    .as_ref()
                    .map(|r| format!("{r}; that writer has since ended")),
                Some(Remedy::TakeOver),
            )
        } else {
            (m.not_ready_reason.clone(), m.remedy)
        };
        VolumeStatus {
            identity: m.identity.clone(),
            readiness: m.readiness,
            not_ready_reason,
            remedy,
            restored: m.restored.clone(),
            generation: m.generation,
            written_bytes: if self.changed() {
                (self.written.count() * CHUNK_SIZE).min(self.size())
            } else {
                0
            },
            fenced: self.fenced.load(Ordering::SeqCst),
        }
    }

    /// This NOT READY volume's kept memory is held back for the writers
    /// `pidfds` found still running at start.
    pub fn hold_for_writers(&self, pidfds: Vec<std::os::fd::OwnedFd>) {
        *self.held_for.lock().unwrap_or_else(|e| e.into_inner()) = pidfds;
    }

    /// Every writer its kept memory was held back for has ended since (and
    /// there was one): a start now would take the memory over.
    pub fn held_writers_ended(&self) -> bool {
        let held = self.held_for.lock().unwrap_or_else(|e| e.into_inner());
        !held.is_empty() && !self.is_ready() && held.iter().all(kept::pidfd_ended)
    }

    /// Anything changed since the last clean image (or since start, for a
    /// volume never imaged).
    fn changed(&self) -> bool {
        self.dirty.load(Ordering::SeqCst) || self.generation_open.load(Ordering::SeqCst)
    }

    /// NOT READY from now on, with the reason and the remedy kept for
    /// `status`.
    pub fn set_not_ready(&self, reason: String, remedy: Remedy) {
        self.not_ready(&mut self.meta(), reason, remedy);
    }

    /// [`Self::set_not_ready`], the meta lock held.
    fn not_ready(&self, m: &mut Meta, reason: String, remedy: Remedy) {
        // Lowered before anything else: the memory is not to be served.
        self.set_kept(
            m,
            KeptState::Discarded {
                reason: reason.clone(),
            },
        );
        m.readiness = Readiness::NeedsAcceptance;
        m.not_ready_reason = Some(reason);
        m.remedy = Some(remedy);
        self.ready.store(false, Ordering::Release);
    }

    /// The content was loaded from `from`: the chunks it held count as
    /// written (the next dump must carry them again). `reservations`: the
    /// persistent reservations the image carried (APTPL), if any.
    pub fn set_restored(
        &self,
        from: Restored,
        chunks: impl IntoIterator<Item = u64>,
        reservations: Option<KeptReservations>,
    ) {
        for c in chunks {
            self.written.mark(c * CHUNK_SIZE, 1);
        }
        let mut m = self.meta();
        if let Some(r) = reservations {
            m.reservations = r;
        }
        m.generation = from.generation;
        m.restored = Some(from);
        self.set_kept(&mut m, KeptState::Valid);
        m.readiness = Readiness::Ready;
        m.not_ready_reason = None;
        m.remedy = None;
        self.ready.store(true, Ordering::Release);
    }

    /// Called for every medium-changing command after its bytes are in
    /// place and before its status is sent: marks the chunks, and the first
    /// time in a run, makes the new generation durable. An error means the
    /// command must not be acknowledged. The page checksums are not this
    /// call's: the command's [`PlacingWrite`] settles them when dropped.
    ///
    /// Ordering with [`Self::fence`]: the chunk bits are set (SeqCst) before
    /// `fenced` is read (SeqCst), and the fence sets `fenced` before the dump
    /// reads the bits. So either this write is refused, or the dump sees its
    /// chunk and the bytes that were stored before it.
    pub fn commit_write(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        if len == 0 {
            return Ok(());
        }
        // Fenced: no status, and above all no generation bump, which would
        // make the image the dump is writing (or has written) stale.
        if self.fenced.load(Ordering::SeqCst) {
            return Err(VolumeError::Fenced);
        }
        self.written.mark(offset, len);
        if !self.dirty.load(Ordering::Relaxed) {
            self.dirty.store(true, Ordering::SeqCst);
        }
        if !self.generation_open.load(Ordering::Acquire) {
            self.open_generation()?;
        }
        if self.fenced.load(Ordering::SeqCst) {
            return Err(VolumeError::Fenced);
        }
        Ok(())
    }

    /// Bump the generation, once per run, before the first write is
    /// acknowledged: from then on the previous image is no longer the
    /// current one, so a crash cannot bring it back. One fsync, once.
    fn open_generation(&self) -> Result<(), VolumeError> {
        let Some(p) = &self.persistence else {
            self.generation_open.store(true, Ordering::Release);
            return Ok(());
        };
        let mut m = self.meta();
        if self.generation_open.load(Ordering::Acquire) {
            return Ok(());
        }
        // Under the lock the dump takes its snapshot with: once fenced, the
        // generation stays what the dump saw.
        if self.fenced.load(Ordering::SeqCst) {
            return Err(VolumeError::Fenced);
        }
        if m.readiness != Readiness::Ready {
            return Err(VolumeError::NotReady);
        }
        // The record names the bump before the state makes it durable: a
        // successor finding the state one ahead of the memory's generation
        // knows why (and finishes the bump).
        m.pending_generation = m.generation.checked_add(1);
        self.write_record(&m);
        match p.state().bump_generation(&self.target, self.lun) {
            Ok(g) => {
                // Between the durable bump and the record saying it ended.
                crate::test_pause::here("bump");
                tracing::info!(target = %self.target, lun = self.lun, generation = g, "first write of this run: generation bumped");
                m.generation = g;
                m.pending_generation = None;
                self.write_record(&m);
                self.generation_open.store(true, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                let reason = format!(
                    "the new generation could not be made durable ({e}); nothing written since is acknowledged"
                );
                tracing::error!(target = %self.target, lun = self.lun, "{reason}");
                m.pending_generation = None;
                self.not_ready(&mut m, reason, Remedy::AcceptEmpty);
                Err(VolumeError::NotReady)
            }
        }
    }

    /// Shutdown: from now on no write is acknowledged.
    pub fn fence(&self) {
        self.fenced.store(true, Ordering::SeqCst);
    }

    fn imaging(&self) -> MutexGuard<'_, ()> {
        self.imaging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Shutdown: write this fenced volume's image of its current generation
    /// and mark it clean, unless nothing changed since a clean image that is
    /// still there. A NOT READY volume is never imaged, and neither is one
    /// that is not fenced: while it still acknowledges writes, one could
    /// land in a chunk the dump already passed, and a clean mark would then
    /// bring the image back without it. With `verify`, the image is read
    /// back and checked before it counts (used when connections outlived
    /// the shutdown drain and could still be placing data). Returns what it
    /// did, for the log and `ramslog-target stop`.
    pub fn dump(&self, verify: bool) -> Result<String, String> {
        let (target, lun) = (self.target.as_str(), self.lun);
        let Some(p) = &self.persistence else {
            return Ok(format!("{target} LUN {lun}: ephemeral, nothing kept"));
        };
        let _imaging = self.imaging();
        if !self.fenced.load(Ordering::SeqCst) {
            return Err(format!(
                "{target} LUN {lun}: not imaged: it still acknowledges writes (only a fenced volume is dumped)"
            ));
        }
        // One snapshot: after the fence neither generation nor identity
        // changes (open_generation and accept_empty check the fence under
        // this lock).
        let (identity, generation, ready, reservations) = {
            let m = self.meta();
            (
                m.identity.clone(),
                m.generation,
                m.readiness == Readiness::Ready,
                m.reservations.clone(),
            )
        };
        if !ready {
            let msg = format!("{target} LUN {lun}: NOT READY, not imaged");
            tracing::info!("{msg}");
            return Ok(msg);
        }
        let path = p
            .image_dir
            .join(image::image_name(&identity.naa, generation));
        if !self.changed() && p.state().is_clean(target, lun, generation) && path.is_file() {
            let msg = format!("{target} LUN {lun}: nothing written since its last clean image");
            tracing::info!("{msg}");
            return Ok(msg);
        }
        let reservations = reservations.aptpl.then_some(&reservations);
        let msg = self.write_image(p, identity, generation, reservations, verify)?;
        // The image is current and the volume fenced: the next run's first
        // write must start a new generation before it is acknowledged.
        self.dirty.store(false, Ordering::SeqCst);
        self.generation_open.store(false, Ordering::SeqCst);
        Ok(msg)
    }

    /// The image of a volume nothing was written to yet (a new LUN before it
    /// serves, accept-empty's empty device before it is READY): written and
    /// marked clean, so a start that ends before any write brings it back
    /// READY and empty, which it is.
    pub fn write_empty_image(&self) -> Result<String, String> {
        let (target, lun) = (self.target.as_str(), self.lun);
        let Some(p) = &self.persistence else {
            return Ok(format!("{target} LUN {lun}: ephemeral, nothing kept"));
        };
        let _imaging = self.imaging();
        self.empty_image(p)
    }

    fn empty_image(&self, p: &Persistence) -> Result<String, String> {
        let (target, lun) = (self.target.as_str(), self.lun);
        if self.written.count() > 0
            || self.dirty.load(Ordering::SeqCst)
            || self.generation_open.load(Ordering::SeqCst)
        {
            return Err(format!(
                "{target} LUN {lun}: not an empty image: the volume was written to"
            ));
        }
        let (identity, generation) = {
            let m = self.meta();
            (m.identity.clone(), m.generation)
        };
        self.write_image(p, identity, generation, None, false)
    }

    /// Write the image of `identity` at `generation`, with `reservations`
    /// to persist through power loss, and record it clean. The caller
    /// holds `imaging`.
    fn write_image(
        &self,
        p: &Persistence,
        identity: Identity,
        generation: u64,
        reservations: Option<&KeptReservations>,
        verify: bool,
    ) -> Result<String, String> {
        let (target, lun) = (self.target.as_str(), self.lun);
        image::remove_images(&p.image_dir, &identity.naa, None).map_err(|e| {
            format!("{target} LUN {lun}: dump failed: cannot remove stale images: {e}; generation {generation} stays unclean (the content is lost at exit)")
        })?;
        let id = image::ImageIdentity {
            target: target.into(),
            lun,
            identity,
            size: self.size(),
            block_size: self.block_size,
            generation,
        };
        tracing::info!(target, lun, generation, "dumping LUN content");
        let failed = |e: &dyn std::fmt::Display| {
            format!("{target} LUN {lun}: dump failed: {e}; generation {generation} stays unclean (the content is lost at exit)")
        };
        let mut attempt = 0;
        let r = loop {
            attempt += 1;
            let r = image::dump(&p.image_dir, &id, &self.store, &self.written, reservations)
                .map_err(|e| failed(&e))?;
            if !verify {
                break r;
            }
            match image::verify(&r.path, &id) {
                Ok(()) => break r,
                Err(e) if attempt < 3 => {
                    tracing::warn!(
                        target,
                        lun,
                        "the image does not verify ({e}): data was still arriving; dumping again"
                    );
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&r.path);
                    return Err(failed(&format!("the image does not verify: {e}")));
                }
            }
        };
        p.state().mark_clean(target, lun, generation).map_err(|e| {
            format!("{target} LUN {lun}: image written but the state could not record it: {e}")
        })?;
        let msg = format!(
            "{target} LUN {lun}: generation {generation} dumped to {}: {} chunks, {} bytes in {:.2} s ({:.0} MiB/s{})",
            r.path.display(),
            r.chunks,
            r.bytes,
            r.seconds,
            r.bytes as f64 / r.seconds.max(1e-9) / (1 << 20) as f64,
            if r.direct { ", O_DIRECT" } else { ", buffered" }
        );
        tracing::info!("{msg}");
        Ok(msg)
    }

    /// The admin accepted an empty device: a fresh identity and generation,
    /// zeroed memory, the old identity's images deleted. In this order: the
    /// new identity durable in the state directory, the memory zeroed,
    /// `announce` (the caller queues its unit attentions), the empty image
    /// durable, and only then READY. A LUN that is READY already (another
    /// accept-empty got there first) is refused under the same lock that
    /// serializes the two, and a failed image leaves it NOT READY, saying
    /// why. The caller has aborted the old identity's writes.
    pub fn accept_empty(&self, new: Identity, announce: impl FnOnce()) -> Result<(), String> {
        let _imaging = self.imaging();
        let (target, lun) = (self.target.as_str(), self.lun);
        {
            let m = self.meta();
            if m.remedy == Some(Remedy::FreeMemory) {
                return Err(format!(
                    "{target} LUN {lun} has no memory, but its content is intact ({}): {}; \
                     nothing changed",
                    m.not_ready_reason
                        .as_deref()
                        .unwrap_or("no reason recorded"),
                    Remedy::FreeMemory.advice()
                ));
            }
        }
        // A NOT READY LUN's memory is taken only now: if it cannot be had,
        // nothing has changed yet.
        let fresh = !self.store.is_resident();
        self.store.make_resident().map_err(|e| {
            format!(
                "{target} LUN {lun} cannot get its memory, nothing changed: {e}. Free memory and \
                 run accept-empty again"
            )
        })?;
        let old = {
            let mut m = self.meta();
            if self.fenced.load(Ordering::SeqCst) {
                return Err(
                    "the target is shutting down; accept-empty after it starts again".into(),
                );
            }
            if m.readiness == Readiness::Ready {
                return Err(format!(
                    "{target} LUN {lun} is READY (another accept-empty ran first, or its content is intact): nothing changed"
                ));
            }
            let old = m.identity.clone();
            // The memory is being made empty from here on: a successor that
            // finds this record finishes accept-empty, never serves the old
            // content. Nor the old identity's reservations: the empty
            // device has none (the caller clears the LU's).
            let before = std::mem::replace(&mut m.kept, KeptState::Initialising);
            let reservations_before = std::mem::take(&mut m.reservations);
            self.write_record(&m);
            if let Some(p) = &self.persistence {
                let g = match p.state().set(&self.target, self.lun, &new) {
                    Ok(g) => g,
                    Err(e) => {
                        // Still the old identity: its record goes back to
                        // what it was (never INITIALISING, which a successor
                        // would finish under the identity it names).
                        m.reservations = reservations_before;
                        self.set_kept(&mut m, before);
                        return Err(format!("identity not changed: {e}"));
                    }
                };
                m.generation = g;
                if let Err(e) = image::remove_images(&p.image_dir, &old.naa, None) {
                    tracing::warn!(target = %self.target, lun = self.lun, "cannot remove the old identity's images: {e}");
                }
            }
            m.identity = new;
            m.restored = None;
            m.not_ready_reason = Some("accept-empty is writing the empty image".into());
            self.write_record(&m);
            old
        };
        // The memory is the new identity's from here on, in the fd store too.
        if self.persistence.is_some() && self.hold_in_fd_store(Some(&naa_hex(&old.naa))) {
            match notify::barrier(notify::BARRIER_WAIT) {
                Ok(true) => self.confirm_in_fd_store(),
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    target,
                    lun,
                    "cannot confirm the fd store holds the new identity's memory: {e}"
                ),
            }
        }
        // The store holds this memory under the new identity, its record
        // INITIALISING; the old memory is gone from it.
        crate::test_pause::here("accept-empty");
        // Whatever a failed restore left behind goes (memory taken just now
        // is zero).
        if !fresh {
            let _ = self.store.zero(0, self.store.len() as usize);
        }
        if let Some(p) = self.pages() {
            p.zeroed();
        }
        self.written.clear();
        self.dirty.store(false, Ordering::SeqCst);
        self.generation_open.store(false, Ordering::SeqCst);
        // The LU forgets the old device (its reservations, while every
        // change to them is still refused), then the zeroed memory is the
        // new identity's (empty) content.
        announce();
        self.set_kept(&mut self.meta(), KeptState::Valid);
        if let Some(p) = &self.persistence {
            if let Err(e) = self.empty_image(p) {
                let reason = format!(
                    "accept-empty gave it a new identity but could not write its empty image ({e}); run accept-empty again"
                );
                tracing::error!(target, lun, "{reason}");
                let mut m = self.meta();
                m.not_ready_reason = Some(reason.clone());
                m.remedy = Some(Remedy::AcceptEmpty);
                return Err(reason);
            }
        }
        let mut m = self.meta();
        m.readiness = Readiness::Ready;
        m.not_ready_reason = None;
        m.remedy = None;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    pub fn persistence(&self) -> Option<&Arc<Persistence>> {
        self.persistence.as_ref()
    }

    pub fn generation(&self) -> u64 {
        self.meta().generation
    }
}

/// Seconds since the epoch, for image headers.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::state::Recall;
    use super::*;
    use crate::store::HugePages;

    fn persistent_volume(name: &str) -> (std::path::PathBuf, Volume) {
        let dir =
            std::env::temp_dir().join(format!("ramslog-volume-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut state = StateDir::open(&dir).expect("state dir");
        let Recall::New(identity) = state.recall("iqn.t", 0).expect("recall") else {
            panic!("a new LUN")
        };
        let generation = state.generation("iqn.t", 0).expect("generation");
        let images = dir.join("images");
        crate::private_dir::prepare(&images, "image directory").expect("image dir");
        let p = Arc::new(Persistence::new(state, images));
        let store = Arc::new(Store::new(3 << 20, HugePages::Off).expect("store"));
        let cfg = VolumeConfig {
            target: "iqn.t".into(),
            lun: 0,
            block_size: 512,
            identity,
            readiness: Readiness::Ready,
            page_crcs: false,
        };
        (dir, Volume::new(cfg, store, Some(p), generation))
    }

    fn state_generation(v: &Volume) -> u64 {
        v.persistence()
            .expect("persistent")
            .state()
            .generation("iqn.t", 0)
            .expect("record")
    }

    #[test]
    fn the_first_write_bumps_once_and_a_fenced_one_never() {
        let (dir, v) = persistent_volume("bump");
        assert_eq!(v.commit_write(0, 0), Ok(()), "nothing written: no bump");
        assert_eq!(state_generation(&v), 1);
        assert_eq!(v.commit_write(4096, 512), Ok(()));
        assert_eq!(state_generation(&v), 2);
        assert_eq!(v.commit_write(2 << 20, 512), Ok(()));
        assert_eq!(state_generation(&v), 2, "once per run");
        assert!(v.written().is_marked(0) && v.written().is_marked(2) && !v.written().is_marked(1));

        let (dir2, fenced) = persistent_volume("fenced");
        fenced.fence();
        assert_eq!(fenced.commit_write(0, 512), Err(VolumeError::Fenced));
        assert_eq!(state_generation(&fenced), 1, "a fenced write must not bump");
        assert!(
            fenced.accept_empty(Identity::generate(), || {}).is_err(),
            "no accept-empty once fenced"
        );
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_dir_all(dir2);
    }

    fn not_ready(v: &Volume) {
        v.set_not_ready("the test lost its content".into(), Remedy::AcceptEmpty);
    }

    /// The record in force, as a successor would read it from memory.
    fn kept(v: &Volume) -> KeptRecord {
        v.kept_record()
            .expect("a record area")
            .expect("a record in force")
            .record
    }

    /// VALID is positive: the record says VALID only while the memory is
    /// this identity's current content, names every generation the state
    /// makes durable, and is lowered before the memory stops being that.
    #[test]
    fn the_kept_record_follows_what_the_memory_is() {
        let (dir, v) = persistent_volume("kept");
        let (identity, _) = v.identity();
        let r = kept(&v);
        assert_eq!(r.state, KeptState::Valid, "a new identity's empty memory");
        assert_eq!(
            (r.naa, r.serial.as_str()),
            (naa_hex(&identity.naa), identity.serial.as_str())
        );
        assert_eq!((r.target.as_str(), r.lun, r.block_size), ("iqn.t", 0, 512));
        assert_eq!((r.lun_bytes, r.memfd_bytes), (3 << 20, 3 << 20));
        assert_eq!((r.generation, r.pending_generation), (1, None));
        assert_eq!(r.owner, kept::this_process());
        assert_eq!(r.boot_id, kept::boot_id());

        v.commit_write(0, 512).expect("first write");
        let r = kept(&v);
        assert_eq!((r.generation, r.pending_generation), (2, None));
        assert_eq!(r.generation, state_generation(&v), "the state's generation");

        not_ready(&v);
        assert_eq!(
            kept(&v).state,
            KeptState::Discarded {
                reason: "the test lost its content".into()
            }
        );

        let fresh = Identity::generate();
        let mut seen_while_announcing = None;
        v.accept_empty(fresh.clone(), || seen_while_announcing = Some(kept(&v)))
            .expect("accept-empty");
        let during = seen_while_announcing.expect("announced");
        // Still initialising while the LU forgets the old device (a crash
        // now: the successor finishes accept-empty), valid after it.
        assert_eq!(
            during.state,
            KeptState::Initialising,
            "initialising while announcing"
        );
        assert_eq!(during.naa, naa_hex(&fresh.naa), "under the new identity");
        let r = kept(&v);
        assert_eq!((r.state, r.naa), (KeptState::Valid, naa_hex(&fresh.naa)));
        assert_eq!(r.generation, state_generation(&v));

        // A restore: RESTORING from construction until it verified.
        let restoring = Volume::new(
            VolumeConfig {
                target: "iqn.t".into(),
                lun: 1,
                block_size: 4096,
                identity: Identity::generate(),
                readiness: Readiness::NeedsAcceptance,
                page_crcs: false,
            },
            Arc::new(Store::new(1 << 20, HugePages::Off).expect("store")),
            None,
            5,
        );
        assert_eq!(kept(&restoring).state, KeptState::Restoring);
        restoring.set_restored(
            Restored {
                image: "x".into(),
                kept_from: None,
                taken_unix: 0,
                generation: 5,
            },
            [0],
            None,
        );
        let r = kept(&restoring);
        assert_eq!((r.state, r.generation), (KeptState::Valid, 5));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Two accept-empty requests for one NOT READY LUN: the second, queued
    /// behind the first, finds the LUN READY and must not wipe what was
    /// written in between.
    #[test]
    fn a_second_accept_empty_finds_the_lun_ready_and_changes_nothing() {
        let (dir, v) = persistent_volume("accept-twice");
        not_ready(&v);
        v.accept_empty(Identity::generate(), || {})
            .expect("first accept-empty");
        v.store().write(0, &[0x5a; 4096]).expect("write");
        v.commit_write(0, 4096).expect("commit");
        let (identity, _) = v.identity();
        let second = v.accept_empty(Identity::generate(), || {});
        let mut b = [0u8; 4096];
        v.store().read(0, &mut b).expect("read");
        let _ = std::fs::remove_dir_all(dir);
        assert!(
            second.is_err() && b == [0x5a; 4096] && v.identity().0 == identity,
            "a second accept-empty wiped a READY LUN"
        );
    }

    /// A PERSISTENT RESERVE OUT of the old identity that lands while
    /// accept-empty runs, after the volume dropped the old reservations
    /// from its record and before the LU cleared its own (the caller's
    /// `announce`), is refused: taken, it would write the old device's
    /// registrations into the new identity's record, and a crash would
    /// serve them under the new identity.
    #[test]
    fn a_reservation_change_racing_accept_empty_is_refused() {
        let (dir, v) = persistent_volume("accept-pr-race");
        v.keep_reservations(reservations(false, 0xaa))
            .expect("a registration of the old device");
        not_ready(&v);
        let mut racing = None;
        let r = v.accept_empty(Identity::generate(), || {
            // The PR OUT: under the LU's lock, from the LU's old state.
            racing = Some(v.keep_reservations(reservations(false, 0xbb)));
        });
        let record = kept(&v);
        let _ = std::fs::remove_dir_all(dir);
        r.expect("accept-empty");
        assert!(
            record.reservations.registrations.is_empty(),
            "the new identity's record carries an old registration: {:?}",
            record.reservations
        );
        assert_eq!(
            racing,
            Some(Err(VolumeError::NotReady)),
            "the racing PR OUT"
        );
    }

    /// The empty device is READY only once its empty image is durable: if
    /// that image cannot be written, the LUN stays NOT READY and says why.
    #[test]
    fn accept_empty_is_ready_only_once_its_empty_image_is_durable() {
        let (dir, v) = persistent_volume("accept-no-image");
        not_ready(&v);
        let images = v.persistence().expect("p").image_dir.clone();
        std::fs::remove_dir_all(&images).expect("remove the image directory");
        std::fs::write(&images, b"not a directory").expect("block it");
        let r = v.accept_empty(Identity::generate(), || {});
        let ready = v.is_ready();
        let _ = std::fs::remove_dir_all(dir);
        assert!(r.is_err(), "the failed image is reported");
        assert!(!ready, "READY without a durable empty image");
    }

    /// A dump of a volume still serving writes cannot be the clean image:
    /// a write landing meanwhile in a chunk the dump already passed would
    /// be lost at the next start, under the same identity.
    /// What the image of `persistent_volume`'s volume must carry now.
    fn image_identity(v: &Volume) -> image::ImageIdentity {
        image::ImageIdentity {
            target: "iqn.t".into(),
            lun: 0,
            identity: v.identity().0,
            size: 3 << 20,
            block_size: 512,
            generation: v.generation(),
        }
    }

    fn reservations(aptpl: bool, key: u64) -> KeptReservations {
        KeptReservations {
            generation: 1,
            aptpl,
            registrations: vec![kept::KeptRegistration {
                port: "iqn.h,i,0x1".into(),
                key,
            }],
            reservation: Some(kept::KeptReservation {
                holder: "iqn.h,i,0x1".into(),
                kind: 1,
            }),
        }
    }

    /// Reservations without APTPL are only recorded beside the memory;
    /// with it they are content: the image goes stale (generation bump)
    /// before the change is taken, the dump carries them and a restore
    /// brings them back, a damaged copy refuses the image. Turning APTPL
    /// off leaves an image without them. Once fenced, a change the image
    /// would carry is refused.
    #[test]
    fn aptpl_reservations_are_content_the_image_carries() {
        let (dir, v) = persistent_volume("aptpl");
        let restored = |v: &Volume| {
            let id = image_identity(v);
            let path = v
                .persistence()
                .expect("p")
                .image_dir
                .join(image::image_name(&id.identity.naa, id.generation));
            let fresh = Store::new(3 << 20, HugePages::Off).expect("store");
            let r = image::restore(&path, &id, &fresh, &|| false).expect("restore");
            (path, id, r.reservations)
        };
        let g0 = state_generation(&v);
        v.keep_reservations(reservations(false, 0xa)).expect("kept");
        assert_eq!(state_generation(&v), g0, "no APTPL: no bump");
        assert_eq!(kept(&v).reservations, reservations(false, 0xa));
        v.keep_reservations(reservations(true, 0xa)).expect("kept");
        assert_eq!(state_generation(&v), g0 + 1, "APTPL: bumped before GOOD");
        assert_eq!(kept(&v).reservations, reservations(true, 0xa));
        v.keep_reservations(reservations(false, 0xa)).expect("kept");
        v.fence();
        assert_eq!(
            v.keep_reservations(reservations(true, 0xb)),
            Err(VolumeError::Fenced)
        );
        assert_eq!(v.kept_reservations(), reservations(false, 0xa));
        v.dump(false).expect("dump");
        assert_eq!(restored(&v).2, None, "APTPL off: none in the image");

        v.take_back();
        v.keep_reservations(reservations(true, 0xc)).expect("kept");
        assert_eq!(state_generation(&v), g0 + 2, "the clean image went stale");
        v.fence();
        assert!(v.dump(false).expect("dump").contains("dumped to"));
        let (path, id, carried) = restored(&v);
        assert_eq!(carried, Some(reservations(true, 0xc)));
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[4096 + 10] ^= 1;
        let torn = dir.join("torn.img");
        std::fs::write(&torn, &bytes).expect("write");
        let e = image::verify(&torn, &id).expect_err("a damaged image");
        assert!(e.to_string().contains("reservations"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// `status` says what the next dump writes. Restored content whose
    /// image is current is not dumped again until something changes, so
    /// that is nothing: not the whole restored LUN.
    #[test]
    fn restored_content_is_not_counted_for_the_next_dump_until_it_changes() {
        let (dir, v) = persistent_volume("status-written");
        let generation = v.generation();
        v.set_restored(
            Restored {
                image: dir.join("images").join("restored.img"),
                kept_from: None,
                taken_unix: 0,
                generation,
            },
            [0, 1],
            None,
        );
        let restored = v.status().written_bytes;
        v.commit_write(4096, 512).expect("a write");
        let written = v.status().written_bytes;
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(written, 2 << 20, "written: the restored chunks and more");
        assert_eq!(restored, 0, "restored, unchanged: nothing to dump");
    }

    #[test]
    fn only_a_fenced_volume_is_marked_clean() {
        let (dir, v) = persistent_volume("unfenced-dump");
        v.store().write(0, &[1; 4096]).expect("write");
        v.commit_write(0, 4096).expect("commit");
        let _ = v.dump(false);
        let g = v.generation();
        let clean = v.persistence().expect("p").state().is_clean("iqn.t", 0, g);
        let _ = std::fs::remove_dir_all(dir);
        assert!(!clean, "an unfenced dump marked the generation clean");
    }

    #[test]
    fn a_dump_restores_and_a_clean_unchanged_volume_is_not_dumped_again() {
        let (dir, v) = persistent_volume("dump");
        v.store().write(1 << 20, &[0xab; 4096]).expect("write");
        v.commit_write(1 << 20, 4096).expect("commit");
        v.fence();
        let said = v.dump(true).expect("dump");
        assert!(said.contains("1 chunks"), "{said}");
        let generation = v.generation();
        let id = image_identity(&v);
        let path = v
            .persistence()
            .expect("p")
            .image_dir
            .join(image::image_name(&id.identity.naa, generation));
        image::verify(&path, &id).expect("the image verifies");
        let fresh = Store::new(3 << 20, HugePages::Off).expect("store");
        let r = image::restore(&path, &id, &fresh, &|| false).expect("restore");
        assert_eq!(r.chunks, vec![1]);
        let mut b = [0u8; 4096];
        fresh.read(1 << 20, &mut b).expect("read");
        assert_eq!(b, [0xab; 4096]);
        // Dumped and unchanged: nothing to do, as long as the image is there.
        assert!(v.dump(false).expect("dump").contains("nothing written"));
        std::fs::remove_file(&path).expect("remove");
        assert!(
            v.dump(false).expect("dump").contains("dumped to"),
            "a missing image is written again"
        );
        // Fenced: nothing more is acknowledged, and the image stays current.
        assert_eq!(v.commit_write(0, 512), Err(VolumeError::Fenced));
        assert_eq!(state_generation(&v), generation);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The dump after the drain timeout (connections still open, so data
    /// may still be landing in the fenced memory) reads its image back: an
    /// image that does not verify is dumped again, and never recorded
    /// clean. Here memory keeps changing under every attempt: either an
    /// attempt happened to catch it still and its image verifies, or the
    /// dump fails, leaves no image and the generation unclean.
    #[test]
    fn a_verified_dump_of_changing_memory_is_clean_only_if_it_verifies() {
        let (dir, v) = persistent_volume("verify-changing");
        v.store().write(0, &[1; 4096]).expect("write");
        v.commit_write(0, 3 << 20).expect("commit");
        v.fence();
        let store = v.store().clone();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let writer = {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                let mut n = 0u8;
                while !stop.load(Ordering::Relaxed) {
                    n = n.wrapping_add(1);
                    for c in 0..3u64 {
                        let _ = store.write(c << 20, &[n; 64 << 10]);
                    }
                    rounds.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        while rounds.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let before = rounds.load(Ordering::SeqCst);
        let result = v.dump(true);
        let during = rounds.load(Ordering::SeqCst) - before;
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("writer");
        // The race is shown to happen: the memory changed while it was
        // dumped and read back.
        assert!(during > 0, "the writer never ran during the dump");
        let generation = v.generation();
        let id = image_identity(&v);
        let p = v.persistence().expect("p");
        let path = p
            .image_dir
            .join(image::image_name(&id.identity.naa, generation));
        let clean = p.state().is_clean("iqn.t", 0, generation);
        let verifies = image::verify(&path, &id);
        let _ = std::fs::remove_dir_all(dir);
        match result {
            Ok(said) => {
                assert!(verifies.is_ok(), "recorded clean: {said}; but {verifies:?}");
                assert!(clean, "{said}");
            }
            Err(e) => {
                assert!(e.contains("does not verify"), "{e}");
                assert!(!path.exists(), "a failed image is left behind");
                assert!(!clean, "a failed dump marked the generation clean");
            }
        }
    }
}
