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

mod accept;
mod dump;
mod facts;
mod fd_store;
mod identity;
pub mod image;
mod keeping;
pub mod kept;
pub mod pages;
mod placing;
pub mod state;
mod written;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use crate::store::Store;
use kept::{KeptReservations, KeptState, RecordArea};
use state::StateDir;

pub use facts::{next_start, VolumeFacts, KEPT_MEMORY};
pub use identity::{naa_hex, Identity};
pub use placing::PlacingWrite;
pub use written::WrittenChunks;

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
    use super::kept::KeptRecord;
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
