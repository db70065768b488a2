//! Start and stop of the daemon's volumes (docs/persistence.md): opening
//! them here, with a verified restore before any front end listens; whether
//! kept memory may be served in `adopt` (its rules in `take_over`); fence,
//! drain and dump on the way out in `stop`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::os::fd::OwnedFd;

use crate::config::Config;
use crate::private_dir;
use crate::store::{HugePages, Store, StoreError};
use crate::systemd;
use crate::volume::image::{self, ImageError, ImageIdentity};
use crate::volume::state::{Recall, StateDir};
use crate::volume::{naa_hex, Remedy};
use crate::volume::{Identity, Persistence, Readiness, Restored, Volume, VolumeConfig, Volumes};

mod adopt;
mod stop;
mod take_over;

use adopt::{adopt_kept, forget_stored_naa, living_writers, Source};
pub use adopt::{discard_unclaimed, KeptMemory, UnclaimedKept};
pub use stop::{shutdown, stop_in_start_up, Ending, CONNECTION_DRAIN};
use take_over::Unkept;

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
    if persistence.is_some() && systemd::has_holder() {
        // Every LUN's memory is claimed by now: this process is its writer.
        // systemd 254 and later say how many descriptors the store takes
        // (252 does not).
        let need = systemd::descriptors_to_take(volumes.len());
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
        match systemd::store_writer(writers_gone) {
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
