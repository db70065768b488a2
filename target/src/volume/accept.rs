//! accept-empty on a volume: a fresh identity and generation, zeroed
//! memory, the old identity's images deleted, in an order a crash cannot
//! turn into stale data under the new identity.

use std::sync::atomic::Ordering;

use crate::systemd;

use super::{image, kept, naa_hex, Identity, Readiness, Remedy, Volume};
use kept::KeptState;

impl Volume {
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
            match systemd::barrier(systemd::BARRIER_WAIT) {
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
}
