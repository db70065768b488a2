//! Start and stop of the daemon's volumes: verified restore before the
//! portal listens, fence and dump on the way out (docs/persistence.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};

use crate::config::Config;
use crate::core::Core;
use crate::handover::KeptVolume;
use crate::notify;
use crate::private_dir;
use crate::store::{HugePages, Store, StoreError};
use crate::volume::image::{self, ImageError, ImageIdentity};
use crate::volume::kept::{self, KeptState, RecordArea, MEMORY_PREFIX, RECORD_PREFIX};
use crate::volume::state::{Recall, StateDir};
use crate::volume::{naa_hex, now_unix, Remedy, CHUNK_SIZE};
use crate::volume::{
    Identity, KeptFrom, Persistence, Readiness, Restored, Volume, VolumeConfig, Volumes,
};

/// How long shutdown waits for connections to end before it dumps anyway
/// (the volumes are fenced either way: nothing more is acknowledged).
pub const CONNECTION_DRAIN: Duration = Duration::from_secs(10);

mod take_over;

/// Why the state directory could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// Another process holds its lock.
    Locked(String),
    Other(String),
}

impl From<OpenError> for String {
    fn from(e: OpenError) -> String {
        match e {
            OpenError::Locked(s) | OpenError::Other(s) => s,
        }
    }
}

/// Open the state directory (locked for the daemon's lifetime, through
/// `inherited_lock` after a planned restart) and the image directory.
pub fn open_persistence(
    cfg: &Config,
    inherited_lock: Option<OwnedFd>,
) -> Result<Option<Arc<Persistence>>, OpenError> {
    let (Some(state_dir), Some(image_dir)) = (&cfg.state_dir, &cfg.image_dir) else {
        return Ok(None);
    };
    let state = StateDir::open_with(state_dir, inherited_lock).map_err(|e| match e {
        e @ crate::volume::state::StateError::Locked { .. } => OpenError::Locked(e.to_string()),
        e => OpenError::Other(e.to_string()),
    })?;
    private_dir::prepare(image_dir, "image directory")
        .map_err(|e| OpenError::Other(e.to_string()))?;
    Ok(Some(Arc::new(Persistence::new(state, image_dir.clone()))))
}

/// Where kept LUN memory came from; it decides what proves the memory's
/// last writer gone.
#[derive(Debug)]
enum Source {
    /// A planned restart of this very process: each record must say it was
    /// handed over under `token` by this pid before the exec.
    Restart { token: u64 },
    /// systemd's fd store, after the daemon ended (a crash, a `systemctl
    /// restart`): `writer` says whether the last writer is proven gone,
    /// judged from the stored `writers` pidfds and the unit's cgroup once
    /// this start holds the state directory's lock (before it, a writer
    /// that still holds the lock is of course still running).
    Holder {
        writers: Vec<OwnedFd>,
        writer: Result<(), String>,
    },
}

/// The LUN memory a planned restart handed over or systemd's fd store kept,
/// until each configured LUN has claimed its own.
#[derive(Debug)]
pub struct KeptMemory {
    source: Source,
    volumes: Vec<KeptVolume>,
    /// Why none of it may be served, whatever the records say.
    refused: Option<String>,
}

/// Why a LUN's kept memory is not served, and what the LUN does instead.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Unkept {
    /// Its image decides, as on a start after a stop (no memory, or memory
    /// that is not this identity's current content).
    Image(String),
    /// NOT READY whatever the image says: the memory may be the only
    /// current copy, or the state directory is not the one it belongs to.
    /// It stays in the store for a start that finds the doubt gone.
    NotReady(String),
    /// NOT READY for one doubt only: its writer still runs. Once that
    /// writer ends, a start takes the memory over (`take-over`).
    WriterRunning(String),
    /// NOT READY, and no start will serve the memory: it was this LUN's
    /// content but can no longer be trusted (discarded while serving, or
    /// written by a process that died of a fault, with no image of its
    /// generation). accept-empty is the way back.
    Lost(String),
}

impl Unkept {
    fn reason(&self) -> &str {
        match self {
            Unkept::Image(r) | Unkept::NotReady(r) | Unkept::WriterRunning(r) | Unkept::Lost(r) => {
                r
            }
        }
    }
}

impl KeptMemory {
    /// Judge again, once the state directory's lock is this start's, every
    /// fact the take-over rules use that may have changed while it waited:
    /// whether the last writer is gone (it may have held the lock, stopped,
    /// and been killed since), and each record. A start reads them before
    /// it holds the state directory's lock; by the time it does, another
    /// process may have served this memory and moved its record on (two
    /// successors given the same memory: the first's writes bumped the
    /// generation), and the take-over must judge the record as it is now.
    fn read_again_under_the_lock(&mut self) {
        if let Source::Holder { writers, writer } = &mut self.source {
            *writer = writers_gone(writers).and_then(|()| cgroup_alone());
        }
        for v in &mut self.volumes {
            if let Some(fd) = &v.record_memory {
                v.record = kept::read_handed(fd.as_fd()).map_err(|e| e.to_string());
            }
        }
    }

    /// What a planned restart handed over.
    pub fn handed(
        token: u64,
        volumes: Vec<KeptVolume>,
        rdma_descriptors: Vec<String>,
    ) -> KeptMemory {
        KeptMemory {
            source: Source::Restart { token },
            volumes,
            refused: rdma_refusal(&rdma_descriptors),
        }
    }

    /// What systemd's fd store passed at start (`LISTEN_FDNAMES`): each
    /// LUN's memory `lun-<naa>` beside its record `rec-<naa>`, and the
    /// pidfds of the processes that wrote them (`writer`). `None` when it
    /// passed nothing.
    pub fn stored(
        named: Vec<(String, OwnedFd)>,
        rdma_descriptors: Vec<String>,
    ) -> Option<KeptMemory> {
        if named.is_empty() {
            return None;
        }
        let mut memories: BTreeMap<String, Vec<OwnedFd>> = BTreeMap::new();
        let mut records: BTreeMap<String, Vec<OwnedFd>> = BTreeMap::new();
        let mut writers = Vec::new();
        for (name, fd) in named {
            if let Some(naa) = name.strip_prefix(MEMORY_PREFIX) {
                memories.entry(naa.into()).or_default().push(fd);
            } else if let Some(naa) = name.strip_prefix(RECORD_PREFIX) {
                records.entry(naa.into()).or_default().push(fd);
            } else if name == notify::WRITER_NAME {
                writers.push(fd);
            } else {
                tracing::warn!(
                    "the fd store passed a descriptor named {name:?}, which this daemon never stores: closed"
                );
                let _ = notify::remove(&name);
            }
        }
        let mut volumes = Vec::new();
        for (naa, mut mem) in memories {
            let mut recs = records.remove(&naa).unwrap_or_default();
            let record = match (mem.len(), recs.as_slice()) {
                (1, [one]) => kept::read_handed(one.as_fd()).map_err(|e| e.to_string()),
                (m, r) => Err(format!(
                    "the fd store holds {m} memories and {} records under naa.{naa}: never pick one",
                    r.len()
                )),
            };
            // Several memories or records under one name: which would be a
            // guess, so none is taken (and none read again later).
            let record_memory = if (mem.len(), recs.len()) == (1, 1) {
                recs.pop()
            } else {
                None
            };
            volumes.push(KeptVolume {
                memory: mem.swap_remove(0),
                record,
                record_memory,
                stored_as: Some(naa),
            });
        }
        for naa in records.into_keys() {
            tracing::warn!(
                "the fd store holds a kept-memory record for naa.{naa} without its memory: removed"
            );
            let _ = notify::remove(&format!("{RECORD_PREFIX}{naa}"));
        }
        Some(KeptMemory {
            source: Source::Holder {
                writer: Err("not judged before the state directory's lock is had".into()),
                writers,
            },
            volumes,
            refused: rdma_refusal(&rdma_descriptors),
        })
    }

    /// The kept memory for `target` LUN `lun`, whose identity the state
    /// directory says is `naa` (if it knows the LUN): the one whose record
    /// names the LUN or whose store name is that NAA. Two are both refused
    /// (never pick one); `None` when there is none.
    fn claim(
        &mut self,
        target: &str,
        lun: u64,
        naa: Option<&str>,
    ) -> Option<Result<(KeptVolume, kept::KeptRecord), Unkept>> {
        let mine = |k: &KeptVolume| {
            k.record
                .as_ref()
                .is_ok_and(|c| c.record.target == target && c.record.lun == lun)
                || (naa.is_some() && k.stored_as.as_deref() == naa)
        };
        let mut claimed: Vec<KeptVolume> = Vec::new();
        let mut i = 0;
        while i < self.volumes.len() {
            if mine(&self.volumes[i]) {
                claimed.push(self.volumes.swap_remove(i));
            } else {
                i += 1;
            }
        }
        let k = match claimed.len() {
            0 => return None,
            1 => claimed.pop()?,
            // NOT READY, and what the store holds stays there: a later
            // start may find the doubt gone, accept-empty clears it.
            n => {
                return Some(Err(Unkept::NotReady(format!(
                    "{n} kept memories name this LUN: never pick one"
                ))))
            }
        };
        if let Some(why) = &self.refused {
            return Some(Err(Unkept::NotReady(why.clone())));
        }
        let record = match &k.record {
            Ok(c) => c.record.clone(),
            Err(e) => {
                return Some(Err(Unkept::NotReady(format!(
                    "its kept-memory record is unreadable: {e}"
                ))))
            }
        };
        Some(Ok((k, record)))
    }

    /// What no configured LUN claimed. Memory systemd's fd store holds
    /// stays there, listed: it may be the only copy of a LUN the
    /// configuration lost by mistake, so only `discard-kept` (or a
    /// configuration that names its LUN again, at the next start) ends it.
    /// Memory a restart handed over without a store behind it has no such
    /// keeper and is released (the handover check refuses a configuration
    /// that drops a served LUN, so this is memory of no LUN).
    pub fn unclaimed(self) -> Vec<UnclaimedKept> {
        let mut kept = Vec::new();
        for k in self.volumes {
            let what = match &k.record {
                Ok(c) => {
                    let r = &c.record;
                    format!(
                        "target {} LUN {}, {} bytes, generation {}, {:?}",
                        r.target, r.lun, r.lun_bytes, r.generation, r.state
                    )
                }
                Err(e) => format!("its record is unusable: {e}"),
            };
            match &k.stored_as {
                Some(naa) => {
                    tracing::warn!(
                        "kept memory naa.{naa} ({what}) is claimed by no configured LUN: left in \
                         systemd's fd store, not served. Configure its LUN again, or release it \
                         with `ramslog-target discard-kept {naa}`"
                    );
                    kept.push(UnclaimedKept {
                        naa: naa.clone(),
                        what,
                    });
                }
                None => tracing::warn!("kept memory of no configured LUN ({what}): released"),
            }
        }
        kept
    }
}

/// Kept memory no configured LUN claims, left in systemd's fd store (see
/// [`KeptMemory::unclaimed`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnclaimedKept {
    /// The NAA it is stored under (`lun-<naa>`, `rec-<naa>`).
    pub naa: String,
    /// What its record says it is, or why it cannot be read.
    pub what: String,
}

/// `discard-kept`: drop an unclaimed kept memory from systemd's fd store,
/// freeing its RAM. Only what `unclaimed` lists may go: the memory of a
/// configured LUN is that LUN's content (accept-empty is its way out).
pub fn discard_unclaimed(unclaimed: &mut Vec<UnclaimedKept>, naa: &str) -> Result<String, String> {
    let naa = naa.trim_start_matches("naa.").to_ascii_lowercase();
    let Some(i) = unclaimed.iter().position(|u| u.naa == naa) else {
        return Err(if unclaimed.is_empty() {
            format!(
                "no unclaimed kept memory naa.{naa}: this daemon holds none (`status` lists them)"
            )
        } else {
            format!(
                "no unclaimed kept memory naa.{naa}; `status` lists them: {}",
                unclaimed
                    .iter()
                    .map(|u| format!("naa.{}", u.naa))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        });
    };
    for prefix in [MEMORY_PREFIX, RECORD_PREFIX] {
        notify::remove(&format!("{prefix}{naa}"))
            .map_err(|e| format!("cannot remove naa.{naa} from systemd's fd store: {e}"))?;
    }
    let gone = unclaimed.remove(i);
    tracing::warn!("kept memory naa.{naa} ({}) discarded on request", gone.what);
    Ok(format!(
        "kept memory naa.{naa} ({}) released from systemd's fd store",
        gone.what
    ))
}

/// Drop a kept memory from systemd's fd store: refused, it must not come
/// back.
fn forget_stored_naa(naa: &str) {
    for prefix in [MEMORY_PREFIX, RECORD_PREFIX] {
        if let Err(e) = notify::remove(&format!("{prefix}{naa}")) {
            tracing::warn!("cannot remove naa.{naa} from the fd store: {e}");
        }
    }
}

fn rdma_refusal(rdma_descriptors: &[String]) -> Option<String> {
    (!rdma_descriptors.is_empty()).then(|| {
        format!(
            "this process holds RDMA device descriptors ({}) it did not open, so an old \
             queue pair may still write",
            rdma_descriptors.join(", ")
        )
    })
}

/// Whether every stored writer pidfd says its process has ended: a pidfd
/// polls readable once the whole thread group is gone (a leader that
/// exited while another thread lives is not).
fn writers_gone(pidfds: &[OwnedFd]) -> Result<(), String> {
    for fd in pidfds {
        if !kept::pidfd_ended(fd) {
            let pid = std::fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                std::os::fd::AsRawFd::as_raw_fd(fd)
            ))
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("Pid:").map(|p| p.trim().to_string()))
            })
            .unwrap_or_else(|| "unknown".into());
            return Err(format!(
                "the process that last wrote the LUN memory (pid {pid}) is still running"
            ));
        }
    }
    Ok(())
}

/// The writers of kept memory still running now (stored writer pidfds
/// that have not ended, the record's owner, and any other process in the
/// unit's cgroup), as pidfds to watch: the memory held back for them can
/// be taken over once they end.
fn living_writers(source: &Source, owner: kept::Owner) -> Vec<OwnedFd> {
    let Source::Holder { writers, .. } = source else {
        return Vec::new();
    };
    let mut living: Vec<OwnedFd> = writers
        .iter()
        .filter(|fd| !kept::pidfd_ended(fd))
        .filter_map(|fd| fd.try_clone().ok())
        .collect();
    let mut pids: Vec<u32> = Vec::new();
    if kept::still_running(owner.pid, owner.start_time) {
        pids.push(owner.pid);
    }
    // A process left in the unit's cgroup holds the memory back as a
    // writer does: once it ends, take-over may serve the memory.
    if let Ok(Some((_, others))) = cgroup_others() {
        pids.extend(others);
    }
    living.extend(pids.into_iter().filter_map(|pid| {
        let pid = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
    }));
    living
}

/// Under systemd, whether this process is alone in its unit's cgroup: a
/// forked child or a straggler of the old daemon there may still write.
/// Not in a service's cgroup (no systemd), there is nothing to ask.
fn cgroup_alone() -> Result<(), String> {
    match cgroup_others()? {
        Some((path, others)) if !others.is_empty() => {
            let pids: Vec<String> = others.iter().map(u32::to_string).collect();
            Err(format!(
                "the unit's cgroup {path} still holds process(es) {}: one may still write the LUN memory",
                pids.join(", ")
            ))
        }
        _ => Ok(()),
    }
}

/// The processes other than this one in this process's unit's cgroup, with
/// the cgroup's path; `None` outside a service's cgroup.
fn cgroup_others() -> Result<Option<(String, Vec<u32>)>, String> {
    let Some(path) = notify::service_cgroup() else {
        return Ok(None);
    };
    let procs = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .find_map(|root| std::fs::read_to_string(format!("{root}{path}/cgroup.procs")).ok())
        .ok_or_else(|| format!("cannot read the processes of the unit's cgroup {path}"))?;
    let me = std::process::id();
    let others = procs
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(|p| *p != me)
        .collect();
    Ok(Some((path, others)))
}

/// The volume over kept memory, if every rule holds: the record binds it
/// to this memfd, names this state directory's identity and generation
/// (or a bump of it the state made durable), this size and block size, was
/// written in this boot, and its writer is proven gone (the source says
/// how). Otherwise why not, and whether the image may decide instead.
#[allow(clippy::too_many_arguments)]
fn adopt_kept(
    p: &Arc<Persistence>,
    source: &Source,
    (k, r): (KeptVolume, kept::KeptRecord),
    target: &str,
    lun: u64,
    (size, block_size, verify): (u64, u32, bool),
) -> Result<Volume, Unkept> {
    // Only a LUN the state knows: recalling an unknown one would give it a
    // new identity.
    let recalled = {
        let mut state = p.state();
        match state.generation(target, lun) {
            Some(_) => state.recall(target, lun).ok(),
            None => None,
        }
    };
    let known = match recalled {
        Some(Recall::Known {
            identity,
            generation,
            clean,
        }) => Some(take_over::Known {
            identity,
            generation,
            clean,
        }),
        _ => None,
    };
    let fault = k.record.as_ref().ok().and_then(|c| c.fault);
    let came = match source {
        Source::Restart { token } => take_over::Came::Restart { token: *token },
        Source::Holder { writer, .. } => take_over::Came::Holder { writer },
    };
    let facts = take_over::Facts {
        came,
        record: &r,
        fault,
        boot_id: kept::boot_id(),
        me: kept::this_process(),
        owner_running: matches!(source, Source::Holder { .. })
            && kept::still_running(r.owner.pid, r.owner.start_time),
        state: known.clone(),
        shape: (size, block_size),
        verify,
        memory_inode: rustix::fs::fstat(&k.memory).map_or(0, |s| s.st_ino),
    };
    let allowed = match take_over::decide(&facts) {
        Ok(allowed) => allowed,
        // Only the writer stands in the way when the rules allow the memory
        // with the writer taken as gone: its end is worth watching for.
        Err(Unkept::NotReady(why)) if matches!(facts.came, take_over::Came::Holder { .. }) => {
            let gone = Ok(());
            let without_writer = take_over::Facts {
                came: take_over::Came::Holder { writer: &gone },
                owner_running: false,
                ..facts.clone()
            };
            return Err(match take_over::decide(&without_writer) {
                Ok(_) => Unkept::WriterRunning(why),
                Err(_) => Unkept::NotReady(why),
            });
        }
        Err(other) => return Err(other),
    };
    // The rules refuse memory of a LUN the state does not know.
    let Some(known) = known else {
        return Err(Unkept::NotReady(
            "the state directory does not know this LUN".into(),
        ));
    };
    let identity = known.identity.clone();
    let generation = allowed.generation;
    let faulted = |why: String| take_over::faulted(&known, why);
    let image = Unkept::Image;
    // Dropping them would let a host fenced by a preempt write again.
    crate::scsi::check_kept_reservations(&r.reservations).map_err(|why| {
        Unkept::NotReady(format!(
            "its record's persistent reservations are not ones this LU could hold ({why})"
        ))
    })?;
    let chunks = r
        .written
        .chunks(CHUNK_SIZE, size.div_ceil(CHUNK_SIZE))
        .ok_or_else(|| image("its list of written chunks does not fit this LUN".into()))?;
    // The record area is written on where the predecessor wrote it: a
    // holder keeps that one, so a crash from here on finds this process's
    // records beside the memory.
    let area = match (k.record_memory, k.record) {
        (Some(fd), Ok(current)) => RecordArea::adopt(fd, current)
            .map_err(|e| Unkept::NotReady(format!("its record area: {e}")))?,
        _ => return Err(Unkept::NotReady("its record area was not passed on".into())),
    };
    let store =
        Store::adopt(k.memory, size, r.memfd_bytes).map_err(|e| Unkept::NotReady(e.to_string()))?;
    if verify {
        check_page_crcs(&area, &store, fault, r.page_crcs, target, lun).map_err(faulted)?;
    }
    // Older images are never loaded again (their generation is past);
    // removing them can wait, the take-over cannot (a 4 GiB image takes
    // seconds to unlink).
    {
        let (dir, naa, target) = (p.image_dir.clone(), identity.naa, target.to_string());
        std::thread::spawn(move || {
            if let Err(e) = image::remove_older_images(&dir, &naa, generation) {
                tracing::warn!(target, lun, "cannot tidy the image directory: {e}");
            }
        });
    }
    let image_path = p
        .image_dir
        .join(image::image_name(&identity.naa, generation));
    // Claimed (the record names this process) before the memory is served
    // or registered.
    let volume = Volume::with_record(
        VolumeConfig {
            target: target.into(),
            lun,
            block_size,
            identity,
            readiness: Readiness::NeedsAcceptance,
            page_crcs: verify,
        },
        Arc::new(store),
        Some(p.clone()),
        generation,
        (Some(area), r.reservations.clone(), r.inquiry),
    );
    let ended = match (source, &r.state) {
        (Source::Restart { .. }, _) => "handed it over in a planned restart",
        (Source::Holder { .. }, KeptState::HandedOver { .. }) => {
            "handed it over in a restart whose new program did not take it; systemd's fd store kept it"
        }
        (Source::Holder { .. }, _) => {
            "ended without handing it over (kill -9, an OOM kill, or a crash with no fault recorded); \
             systemd's fd store kept it"
        }
    };
    volume.set_restored(
        Restored {
            image: image_path,
            kept_from: Some(KeptFrom {
                writer_pid: r.owner.pid,
                ended,
            }),
            taken_unix: now_unix(),
            generation,
        },
        chunks,
        // The record's reservations came with the record.
        None,
    );
    Ok(volume)
}

/// `--verify-kept-memory` on kept memory about to be served. After a
/// `fault` of its writer: every page must match the checksum the writer
/// kept (an error says how many do not); the fault mark is then cleared,
/// since this process vouches for the memory from here on. Without one:
/// pages the writer left mid-write get the checksum of what they hold, and
/// a table its writer did not keep is computed afresh.
fn check_page_crcs(
    area: &RecordArea,
    store: &Store,
    fault: Option<kept::ExitCause>,
    kept_current: bool,
    target: &str,
    lun: u64,
) -> Result<(), String> {
    let Some(crcs) = area.page_crcs(store) else {
        if let Some(cause) = fault {
            return Err(format!(
                "its writer died of {cause} and its record area holds no page checksums"
            ));
        }
        tracing::warn!(target, lun, "--verify-kept-memory: this kept memory has no room for page checksums (its run did not keep them); they are kept from the LUN's next start from its image (a stop and a start)");
        return Ok(());
    };
    match fault {
        Some(cause) => {
            let c = crcs.check();
            if c.differ > 0 {
                return Err(format!(
                    "its writer died of {cause}, and {} of its {} pages differ from their checksums \
                     (the first at byte {}): the memory holds bytes nobody wrote",
                    c.differ,
                    c.pages,
                    c.first_differ.unwrap_or(0)
                ));
            }
            tracing::warn!(
                target,
                lun,
                "its writer died of {cause}; every page matches its checksum ({} pages in {:.2} s, {} with a write under way when it died not checked): serving it",
                c.pages,
                c.took.as_secs_f64(),
                c.in_flight
            );
            crcs.settle_abandoned();
            area.clear_fault_mark();
        }
        None if kept_current => {
            crcs.settle_abandoned();
        }
        None => {
            let took = crcs.rebuild();
            tracing::info!(
                target,
                lun,
                "page checksums of the kept memory computed in {:.2} s",
                took.as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Build one target's volumes: map and lock the memory (or take the kept
/// memory a planned restart handed over or systemd's fd store held),
/// recall each identity and restore its image where one is trusted. Under
/// a holder, each new LUN memory and its record go into the fd store.
pub fn open_volumes(
    cfg: &Config,
    persistence: Option<&Arc<Persistence>>,
    cancelled: &AtomicBool,
    mut kept: Option<KeptMemory>,
) -> Result<Opened, String> {
    // The caller holds the state directory's lock now.
    if let Some(k) = kept.as_mut() {
        k.read_again_under_the_lock();
    }
    let writers_gone = match &kept {
        Some(KeptMemory {
            source: Source::Holder { writer, .. },
            ..
        }) => writer.is_ok(),
        _ => true,
    };
    let mut volumes = Vec::new();
    // Pushed into the fd store by this start (their places in `volumes`):
    // held once the barrier after the writer's pidfd returns.
    let mut pushed: Vec<usize> = Vec::new();
    for t in &cfg.targets {
        for l in &t.luns {
            let known_naa = persistence.and_then(|p| {
                let state = p.state();
                state.naa(&t.name, l.lun)
            });
            // Kept memory first: refused, it is freed before new memory is taken.
            let claimed = kept.as_mut().and_then(|k| {
                let claim = k.claim(&t.name, l.lun, known_naa.as_deref())?;
                Some((&k.source, claim))
            });
            // The writers found running, when the memory is held for them.
            let mut held_for = Vec::new();
            let unkept = match (persistence, claimed) {
                (Some(p), Some((source, Ok(claim)))) => {
                    let stored_as = claim.0.stored_as.clone();
                    let owner = claim.1.owner;
                    let shape = (l.size, l.block_size, cfg.verify_kept_memory);
                    match adopt_kept(p, source, claim, &t.name, l.lun, shape) {
                        Ok(volume) => {
                            tracing::info!(target = %t.name, lun = l.lun, generation = volume.generation(), "LUN content kept in memory (not read from the image)");
                            crate::test_pause::here("kept");
                            match source {
                                // The store passed it: it holds it still.
                                Source::Holder { .. } => volume.confirm_in_fd_store(),
                                // Handed over: the store may lack it.
                                Source::Restart { .. } => {
                                    if volume.keep_in_fd_store() {
                                        pushed.push(volumes.len());
                                    }
                                }
                            }
                            volumes.push(volume);
                            continue;
                        }
                        Err(why) => {
                            // Not this LUN's content: it must not come back.
                            if let (Unkept::Image(_), Some(naa)) = (&why, stored_as) {
                                forget_stored_naa(&naa);
                            }
                            match why {
                                Unkept::WriterRunning(reason) => {
                                    held_for = living_writers(source, owner);
                                    // Nothing to watch (the cgroup could not be
                                    // read, the writer ended meanwhile): no end
                                    // will be seen, so take-over is not promised.
                                    Some(if held_for.is_empty() {
                                        Unkept::NotReady(reason)
                                    } else {
                                        Unkept::WriterRunning(reason)
                                    })
                                }
                                other => Some(other),
                            }
                        }
                    }
                }
                (Some(_), Some((_, Err(why)))) => Some(why),
                (None, Some(_)) => {
                    tracing::warn!(target = %t.name, lun = l.lun, "kept memory not used: without a state directory nothing is kept");
                    None
                }
                (_, None) => None,
            };
            if let Some(why) = &unkept {
                tracing::warn!(target = %t.name, lun = l.lun, "kept memory not used: {}", why.reason());
            }
            let memory = LunMemory {
                target: &t.name,
                lun: l.lun,
                size: l.size,
                huge: cfg.hugepages,
            };
            let volume = match persistence {
                // Nothing is kept and nothing would decide at a later start:
                // memory that cannot be had fails the start, naming the fix.
                None => Volume::in_memory(
                    VolumeConfig {
                        target: t.name.clone(),
                        lun: l.lun,
                        block_size: l.block_size,
                        identity: Identity::generate(),
                        readiness: Readiness::Ready,
                        // Nothing is kept, so nothing is ever checked: the
                        // checksums only show the write accounting (the
                        // check at a clean stop), which the tests use.
                        page_crcs: cfg.verify_kept_memory,
                    },
                    memory
                        .taken()
                        .map_err(|e| format!("target {} LUN {}: {e}", t.name, l.lun))?,
                ),
                Some(p) => recall(
                    p,
                    (&t.name, l.lun),
                    (l.block_size, cfg.verify_kept_memory),
                    &memory,
                    cancelled,
                    unkept.clone(),
                )?,
            };
            if !held_for.is_empty() {
                volume.hold_for_writers(held_for);
            }
            // Only content goes into the store. A NOT READY volume's memory
            // holds none: memory refused for a doubt a later start may not
            // have stays in the store without it beside, and the empty
            // memory of a LUN whose image is missing or unreadable stays
            // out, so that the next start (a crash, a restart) asks the
            // image again instead of finding "discarded". accept-empty
            // stores the memory once it is the new device's content.
            if persistence.is_some()
                && volume.is_ready()
                && !cancelled.load(Ordering::Acquire)
                && volume.hold_in_fd_store(known_naa.as_deref())
            {
                pushed.push(volumes.len());
            }
            volumes.push(volume);
        }
    }
    let unclaimed = kept.map(KeptMemory::unclaimed).unwrap_or_default();
    if persistence.is_some() && notify::has_holder() {
        // Every LUN's memory is claimed by now: this process is its writer.
        // systemd 254 and later say how many descriptors the store takes
        // (252 does not).
        let need = notify::descriptors_to_take(volumes.len());
        if let Some(max) = std::env::var("FDSTORE")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&max| max < need)
        {
            tracing::warn!(
                "the unit's FileDescriptorStoreMax is {max}, below the {need} this configuration needs: \
                 a crash loses the content of the LUNs whose memory did not fit (raise it in the unit)"
            );
        }
        match notify::store_writer(writers_gone) {
            Ok(true) => {
                for &i in &pushed {
                    volumes[i].confirm_in_fd_store();
                }
                tracing::info!("LUN memory held in systemd's fd store");
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(
                "cannot confirm the fd store holds the LUN memory ({e}): a crash will lose what no image has"
            ),
        }
        crate::test_pause::here("stored");
    }
    Ok(Opened {
        volumes: Volumes::new(volumes),
        unclaimed,
    })
}

/// What a start opened: the configured LUNs' volumes, and the kept memory
/// none of them claimed.
pub struct Opened {
    pub volumes: Volumes,
    pub unclaimed: Vec<UnclaimedKept>,
}

/// A configured LUN's memory, had only where it serves: a LUN that answers
/// NOT READY serves no byte, so it gets [`Store::reserved`] memory (no RAM
/// taken) until accept-empty. With a state directory, memory that cannot be
/// had makes that LUN NOT READY, never the start fail: the other LUNs serve,
/// the control socket answers, and the image decides again next time.
struct LunMemory<'a> {
    target: &'a str,
    lun: u64,
    size: u64,
    huge: HugePages,
}

impl LunMemory<'_> {
    fn name(&self) -> String {
        format!("ramslog {} LUN {}", self.target, self.lun)
    }

    /// Memory faulted in and locked, for a LUN that serves.
    fn taken(&self) -> Result<Arc<Store>, StoreError> {
        let store = Store::named(&self.name(), self.size, self.huge)?;
        tracing::info!(target = %self.target, lun = self.lun, size = self.size, "LUN memory locked in RAM ({})", store.page_kind());
        Ok(Arc::new(store))
    }

    /// Memory that takes no RAM until accept-empty, for a NOT READY LUN.
    fn reserved(&self) -> Result<Arc<Store>, String> {
        Store::reserved(&self.name(), self.size, self.huge)
            .map(Arc::new)
            .map_err(|e| format!("target {} LUN {}: {e}", self.target, self.lun))
    }

    /// `volume` (over reserved memory) could not get its memory: NOT READY
    /// saying why, and what to do.
    fn not_had(&self, volume: &Volume, e: StoreError) {
        let reason = format!("its memory could not be had: {e}");
        tracing::error!(
            target = %self.target, lun = self.lun,
            "{reason}. It answers NOT READY: {}", Remedy::FreeMemory.advice()
        );
        volume.set_not_ready(reason, Remedy::FreeMemory);
    }
}

fn recall(
    p: &Arc<Persistence>,
    (target, lun): (&str, u64),
    (block_size, page_crcs): (u32, bool),
    memory: &LunMemory,
    cancelled: &AtomicBool,
    unkept: Option<Unkept>,
) -> Result<Volume, String> {
    let cfg = |identity, readiness| VolumeConfig {
        target: target.into(),
        lun,
        block_size,
        identity,
        readiness,
        page_crcs,
    };
    // Memory that may be the only current copy, or a state directory that
    // does not match it: NOT READY, and no new identity is recorded.
    let held = match &unkept {
        Some(Unkept::NotReady(reason)) => Some((reason, Remedy::KeptMemoryHeld)),
        Some(Unkept::WriterRunning(reason)) => Some((reason, Remedy::WriterToEnd)),
        Some(Unkept::Lost(reason)) => Some((reason, Remedy::AcceptEmpty)),
        _ => None,
    };
    if let Some((reason, remedy)) = held {
        let identity = {
            let mut state = p.state();
            match state
                .generation(target, lun)
                .map(|_| state.recall(target, lun))
            {
                Some(Ok(Recall::Known { identity, .. })) => identity,
                _ => Identity::generate(),
            }
        };
        let generation = p.state().generation(target, lun).unwrap_or(0);
        let volume = Volume::new(
            cfg(identity, Readiness::NeedsAcceptance),
            memory.reserved()?,
            Some(p.clone()),
            generation,
        );
        let reason = format!("kept memory not served: {reason}");
        tracing::warn!(
            target,
            lun,
            "{reason}. It answers NOT READY (manual intervention required): {}",
            remedy.advice()
        );
        volume.set_not_ready(reason, remedy);
        return Ok(volume);
    }
    // A LUN the state directory does not know gets its identity only with
    // its memory: one that never served must not be recorded.
    let new_store = if p.state().generation(target, lun).is_none() {
        match memory.taken() {
            Ok(store) => Some(store),
            Err(e) => {
                let volume = Volume::new(
                    cfg(Identity::generate(), Readiness::NeedsAcceptance),
                    memory.reserved()?,
                    Some(p.clone()),
                    0,
                );
                memory.not_had(&volume, e);
                return Ok(volume);
            }
        }
    } else {
        None
    };
    let recalled = p.state().recall(target, lun).map_err(|e| e.to_string())?;
    let (identity, generation, clean) = match recalled {
        Recall::New(id) => {
            tracing::info!(target, lun, naa = %naa_hex(&id.naa), serial = %id.serial, "new LUN identity");
            let generation = p.state().generation(target, lun).unwrap_or(0);
            let store = match new_store {
                Some(store) => store,
                None => memory
                    .taken()
                    .map_err(|e| format!("target {target} LUN {lun}: {e}"))?,
            };
            let volume = Volume::new(
                cfg(id, Readiness::Ready),
                store,
                Some(p.clone()),
                generation,
            );
            // The empty LUN gets its (empty) image at once: a start that
            // ends before any write must not leave it NOT READY, and an
            // image directory the daemon cannot write fails the start
            // instead of the first dump.
            volume.write_empty_image()?;
            return Ok(volume);
        }
        Recall::Known {
            identity,
            generation,
            clean,
        } => (identity, generation, clean),
    };
    // Leftovers of this identity go (start-up is single-threaded and the
    // state directory is locked), the current generation's image stays.
    if let Err(e) = image::remove_images(&p.image_dir, &identity.naa, Some(generation)) {
        tracing::warn!(target, lun, "cannot tidy the image directory: {e}");
    }
    let path = p
        .image_dir
        .join(image::image_name(&identity.naa, generation));
    let refuse = |volume: Volume, reason: String, remedy: Remedy| {
        let reason = match &unkept {
            Some(Unkept::Image(why)) => format!("{reason}; kept memory not used: {why}"),
            _ => reason,
        };
        tracing::warn!(
            target, lun, naa = %naa_hex(&identity.naa), generation,
            "LUN content not restored: {reason}. It answers NOT READY (manual intervention \
             required): {}", remedy.advice()
        );
        volume.set_not_ready(reason, remedy);
        volume
    };
    // NOT READY before the image is read: no memory is taken.
    let unread = |volume_cfg| -> Result<Volume, String> {
        Ok(Volume::new(
            volume_cfg,
            memory.reserved()?,
            Some(p.clone()),
            generation,
        ))
    };
    if !clean {
        let volume = unread(cfg(identity.clone(), Readiness::NeedsAcceptance))?;
        return Ok(refuse(
            volume,
            format!(
                "generation {generation} has no clean image (the daemon was killed, crashed or lost power without a clean stop)"
            ),
            Remedy::AcceptEmpty,
        ));
    }
    if !path.exists() {
        let volume = unread(cfg(identity.clone(), Readiness::NeedsAcceptance))?;
        return Ok(refuse(
            volume,
            format!(
                "the image of generation {generation}, {}, is missing",
                path.display()
            ),
            Remedy::ImageBack,
        ));
    }
    let store = match memory.taken() {
        Ok(store) => store,
        Err(e) => {
            let volume = unread(cfg(identity.clone(), Readiness::NeedsAcceptance))?;
            memory.not_had(&volume, e);
            return Ok(volume);
        }
    };
    let volume = Volume::new(
        cfg(identity.clone(), Readiness::NeedsAcceptance),
        store.clone(),
        Some(p.clone()),
        generation,
    );
    let expect = ImageIdentity {
        target: target.into(),
        lun,
        identity: identity.clone(),
        size: store.len(),
        block_size,
        generation,
    };
    tracing::info!(target, lun, image = %path.display(), "restoring LUN content");
    match image::restore(&path, &expect, &store, &|| {
        cancelled.load(Ordering::Acquire)
    }) {
        Ok(r) => {
            // Reservations a host asked to persist are part of the content:
            // ones no LU could have made refuse the image (dropping them
            // would let a fenced host write again).
            if let Some(why) = r
                .reservations
                .as_ref()
                .and_then(|k| crate::scsi::check_kept_reservations(k).err())
            {
                let _ = store.zero(0, store.len() as usize);
                return Ok(refuse(
                    volume,
                    format!(
                        "image {} refused: its persistent reservations are not valid: {why}",
                        path.display()
                    ),
                    Remedy::AcceptEmpty,
                ));
            }
            tracing::info!(
                target,
                lun,
                generation,
                chunks = r.chunks.len(),
                reservations = r.reservations.as_ref().map_or(0, |k| k.registrations.len()),
                "LUN content restored and verified: {} bytes in {:.2} s ({:.0} MiB/s)",
                r.bytes,
                r.seconds,
                r.bytes as f64 / r.seconds.max(1e-9) / (1 << 20) as f64
            );
            volume.set_restored(
                Restored {
                    image: r.path.clone(),
                    kept_from: None,
                    taken_unix: r.taken_unix,
                    generation,
                },
                r.chunks.iter().copied(),
                r.reservations,
            );
            if let Some(took) = volume.rebuild_page_crcs() {
                tracing::info!(
                    target,
                    lun,
                    "page checksums of the restored content computed in {:.2} s",
                    took.as_secs_f64()
                );
            }
            Ok(volume)
        }
        // A stop came during the restore: the image stays the valid copy,
        // and a NOT READY volume is never dumped over it.
        Err(ImageError::Cancelled) => {
            let reason =
                "a stop came during its restore; its image stays the valid copy".to_string();
            tracing::info!(target, lun, "{reason}");
            volume.set_not_ready(reason, Remedy::StartAgain);
            Ok(volume)
        }
        // An image that cannot be read may be had again; one that reads
        // wrong is lost.
        Err(e) => {
            let remedy = match e {
                ImageError::Io(_) => Remedy::ImageBack,
                _ => Remedy::AcceptEmpty,
            };
            Ok(refuse(
                volume,
                format!("image {} refused: {e}", path.display()),
                remedy,
            ))
        }
    }
}

/// Why the daemon fences its volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A stop: every changed volume is dumped.
    Stop,
    /// A planned restart; `dump` unless the fd store holds the memory.
    Restart { dump: bool },
}

/// Shut down: refuse new connections, end every connection, fence every
/// volume, wait (bounded) for connections to go, then dump what changed
/// (a restart whose memory the fd store holds skips the dump). Returns a
/// summary, or the failures.
pub fn shutdown(core: &Core, ending: Ending) -> Result<String, String> {
    // Only a restart without a dump is quick enough to ask hosts back
    // sooner than their DefaultTime2Wait.
    // The gate's close ends every connection, each session with it: every
    // session's control is the one its connection's permit watches
    // (tests/gate_close_tcp.rs).
    let told = core.gate.close(ending == Ending::Restart { dump: false });
    let volumes: Vec<&Arc<Volume>> = core.volumes.iter().collect();
    for v in &volumes {
        v.fence();
    }
    tracing::info!(
        connections = told,
        "shutting down: logins refused, connections closing, volumes fenced"
    );
    let started = Instant::now();
    let drain = match ending {
        Ending::Stop | Ending::Restart { dump: true } => CONNECTION_DRAIN,
        // Commands get no status after the fence: this bounds how long the
        // connections take to send the hosts' notice and go (the exec
        // closes any left, before the new program runs).
        Ending::Restart { dump: false } => core.limits.restart_drain,
    };
    while core.gate.counts_now().total > 0 && started.elapsed() < drain {
        std::thread::sleep(Duration::from_millis(1));
    }
    let left = core.gate.counts_now().total;
    if left == 0 {
        report_pages_left_counted_in(&volumes);
    }
    if ending == (Ending::Restart { dump: false }) {
        tracing::info!(
            left,
            drained_ms = started.elapsed().as_millis() as u64,
            "restart: no dump, systemd's fd store holds the LUN memory"
        );
        if left > 0 {
            tracing::warn!(
                left,
                "connections still open after the restart drain ({drain:?}): the exec closes them,                  and their hosts may miss the notice to come back (they reconnect after their own                  timeouts); --restart-drain-ms sets the bound"
            );
        }
        return Ok(format!("{} LUNs fenced, not dumped", volumes.len()));
    }
    if left > 0 {
        tracing::warn!(left, "connections still open after {CONNECTION_DRAIN:?}; dumping anyway (nothing is acknowledged after the fence) and verifying each image, since data may still be arriving");
    }
    dump_each(volumes, left > 0)
}

/// Once every connection is gone no write is under way, so no page may be
/// counted in (`--verify-kept-memory`): one that is would never be checked
/// again. A defect if it happens: the test harness fails a test whose
/// daemon logs this line at its stop (`TargetProcess::stop`).
fn report_pages_left_counted_in(volumes: &[&Arc<Volume>]) {
    for v in volumes {
        let pages = v.pages_being_written();
        if pages > 0 {
            tracing::error!(
                target = %v.target(),
                lun = v.lun(),
                pages,
                "pages still counted in after every connection ended: their checksums are not kept (a defect)"
            );
        }
    }
}

/// A stop during start-up, once the start-up is through: every volume
/// fenced (none served yet) and dumped where it must be (memory taken over
/// from a previous run may be the only copy; a LUN whose restore the stop
/// cut short is NOT READY, its image untouched).
pub fn stop_in_start_up(volumes: &Volumes) -> Result<String, String> {
    for v in volumes.iter() {
        v.fence();
    }
    dump_each(volumes.iter(), false)
}

/// Dump each fenced volume; a summary, or the failures.
fn dump_each<'a>(
    volumes: impl IntoIterator<Item = &'a Arc<Volume>>,
    verify: bool,
) -> Result<String, String> {
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for v in volumes {
        match v.dump(verify) {
            Ok(msg) => done.push(msg),
            Err(msg) => {
                tracing::error!(target = %v.target(), lun = v.lun(), "{msg}");
                failed.push(msg);
            }
        }
    }
    if failed.is_empty() {
        Ok(done.join("; "))
    } else {
        Err(failed.join("; "))
    }
}
