//! A connection's receive or send slots: a few while it logs in, the full
//! ring once its normal session begins.
//!
//! Anyone who reaches the portal can open an iSER connection, and every
//! slot of it is registered (pinned) memory, so what a connection nobody
//! authenticated can pin is kept small: a login, a discovery session and
//! the pings of either exchange one PDU at a time. Slot numbers below
//! `login_slots` name the small buffer and the rest the full one; once the
//! full ring exists, small slots that come back are retired, and the small
//! buffer stays registered until the queue pair that may still name it is
//! gone.

use std::ops::Range;
use std::sync::Arc;

use ramslog_common::verbs::{self, Access, ProtectionDomain, RegisteredBuffer};

pub(super) struct SlotRing {
    slot_len: usize,
    login_slots: usize,
    login: RegisteredBuffer,
    full: Option<RegisteredBuffer>,
}

impl SlotRing {
    /// The login slots alone.
    pub(super) fn new(
        pd: &Arc<ProtectionDomain>,
        slot_len: usize,
        login_slots: usize,
    ) -> Result<SlotRing, verbs::Error> {
        Ok(SlotRing {
            slot_len,
            login_slots,
            login: RegisteredBuffer::new(pd, login_slots * slot_len, Access::LOCAL_WRITE)?,
            full: None,
        })
    }

    /// The slot numbers of the login buffer.
    pub(super) fn login_range(&self) -> Range<u32> {
        0..self.login_slots as u32
    }

    pub(super) fn is_full(&self) -> bool {
        self.full.is_some()
    }

    /// Register the full ring of `slots` and return its slot numbers; the
    /// login slots retire as they come back.
    pub(super) fn grow(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        slots: usize,
    ) -> Result<Range<u32>, verbs::Error> {
        self.full = Some(RegisteredBuffer::new(
            pd,
            slots * self.slot_len,
            Access::LOCAL_WRITE,
        )?);
        let first = self.login_slots as u32;
        Ok(first..first + slots as u32)
    }

    /// A login slot that came back after the full ring was registered: it
    /// is not used again.
    pub(super) fn is_retired(&self, slot: u32) -> bool {
        self.full.is_some() && (slot as usize) < self.login_slots
    }

    /// The buffer holding `slot` and the slot's offset in it.
    fn locate(&self, slot: u32) -> Option<(&RegisteredBuffer, usize)> {
        let slot = slot as usize;
        if slot < self.login_slots {
            Some((&self.login, slot * self.slot_len))
        } else {
            let full = self.full.as_ref()?;
            Some((full, (slot - self.login_slots) * self.slot_len))
        }
    }

    /// The first `len` bytes of `slot` (at most the slot).
    pub(super) fn bytes(&self, slot: u32, len: usize) -> Option<&[u8]> {
        let (buf, start) = self.locate(slot)?;
        buf.bytes(start..start + len.min(self.slot_len))
    }

    /// The whole of `slot`, for writing.
    pub(super) fn slot_mut(&mut self, slot: u32) -> Option<&mut [u8]> {
        let slot_len = self.slot_len;
        let index = slot as usize;
        let (buf, start) = if index < self.login_slots {
            (&mut self.login, index * slot_len)
        } else {
            let full = self.full.as_mut()?;
            (full, (index - self.login_slots) * slot_len)
        };
        buf.bytes_mut(start..start + slot_len)
    }

    /// A scatter entry for the first `len` bytes of `slot`.
    pub(super) fn sge(&self, slot: u32, len: usize) -> Option<verbs::Sge> {
        if len > self.slot_len {
            return None;
        }
        let (buf, start) = self.locate(slot)?;
        buf.sge(start, len as u32)
    }
}
