//! Images of a volume: the dump at shutdown (verified where connections
//! outlived the drain) and the empty image accept-empty writes.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use super::{image, kept, Identity, Persistence, Readiness, Volume};
use kept::KeptReservations;

impl Volume {
    pub(super) fn imaging(&self) -> MutexGuard<'_, ()> {
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

    pub(super) fn empty_image(&self, p: &Persistence) -> Result<String, String> {
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
    pub(super) fn write_image(
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
}
