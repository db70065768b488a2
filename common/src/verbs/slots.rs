//! Registered memory cut into equal slots, each either Rust's or lent to the
//! adapter, never both.
//!
//! A [`Slot`] is the right to one slot's bytes. Posting a request on a slot
//! takes the `Slot` (the memory is the adapter's until the request ends),
//! and only that request's completion gives it back, through
//! [`SlotBuffer::reclaim`]. So the bytes of a receive are read only after
//! the adapter wrote them, and the bytes of a send are written only while
//! the adapter does not read them; the borrow checker keeps the rest:
//!
//! ```
//! # use ramslog_common::verbs::{CmId, SlotBuffer, WorkCompletion};
//! fn answer(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) {
//!     let Some(slot) = buf.reclaim(wc) else { return };
//!     let first = buf.bytes(&slot, 1).map(|b| b[0]);
//!     // ... the bytes are read; now the slot goes back to the adapter.
//!     let _ = (first, buf.post_recv(id, &mut vec![slot]));
//! }
//! ```
//!
//! ```compile_fail,E0505
//! # use ramslog_common::verbs::{CmId, SlotBuffer, WorkCompletion};
//! // Bytes held while the slot is handed to the adapter: refused.
//! fn early(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) -> u8 {
//!     let slot = buf.reclaim(wc).unwrap();
//!     let bytes = buf.bytes(&slot, 1).unwrap();
//!     let _ = buf.post_recv(id, &mut vec![slot]);
//!     bytes[0]
//! }
//! ```
//!
//! ```compile_fail,E0382
//! # use ramslog_common::verbs::{CmId, SlotBuffer, WorkCompletion};
//! // A slot used after it was lent: refused.
//! fn late(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) {
//!     let slot = buf.reclaim(wc).unwrap();
//!     let _ = buf.post_recv(id, &mut vec![slot]);
//!     let _ = buf.bytes(&slot, 1);
//! }
//! ```
//!
//! ```compile_fail,E0277
//! # use ramslog_common::verbs::Slot;
//! // Two rights to the same bytes: there is no way to make one.
//! fn twice(s: &Slot) -> Slot {
//!     Slot::clone(s)
//! }
//! ```
//!
//! What keeps this sound beyond the borrow checker: a slot's registration
//! allows local access only (no peer can write it); its scatter entry never
//! leaves this module; the ids of its requests carry the buffer's number
//! (never reused in the process) and the slot, in bits no other poster may
//! set ([`CmId::post_send`] and [`CmId::post_recv`] refuse them); and only
//! [`CompletionQueue::poll`](super::CompletionQueue::poll) makes a
//! completion that can give a slot back, once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::ib::{LENT_BUFFER_MAX, LENT_BUFFER_SHIFT, LENT_KIND_MAX, LENT_SLOT_MAX};
use super::{
    Access, CmId, Error, PostError, ProtectionDomain, RecvWr, RegisteredBuffer, Result, SendOp,
    SendWr, Sge, WorkCompletion, WrId,
};

/// Numbers of buffers made in this process so far: each gets its own, for
/// good, so a completion can never be taken for another buffer's.
static BUFFERS: AtomicU64 = AtomicU64::new(0);

/// Receives posted per call into the provider, built on the stack.
const RECV_BATCH: usize = 32;

/// The right to one slot's bytes. Neither `Clone` nor `Copy`: while it
/// exists, the adapter has no request on the slot.
#[derive(Debug)]
pub struct Slot {
    buffer: u64,
    index: u32,
}

impl Slot {
    /// The slot's number in its buffer.
    pub fn index(&self) -> u32 {
        self.index
    }
}

/// Equal slots of registered memory (local access only), each Rust's or
/// the adapter's. See the module documentation.
pub struct SlotBuffer {
    mem: RegisteredBuffer,
    slot_len: usize,
    slots: u32,
    number: u64,
    kind: u32,
    /// Which slots the adapter has (a request posted, its completion not
    /// yet reclaimed).
    lent: Vec<bool>,
}

impl SlotBuffer {
    /// `slots` slots of `slot_len` bytes, registered with `pd`, and the
    /// right to each. Requests on them complete with `WrId::kind == kind`
    /// (below 128) and `WrId::slot` their slot's number.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        kind: u32,
        slot_len: usize,
        slots: u32,
    ) -> Result<(SlotBuffer, Vec<Slot>)> {
        const OP: &str = "slot buffer";
        let len = slot_len
            .checked_mul(slots as usize)
            .filter(|_| kind <= LENT_KIND_MAX && slots > 0 && slots - 1 <= LENT_SLOT_MAX)
            .filter(|_| u32::try_from(slot_len).is_ok())
            .ok_or_else(|| Error::from_errno(OP, libc::EINVAL))?;
        let number = BUFFERS.fetch_add(1, Ordering::Relaxed) + 1;
        if number > LENT_BUFFER_MAX {
            // 2^40 buffers in one process: refuse rather than reuse a number.
            return Err(Error::from_errno(OP, libc::ENOSPC));
        }
        let mem = RegisteredBuffer::new(pd, len, Access::LOCAL_WRITE)?;
        let rights = (0..slots)
            .map(|index| Slot {
                buffer: number,
                index,
            })
            .collect();
        Ok((
            SlotBuffer {
                mem,
                slot_len,
                slots,
                number,
                kind,
                lent: vec![false; slots as usize],
            },
            rights,
        ))
    }

    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// How many slots the buffer has.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Whether `slot` is one of this buffer's.
    pub fn holds(&self, slot: &Slot) -> bool {
        slot.buffer == self.number
    }

    /// Where `len` bytes of `slot` start, if it is ours and they fit.
    fn start(&self, slot: &Slot, len: usize) -> Option<usize> {
        (self.holds(slot) && slot.index < self.slots && len <= self.slot_len)
            .then(|| slot.index as usize * self.slot_len)
    }

    /// The first `len` bytes of `slot` (`None`: not ours, or longer than a
    /// slot).
    pub fn bytes<'a>(&'a self, slot: &'a Slot, len: usize) -> Option<&'a [u8]> {
        let start = self.start(slot, len)?;
        // SAFETY: [start, start + len) lies inside the mapping (start() checked
        // index < slots and len <= slot_len), zero-filled at creation. The
        // adapter has no request on it: `slot` exists, so it was never lent
        // or came back through reclaim with its request's completion; no peer
        // can write it (local access only); and no &mut to it exists, since
        // those borrow the Slot mutably.
        Some(unsafe { std::slice::from_raw_parts(self.mem.as_ptr().add(start), len) })
    }

    /// The first `len` bytes of `slot`, for writing.
    pub fn bytes_mut<'a>(&'a self, slot: &'a mut Slot, len: usize) -> Option<&'a mut [u8]> {
        let start = self.start(slot, len)?;
        // SAFETY: as in `bytes`; the Slot is borrowed mutably for as long as
        // the slice lives, so no other reference to these bytes exists (each
        // slot has exactly one Slot).
        Some(unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr().add(start), len) })
    }

    /// The request id and entry for the first `len` bytes of `slot`. The
    /// slot is lent ([`Self::lent_out`]) once its request is posted.
    fn entry(&self, slot: &Slot, len: usize) -> Option<(WrId, Sge<'_>)> {
        let start = self.start(slot, len)?;
        let sge = self.mem.sge(start, len as u32)?;
        Some((WrId::lent(self.kind, self.number, slot.index), sge))
    }

    /// The adapter has `slots` now: their requests were posted.
    fn lent_out(&mut self, slots: &[Slot]) {
        for s in slots {
            if let Some(l) = self.lent.get_mut(s.index as usize) {
                *l = true;
            }
        }
    }

    /// Post a receive into each of `slots` (whole slots), in order, and
    /// empty it (its capacity stays, for the next batch). On failure, the
    /// slots not posted stay in `slots`, still Rust's.
    pub fn post_recv(&mut self, id: &CmId, slots: &mut Vec<Slot>) -> Result<()> {
        let mut done = 0;
        while done < slots.len() {
            let n = (slots.len() - done).min(RECV_BATCH);
            let mut wrs = [RecvWr {
                wr_id: WrId::default(),
                sge: Sge::default(),
            }; RECV_BATCH];
            for i in 0..n {
                let Some((wr_id, sge)) = self.entry(&slots[done + i], self.slot_len) else {
                    slots.drain(..done);
                    return Err(Error::from_errno("ibv_post_recv", libc::EINVAL));
                };
                wrs[i] = RecvWr { wr_id, sge };
            }
            let posted = id.post_recv_lent(&wrs[..n]);
            if let Err(PostError { posted, error }) = posted {
                self.lent_out(&slots[done..done + posted]);
                slots.drain(..done + posted);
                return Err(error);
            }
            self.lent_out(&slots[done..done + n]);
            done += n;
        }
        slots.clear();
        Ok(())
    }

    /// Post `op` (a SEND or RDMA WRITE from, or an RDMA READ into, the first
    /// `len` bytes of `slot`), signaled: its completion gives the slot back.
    pub fn post_send(
        &mut self,
        id: &CmId,
        slot: Slot,
        len: usize,
        op: SendOp,
    ) -> std::result::Result<(), SendFailed> {
        let Some((wr_id, sge)) = self.entry(&slot, len) else {
            return Err(SendFailed {
                slot,
                error: Error::from_errno("ibv_post_send", libc::EINVAL),
            });
        };
        let wr = SendWr {
            wr_id,
            op,
            sge,
            signaled: true,
            inline: false,
        };
        match id.post_send_lent(std::slice::from_ref(&wr)) {
            Ok(()) => {
                self.lent_out(std::slice::from_ref(&slot));
                Ok(())
            }
            Err(e) => Err(SendFailed {
                slot,
                error: e.error,
            }),
        }
    }

    /// The slot `wc` completed, if it is one of this buffer's: the request
    /// on it has ended (successfully or not), so its bytes are Rust's again.
    /// `None` for another buffer's or another poster's completion, and for
    /// one already reclaimed.
    pub fn reclaim(&mut self, wc: &mut WorkCompletion) -> Option<Slot> {
        let raw = wc.lent;
        if raw == 0 || (raw >> LENT_BUFFER_SHIFT) & LENT_BUFFER_MAX != self.number {
            return None;
        }
        let index = (raw as u32) & LENT_SLOT_MAX;
        let lent = self.lent.get_mut(index as usize)?;
        if !*lent {
            return None;
        }
        *lent = false;
        wc.lent = 0;
        Some(Slot {
            buffer: self.number,
            index,
        })
    }
}

impl std::fmt::Debug for SlotBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotBuffer")
            .field("number", &self.number)
            .field("slots", &self.slots)
            .field("slot_len", &self.slot_len)
            .finish()
    }
}

/// A send-queue request that could not be posted: its slot, still Rust's.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct SendFailed {
    pub slot: Slot,
    pub error: Error,
}
