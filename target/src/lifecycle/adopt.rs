//! Kept memory at start-up: whether the LUN memory a previous run left in
//! systemd's fd store (or handed over) may be served, the writers it waits
//! for, and memory no configured LUN claims.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crate::handover::KeptVolume;
use crate::store::Store;
use crate::systemd;
use crate::volume::image;
use crate::volume::kept::{self, KeptState, RecordArea, MEMORY_PREFIX, RECORD_PREFIX};
use crate::volume::state::Recall;
use crate::volume::{now_unix, CHUNK_SIZE};
use crate::volume::{KeptFrom, Persistence, Readiness, Restored, Volume, VolumeConfig};

use super::take_over::{self, Unkept};

/// Where kept LUN memory came from; it decides what proves the memory's
/// last writer gone.
#[derive(Debug)]
pub(super) enum Source {
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
    pub(super) source: Source,
    volumes: Vec<KeptVolume>,
    /// Why none of it may be served, whatever the records say.
    refused: Option<String>,
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
    pub(super) fn read_again_under_the_lock(&mut self) {
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
            } else if name == systemd::WRITER_NAME {
                writers.push(fd);
            } else {
                tracing::warn!(
                    "the fd store passed a descriptor named {name:?}, which this daemon never stores: closed"
                );
                let _ = systemd::remove(&name);
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
            let _ = systemd::remove(&format!("{RECORD_PREFIX}{naa}"));
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
    pub(super) fn claim(
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
        systemd::remove(&format!("{prefix}{naa}"))
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
pub(super) fn forget_stored_naa(naa: &str) {
    for prefix in [MEMORY_PREFIX, RECORD_PREFIX] {
        if let Err(e) = systemd::remove(&format!("{prefix}{naa}")) {
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
pub(super) fn writers_gone(pidfds: &[OwnedFd]) -> Result<(), String> {
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
pub(super) fn living_writers(source: &Source, owner: kept::Owner) -> Vec<OwnedFd> {
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
    let Some(path) = systemd::service_cgroup() else {
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
pub(super) fn adopt_kept(
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
