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
//!
//! Each slot is Rust's or the adapter's (`verbs::SlotBuffer`): its bytes
//! are reachable only through the `Slot` a completion gave back.

use std::sync::Arc;

use ramslog_common::verbs::{
    self, CmId, ProtectionDomain, SendOp, Slot, SlotBuffer, WorkCompletion,
};

pub(super) struct SlotRing {
    kind: u32,
    slot_len: usize,
    login: SlotBuffer,
    full: Option<SlotBuffer>,
    /// Receive slots waiting to be posted again, per buffer (login, full).
    reposts: [Vec<Slot>; 2],
}

impl SlotRing {
    /// The login slots alone, and the right to each. Requests on the ring
    /// complete with `WrId::kind == kind`.
    pub(super) fn new(
        pd: &Arc<ProtectionDomain>,
        kind: u32,
        slot_len: usize,
        login_slots: u32,
    ) -> Result<(SlotRing, Vec<Slot>), verbs::Error> {
        let (login, rights) = SlotBuffer::new(pd, kind, slot_len, login_slots)?;
        let ring = SlotRing {
            kind,
            slot_len,
            login,
            full: None,
            reposts: [Vec::with_capacity(login_slots as usize), Vec::new()],
        };
        Ok((ring, rights))
    }

    pub(super) fn is_full(&self) -> bool {
        self.full.is_some()
    }

    /// Register the full ring of `slots` and return the right to each; the
    /// login slots retire as they come back.
    pub(super) fn grow(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        slots: u32,
    ) -> Result<Vec<Slot>, verbs::Error> {
        let (full, rights) = SlotBuffer::new(pd, self.kind, self.slot_len, slots)?;
        self.full = Some(full);
        self.reposts[1] = Vec::with_capacity(slots as usize);
        Ok(rights)
    }

    /// The slot `wc` completed, if it is this ring's. A login slot that
    /// comes back after the full ring was registered still holds what it
    /// received, but is retired: `repost` and `is_retired` know.
    pub(super) fn reclaim(&mut self, wc: &mut WorkCompletion) -> Option<Slot> {
        if let Some(slot) = self.full.as_mut().and_then(|f| f.reclaim(wc)) {
            return Some(slot);
        }
        self.login.reclaim(wc)
    }

    /// A login slot once the full ring exists: not used again.
    pub(super) fn is_retired(&self, slot: &Slot) -> bool {
        self.is_full() && self.login.holds(slot)
    }

    fn buffer_of(&self, slot: &Slot) -> Option<&SlotBuffer> {
        if self.login.holds(slot) {
            return Some(&self.login);
        }
        self.full.as_ref().filter(|f| f.holds(slot))
    }

    /// The first `len` bytes of `slot` (at most the slot).
    pub(super) fn bytes<'a>(&'a self, slot: &'a Slot, len: usize) -> Option<&'a [u8]> {
        self.buffer_of(slot)?.bytes(slot, len.min(self.slot_len))
    }

    /// The whole of `slot`, for writing.
    pub(super) fn slot_mut<'a>(&'a self, slot: &'a mut Slot) -> Option<&'a mut [u8]> {
        let len = self.slot_len;
        self.buffer_of(slot)?.bytes_mut(slot, len)
    }

    /// Queue `slot` to be posted as a receive again at the next `flush`
    /// (a retired login slot is dropped instead).
    pub(super) fn repost(&mut self, slot: Slot) {
        if self.is_retired(&slot) {
            return;
        }
        let i = usize::from(!self.login.holds(&slot));
        self.reposts[i].push(slot);
    }

    /// Receive slots queued by `repost`.
    pub(super) fn queued(&self) -> usize {
        self.reposts[0].len() + self.reposts[1].len()
    }

    /// Post every queued receive, and `more` (whole slots). Login slots
    /// queued before the full ring came retire here.
    pub(super) fn flush(&mut self, id: &CmId, more: Vec<Slot>) -> Result<(), verbs::Error> {
        for slot in more {
            self.repost(slot);
        }
        if self.is_full() {
            self.reposts[0].clear();
        }
        self.login.post_recv(id, &mut self.reposts[0])?;
        if let Some(full) = self.full.as_mut() {
            full.post_recv(id, &mut self.reposts[1])?;
        }
        Ok(())
    }

    /// Post `op` on the first `len` bytes of `slot`; on failure the slot is
    /// dropped with the error (the connection ends).
    pub(super) fn post_send(
        &mut self,
        id: &CmId,
        slot: Slot,
        len: usize,
        op: SendOp,
    ) -> Result<(), verbs::Error> {
        let buffer = if self.login.holds(&slot) {
            &mut self.login
        } else {
            match self.full.as_mut() {
                Some(f) => f,
                None => return Err(verbs::Error::from_errno("ibv_post_send", libc::EINVAL)),
            }
        };
        buffer.post_send(id, slot, len, op).map_err(|e| e.error)
    }
}
