//! Start and stop of the daemon's volumes: verified restore before the
//! portal listens, fence and dump on the way out (docs/persistence.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::portal::Portal;
use crate::private_dir;
use crate::store::Store;
use crate::volume::image::{self, ImageError, ImageIdentity};
use crate::volume::naa_hex;
use crate::volume::state::{Recall, StateDir};
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

/// Open the state directory (locked for the daemon's lifetime) and the
/// image directory.
pub fn open_persistence(cfg: &Config) -> Result<Option<Arc<Persistence>>, String> {
    let (Some(state_dir), Some(image_dir)) = (&cfg.state_dir, &cfg.image_dir) else {
        return Ok(None);
    };
    let state = StateDir::open(state_dir).map_err(|e| e.to_string())?;
    private_dir::prepare(image_dir, "image directory").map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(Persistence::new(state, image_dir.clone()))))
}

/// Build one target's volumes: map and lock the memory, recall each
/// identity and restore its image where one is trusted.
pub fn open_volumes(
    cfg: &Config,
    persistence: Option<&Arc<Persistence>>,
    cancelled: &AtomicBool,
) -> Result<Volumes, StartError> {
    let mut volumes = Vec::new();
    for t in &cfg.targets {
        for l in &t.luns {
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
