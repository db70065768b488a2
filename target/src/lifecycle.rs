//! Start and stop of the daemon's volumes: verified restore before the
//! portal listens, fence and dump on the way out (docs/persistence.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::OwnedFd;

use crate::config::Config;
use crate::handover::KeptVolume;
use crate::portal::Portal;
use crate::private_dir;
use crate::store::Store;
use crate::volume::image::{self, ImageError, ImageIdentity};
use crate::volume::kept::{self, KeptState};
use crate::volume::state::{Recall, StateDir};
use crate::volume::{naa_hex, now_unix, CHUNK_SIZE};
use crate::volume::{Identity, Persistence, Readiness, Restored, Volume, VolumeConfig, Volumes};

/// How long shutdown waits for connections to end before it dumps anyway
/// (the volumes are fenced either way: nothing more is acknowledged).
pub const CONNECTION_DRAIN: Duration = Duration::from_secs(10);

/// Why start-up stopped.
#[derive(Debug)]
pub enum StartError {
    /// A stop was asked for during the restore: exit, the images are intact.
    Cancelled,
    Failed(String),
}

impl From<String> for StartError {
    fn from(s: String) -> Self {
        StartError::Failed(s)
    }
}

/// Open the state directory (locked for the daemon's lifetime, through
/// `inherited_lock` after a planned restart) and the image directory.
pub fn open_persistence(
    cfg: &Config,
    inherited_lock: Option<OwnedFd>,
) -> Result<Option<Arc<Persistence>>, String> {
    let (Some(state_dir), Some(image_dir)) = (&cfg.state_dir, &cfg.image_dir) else {
        return Ok(None);
    };
    let state = StateDir::open_with(state_dir, inherited_lock).map_err(|e| e.to_string())?;
    private_dir::prepare(image_dir, "image directory").map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(Persistence::new(state, image_dir.clone()))))
}

/// The LUN memory a planned restart handed over, until each configured
/// LUN has claimed its own.
#[derive(Debug)]
pub struct Handover {
    token: u64,
    volumes: Vec<KeptVolume>,
    /// Why none of it may be served, whatever the records say.
    refused: Option<String>,
}

impl Handover {
    pub fn new(token: u64, volumes: Vec<KeptVolume>, rdma_descriptors: Vec<String>) -> Handover {
        let refused = (!rdma_descriptors.is_empty()).then(|| {
            format!(
                "this process holds RDMA device descriptors ({}) that outlived the exec, so the \
                 old queue pairs may still write",
                rdma_descriptors.join(", ")
            )
        });
        Handover {
            token,
            volumes,
            refused,
        }
    }

    /// The kept memory whose record names `target` LUN `lun`; two that do
    /// are both refused (never pick one).
    fn claim(
        &mut self,
        target: &str,
        lun: u64,
    ) -> Option<Result<(KeptVolume, kept::KeptRecord), String>> {
        let names = |k: &KeptVolume| {
            k.record
                .as_ref()
                .is_ok_and(|c| c.record.target == target && c.record.lun == lun)
        };
        let mut mine: Vec<KeptVolume> = Vec::new();
        let mut i = 0;
        while i < self.volumes.len() {
            if names(&self.volumes[i]) {
                mine.push(self.volumes.swap_remove(i));
            } else {
                i += 1;
            }
        }
        let k = match mine.len() {
            0 => return None,
            1 => mine.pop()?,
            n => return Some(Err(format!("{n} kept memories name this LUN"))),
        };
        if let Some(why) = &self.refused {
            return Some(Err(why.clone()));
        }
        let record = match &k.record {
            Ok(c) => c.record.clone(),
            Err(e) => return Some(Err(e.to_string())),
        };
        Some(Ok((k, record)))
    }

    /// Release what no configured LUN claimed, saying so.
    pub fn release_rest(self) {
        for k in self.volumes {
            match &k.record {
                Ok(c) => tracing::warn!(
                    target = %c.record.target, lun = c.record.lun,
                    "kept memory handed over for a LUN the configuration no longer has: released"
                ),
                Err(e) => tracing::warn!(
                    "kept memory handed over with an unreadable record ({e}): released"
                ),
            }
        }
    }
}

/// The volume over memory a planned restart handed over, if every rule
/// holds: the record says this very handover left it (same token, same
/// process before the exec, this boot), for this identity and generation
/// of the state directory, this size and block size, no bump under way.
fn adopt_kept(
    p: &Arc<Persistence>,
    token: u64,
    (k, r): (KeptVolume, kept::KeptRecord),
    target: &str,
    lun: u64,
    size: u64,
    block_size: u32,
) -> Result<Volume, String> {
    match &r.state {
        KeptState::HandedOver {
            token: t,
            ready: true,
        } if *t == token => {}
        other => {
            return Err(format!(
                "its record says {other:?}, not handed over by this restart"
            ))
        }
    }
    // Only a LUN the state knows: recalling an unknown one would give it a
    // new identity.
    let recalled = {
        let mut state = p.state();
        match state.generation(target, lun) {
            Some(_) => state.recall(target, lun).ok(),
            None => None,
        }
    };
    let Some(Recall::Known {
        identity,
        generation,
        ..
    }) = recalled
    else {
        return Err("the state directory does not know this LUN".into());
    };
    if r.naa != naa_hex(&identity.naa) || r.serial != identity.serial {
        return Err(format!(
            "it holds naa.{}, the state directory names naa.{}",
            r.naa,
            naa_hex(&identity.naa)
        ));
    }
    if (r.lun_bytes, r.block_size) != (size, block_size) {
        return Err(format!(
            "it holds {} bytes of {}-byte blocks, the configuration {size} of {block_size}",
            r.lun_bytes, r.block_size
        ));
    }
    if r.generation != generation || r.pending_generation.is_some() {
        return Err(format!(
            "it is generation {} (pending {:?}), the state directory's is {generation}",
            r.generation, r.pending_generation
        ));
    }
    if r.boot_id != kept::boot_id() {
        return Err("it was written before this boot".into());
    }
    let me = kept::this_process();
    if (r.owner.pid, r.owner.start_time) != (me.pid, me.start_time) {
        return Err(format!(
            "its writer was process {}, not this one",
            r.owner.pid
        ));
    }
    let chunks = r
        .written
        .chunks(CHUNK_SIZE, size.div_ceil(CHUNK_SIZE))
        .ok_or("its list of written chunks does not fit this LUN")?;
    let store = Arc::new(Store::adopt(k.memory, size, r.memfd_bytes).map_err(|e| e.to_string())?);
    if let Err(e) = image::remove_images(&p.image_dir, &identity.naa, Some(generation)) {
        tracing::warn!(target, lun, "cannot tidy the image directory: {e}");
    }
    let image = p
        .image_dir
        .join(image::image_name(&identity.naa, generation));
    let volume = Volume::new(
        VolumeConfig {
            target: target.into(),
            lun,
            block_size,
            identity,
            readiness: Readiness::NeedsAcceptance,
        },
        store,
        Some(p.clone()),
        generation,
    );
    volume.set_restored(
        Restored {
            image,
            kept_memory: true,
            taken_unix: now_unix(),
            generation,
        },
        chunks,
    );
    Ok(volume)
}

/// Build one target's volumes: map and lock the memory (or take the
/// memory a planned restart handed over), recall each identity and restore
/// its image where one is trusted.
pub fn open_volumes(
    cfg: &Config,
    persistence: Option<&Arc<Persistence>>,
    cancelled: &AtomicBool,
    mut handover: Option<Handover>,
) -> Result<Volumes, StartError> {
    let mut volumes = Vec::new();
    for t in &cfg.targets {
        for l in &t.luns {
            // Kept memory first: refused, it is freed before new memory is taken.
            match (
                persistence,
                handover
                    .as_mut()
                    .and_then(|h| Some((h.token, h.claim(&t.name, l.lun)?))),
            ) {
                (Some(p), Some((token, Ok(kept)))) => {
                    match adopt_kept(p, token, kept, &t.name, l.lun, l.size, l.block_size) {
                        Ok(volume) => {
                            tracing::info!(target = %t.name, lun = l.lun, generation = volume.generation(), "LUN content kept in memory across the restart (not read from the image)");
                            volumes.push(volume);
                            continue;
                        }
                        Err(why) => {
                            tracing::warn!(target = %t.name, lun = l.lun, "kept memory not used: {why}; the content comes from the image")
                        }
                    }
                }
                (_, Some((_, Err(why)))) => {
                    tracing::warn!(target = %t.name, lun = l.lun, "kept memory not used: {why}; the content comes from the image")
                }
                (None, Some(_)) => {
                    tracing::warn!(target = %t.name, lun = l.lun, "kept memory not used: without a state directory nothing is kept")
                }
                (_, None) => {}
            }
            let store = Store::named(
                &format!("ramslog {} LUN {}", t.name, l.lun),
                l.size,
                cfg.hugepages,
            )
            .map_err(|e| format!("target {} LUN {}: {e}", t.name, l.lun))?;
            tracing::info!(target = %t.name, lun = l.lun, size = l.size, "LUN memory locked in RAM ({})", store.page_kind());
            let store = Arc::new(store);
            let volume = match persistence {
                None => Volume::in_memory(
                    VolumeConfig {
                        target: t.name.clone(),
                        lun: l.lun,
                        block_size: l.block_size,
                        identity: Identity::generate(),
                        readiness: Readiness::Ready,
                    },
                    store,
                ),
                Some(p) => recall(p, &t.name, l.lun, l.block_size, store, cancelled)?,
            };
            volumes.push(volume);
        }
    }
    if let Some(h) = handover {
        h.release_rest();
    }
    Ok(Volumes::new(volumes))
}

fn recall(
    p: &Arc<Persistence>,
    target: &str,
    lun: u64,
    block_size: u32,
    store: Arc<Store>,
    cancelled: &AtomicBool,
) -> Result<Volume, StartError> {
    let recalled = p.state().recall(target, lun).map_err(|e| e.to_string())?;
    let cfg = |identity, readiness| VolumeConfig {
        target: target.into(),
        lun,
        block_size,
        identity,
        readiness,
    };
    let (identity, generation, clean) = match recalled {
        Recall::New(id) => {
            tracing::info!(target, lun, naa = %naa_hex(&id.naa), serial = %id.serial, "new LUN identity");
            let generation = p.state().generation(target, lun).unwrap_or(0);
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
    let refuse = |volume: Volume, reason: String| {
        tracing::warn!(
            target, lun, naa = %naa_hex(&identity.naa), generation,
            "LUN content not restored: {reason}. It answers NOT READY (manual intervention \
             required) until `ramslog-target accept-empty {target} {lun}`"
        );
        volume.set_not_ready(reason);
        volume
    };
    let volume = Volume::new(
        cfg(identity.clone(), Readiness::NeedsAcceptance),
        store.clone(),
        Some(p.clone()),
        generation,
    );
    if !clean {
        return Ok(refuse(
            volume,
            format!(
                "generation {generation} has no clean image (the daemon was killed, crashed or lost power without a clean stop)"
            ),
        ));
    }
    if !path.exists() {
        return Ok(refuse(
            volume,
            format!(
                "the image of generation {generation}, {}, is missing",
                path.display()
            ),
        ));
    }
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
            tracing::info!(
                target,
                lun,
                generation,
                chunks = r.chunks.len(),
                "LUN content restored and verified: {} bytes in {:.2} s ({:.0} MiB/s)",
                r.bytes,
                r.seconds,
                r.bytes as f64 / r.seconds.max(1e-9) / (1 << 20) as f64
            );
            volume.set_restored(
                Restored {
                    image: r.path.clone(),
                    kept_memory: false,
                    taken_unix: r.taken_unix,
                    generation,
                },
                r.chunks.iter().copied(),
            );
            Ok(volume)
        }
        Err(ImageError::Cancelled) => Err(StartError::Cancelled),
        Err(e) => Ok(refuse(
            volume,
            format!("image {} refused: {e}", path.display()),
        )),
    }
}

/// Shut down: refuse new connections, end every connection, fence every
/// volume, wait (bounded) for connections to go, then dump what changed.
/// Returns a summary, or the failures.
pub fn shutdown(portal: &Portal) -> Result<String, String> {
    let told = portal.gate.close();
    portal.terminate_all();
    let volumes: Vec<&Arc<Volume>> = portal
        .targets
        .iter()
        .flat_map(|t| t.scsi.luns().map(|lu| lu.volume()))
        .collect();
    for v in &volumes {
        v.fence();
    }
    tracing::info!(
        connections = told,
        "shutting down: logins refused, connections closing, volumes fenced"
    );
    let started = Instant::now();
    while portal.gate.counts_now().total > 0 && started.elapsed() < CONNECTION_DRAIN {
        std::thread::sleep(Duration::from_millis(10));
    }
    let left = portal.gate.counts_now().total;
    if left > 0 {
        tracing::warn!(left, "connections still open after {CONNECTION_DRAIN:?}; dumping anyway (nothing is acknowledged after the fence) and verifying each image, since data may still be arriving");
    }
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for v in volumes {
        match v.dump(left > 0) {
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
