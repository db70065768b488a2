//! The kept-memory record of a volume kept current beside its memory:
//! what it is (identity, generation, readiness), the reservations and
//! served-identity digest recorded with it, the hand-over to a new program,
//! and the page checksums.

use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;

use super::{
    kept, naa_hex, pages, HandOverError, Meta, Readiness, Volume, VolumeError, CHUNK_SIZE,
};
use kept::{KeptRecord, KeptReservations, KeptState, RecordArea, Written};

impl Volume {
    /// Write the kept-memory record from `m` (its lock held, so records are
    /// written in the order of the changes they describe).
    pub(super) fn write_record(&self, m: &Meta) {
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
    pub(super) fn set_kept(&self, m: &mut Meta, state: KeptState) {
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
    pub(super) fn pages(&self) -> Option<pages::PageCrcs<'_>> {
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
}
