//! Completion channels, completion queues and work completions.

use super::*;

// ---------------------------------------------------------------- completion channel

/// A completion channel (`ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed CQ gets a completion. Share it with the CQs as an
/// `Arc` ([`CompletionQueue::new`] keeps a clone: a channel cannot be
/// destroyed while CQs use it).
pub struct CompletionChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    dev: Device,
}

// SAFETY: ibv_get_cq_event is a read(2) on the channel fd plus a lookup;
// it may run on any thread. The channel is destroyed once, in Drop.
unsafe impl Send for CompletionChannel {}
// SAFETY: see Send; concurrent consume_event calls are each a read(2).
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    pub fn new(dev: &Device) -> Result<CompletionChannel> {
        // SAFETY: the context is open (held by `dev`).
        let ch = unsafe { ffi::ibv_create_comp_channel(dev.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os_error("ibv_create_comp_channel"))?;
        Ok(CompletionChannel {
            ch,
            dev: dev.clone(),
        })
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive; `fd` is set at creation and constant.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_fd_nonblocking(self.fd(), on)
    }

    /// After poll(2) says the fd is readable: `ibv_get_cq_event` and
    /// `ibv_ack_cq_events(1)`. `Ok(None)` when there was no event
    /// (non-blocking and EAGAIN, or EINTR); blocks when the channel is
    /// blocking. Otherwise which CQ fired: its index in `cqs`, or
    /// `cqs.len()` for a CQ on this channel that `cqs` does not list (its
    /// event is acknowledged all the same).
    pub fn consume_event(&self, cqs: &[&CompletionQueue]) -> Result<Option<usize>> {
        let mut got: *mut ffi::ibv_cq = ptr::null_mut();
        let mut ctx: *mut libc::c_void = ptr::null_mut();
        // SAFETY: the channel is alive; both out-pointers are valid.
        let rc = unsafe { ffi::ibv_get_cq_event(self.ch.as_ptr(), &mut got, &mut ctx) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(None),
                _ => Err(Error::new("ibv_get_cq_event", e)),
            };
        }
        if got.is_null() {
            return Err(Error::from_errno("ibv_get_cq_event", libc::EIO));
        }
        let fired = cqs
            .iter()
            .position(|cq| cq.as_ptr() == got)
            .unwrap_or(cqs.len());
        // SAFETY: `got` is the CQ the event was reported for. A CQ with an
        // unacknowledged event cannot finish ibv_destroy_cq (libibverbs
        // waits for the ack), so it is alive here.
        unsafe { ffi::ibv_ack_cq_events(got, 1) };
        Ok(Some(fired))
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: we own the channel; no CQ uses it (each holds an Arc to
        // us). Errors are ignored.
        let _ = unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

// ---------------------------------------------------------------- CQ

/// Most completions [`CompletionQueue::poll`] asks the provider for at a
/// time (the size of its stack array of `ibv_wc`).
pub const MAX_POLL_BATCH: usize = 32;

/// A completion queue (`ibv_create_cq`), destroyed when the last `Arc` goes
/// (QPs using it hold one).
pub struct CompletionQueue {
    cq: NonNull<ffi::ibv_cq>,
    dev: Device,
    cqe: u32,
    _channel: Option<Arc<CompletionChannel>>,
}

// SAFETY: ibv_poll_cq / ibv_req_notify_cq are thread-safe in libibverbs
// providers (they lock the CQ); the CQ is destroyed once, in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send. (Concurrent pollers are memory-safe but split the
// completions between them; the user serialises polling.)
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A CQ with room for at least `cqe` completions, optionally reporting
    /// to `channel` (which must belong to the same device).
    pub fn new(
        dev: &Device,
        cqe: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let n = libc::c_int::try_from(cqe)
            .map_err(|_| Error::from_errno("ibv_create_cq", libc::EINVAL))?;
        let ch = match channel {
            Some(c) if c.dev != *dev => {
                return Err(Error::from_errno("ibv_create_cq", libc::EINVAL))
            }
            Some(c) => c.ch.as_ptr(),
            None => ptr::null_mut(),
        };
        // SAFETY: the context is open; `ch` is null or a live channel of the
        // same context, kept alive by the Arc stored below.
        let cq = unsafe { ffi::ibv_create_cq(dev.as_ptr(), n, ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq).ok_or_else(|| Error::last_os_error("ibv_create_cq"))?;
        // SAFETY: `cq` was just created; `cqe` holds the real size.
        let real = unsafe { cq.as_ref() }.cqe;
        Ok(Arc::new(CompletionQueue {
            cq,
            dev: dev.clone(),
            cqe: u32::try_from(real).unwrap_or(cqe),
            _channel: channel.cloned(),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The CQ's real capacity (at least what was asked for).
    pub fn capacity(&self) -> u32 {
        self.cqe
    }

    /// Arm the CQ: the next completion signals the completion channel
    /// (`ibv_req_notify_cq`, solicited_only = 0). Poll once more after
    /// arming, or a completion that raced the arming is missed.
    pub fn req_notify(&self) -> Result<()> {
        let cq = self.cq.as_ptr();
        // SAFETY: the CQ is alive; its context pointer is set by libibverbs
        // and valid while the CQ exists.
        let f = unsafe { (*(*cq).context).ops.req_notify_cq };
        let Some(f) = f else {
            return Err(Error::from_errno("ibv_req_notify_cq", libc::EOPNOTSUPP));
        };
        // SAFETY: the provider's own req_notify_cq on its own live CQ (what
        // the inline ibv_req_notify_cq does).
        let rc = unsafe { f(cq, 0) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Reap completions into `out`; returns how many were written. Asks the
    /// provider for up to [`MAX_POLL_BATCH`] at a time and keeps going until
    /// `out` is full or the CQ is empty, so a return value below
    /// `out.len()` means the CQ was drained. No allocation.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let cq = self.cq.as_ptr();
        // SAFETY: the CQ is alive; its context pointer is valid while it is.
        let f = unsafe { (*(*cq).context).ops.poll_cq };
        let Some(f) = f else {
            return Err(Error::from_errno("ibv_poll_cq", libc::EOPNOTSUPP));
        };
        let mut wcs = MaybeUninit::<[ffi::ibv_wc; MAX_POLL_BATCH]>::uninit();
        let base = wcs.as_mut_ptr().cast::<ffi::ibv_wc>();
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(MAX_POLL_BATCH);
            // want <= MAX_POLL_BATCH, so the cast cannot truncate.
            // SAFETY: the provider's own poll_cq on its live CQ, writing at
            // most `want` entries into our stack array of MAX_POLL_BATCH.
            let rc = unsafe { f(cq, want as libc::c_int, base) };
            if rc < 0 {
                return Err(Error::from_rc("ibv_poll_cq", rc));
            }
            let got = usize::try_from(rc).unwrap_or(0).min(want);
            for i in 0..got {
                // SAFETY: the provider initialised the first `got` entries.
                let wc = unsafe { &*base.add(i) };
                out[done + i] = WorkCompletion::from_raw(wc);
            }
            done += got;
            if got < want {
                break;
            }
        }
        Ok(done)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: we own the CQ; no QP uses it any more (each holds an Arc
        // to us). Errors are ignored.
        let _ = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cq", &self.cq)
            .field("capacity", &self.cqe)
            .finish()
    }
}

// ---------------------------------------------------------------- work completions

/// What a completed work request did. Meaningful only when the completion
/// succeeded: for a failed one the verbs define only `wr_id`, `status` and
/// `vendor_err` (encode the kind in `wr_id`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WcOpcode {
    #[default]
    Send,
    RdmaWrite,
    RdmaRead,
    Recv,
    Other(u32),
}

impl WcOpcode {
    fn from_raw(op: u32) -> WcOpcode {
        use ffi::ibv_wc_opcode as o;
        match op {
            o::IBV_WC_SEND => WcOpcode::Send,
            o::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            o::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            o::IBV_WC_RECV => WcOpcode::Recv,
            other => WcOpcode::Other(other),
        }
    }
}

/// A work request's id, the one encoding every user of this module shares:
/// what kind of request it was (each user numbers its own kinds, below
/// 2^31) and which slot of that kind it used. A completion hands it back
/// unchanged.
///
/// Requests a [`SlotBuffer`](crate::verbs::SlotBuffer) posts carry more:
/// which buffer lent which slot, in bits only that type sets (and posting
/// refuses from anyone else), so their completions give the slot back to
/// it alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WrId {
    pub kind: u32,
    pub slot: u32,
    /// The raw id of a request a SlotBuffer posted; 0 for all others.
    lent: u64,
}

/// Bit 63 of a raw wr_id: a SlotBuffer's request. Its kind (7 bits) sits
/// above its buffer's number (40 bits), above its slot (16 bits).
pub(crate) const LENT: u64 = 1 << 63;
pub(crate) const LENT_KIND_SHIFT: u32 = 56;
pub(crate) const LENT_KIND_MAX: u32 = 0x7f;
pub(crate) const LENT_BUFFER_SHIFT: u32 = 16;
pub(crate) const LENT_BUFFER_MAX: u64 = (1 << 40) - 1;
pub(crate) const LENT_SLOT_MAX: u32 = 0xffff;

impl WrId {
    pub const fn new(kind: u32, slot: u32) -> WrId {
        WrId {
            kind,
            slot,
            lent: 0,
        }
    }

    /// The id of slot `slot` of buffer `buffer`, lent for a request of
    /// `kind` (all three within their bit widths: SlotBuffer checks).
    pub(crate) const fn lent(kind: u32, buffer: u64, slot: u32) -> WrId {
        WrId {
            kind,
            slot,
            lent: LENT
                | ((kind as u64) << LENT_KIND_SHIFT)
                | (buffer << LENT_BUFFER_SHIFT)
                | slot as u64,
        }
    }

    /// Whether posting this id is refused to everyone but a SlotBuffer: a
    /// lent id (copied from a completion) or a kind that would set the
    /// lent bit.
    pub(crate) const fn is_reserved(self) -> bool {
        self.lent != 0 || self.kind >= 1 << 31
    }

    pub(crate) const fn to_raw(self) -> u64 {
        if self.lent != 0 {
            return self.lent;
        }
        ((self.kind as u64) << 32) | self.slot as u64
    }

    pub(crate) const fn from_raw(raw: u64) -> WrId {
        if raw & LENT != 0 {
            return WrId {
                kind: ((raw >> LENT_KIND_SHIFT) as u32) & LENT_KIND_MAX,
                slot: (raw as u32) & LENT_SLOT_MAX,
                lent: raw,
            };
        }
        WrId {
            kind: (raw >> 32) as u32,
            slot: raw as u32,
            lent: 0,
        }
    }
}

/// How a work request ended (`ibv_wc_status`), named where a user acts on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WcStatus {
    #[default]
    Success,
    /// A receive buffer was too small for the message (`IBV_WC_LOC_LEN_ERR`).
    LocalLength,
    /// The queue pair went to the error state with the request still queued
    /// (`IBV_WC_WR_FLUSH_ERR`): a disconnect, not a fault of this request.
    Flushed,
    /// Any other failure, by its `ibv_wc_status` number.
    Other(u32),
}

impl WcStatus {
    pub(crate) fn from_raw(status: u32) -> WcStatus {
        use ffi::ibv_wc_status as s;
        match status {
            s::IBV_WC_SUCCESS => WcStatus::Success,
            s::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
            s::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
            other => WcStatus::Other(other),
        }
    }

    /// The `ibv_wc_status` number.
    pub fn raw(self) -> u32 {
        use ffi::ibv_wc_status as s;
        match self {
            WcStatus::Success => s::IBV_WC_SUCCESS,
            WcStatus::LocalLength => s::IBV_WC_LOC_LEN_ERR,
            WcStatus::Flushed => s::IBV_WC_WR_FLUSH_ERR,
            WcStatus::Other(other) => other,
        }
    }
}

/// One completion (the parts of `ibv_wc` an RC user needs).
///
/// Neither `Clone` nor `Copy`, and only [`CompletionQueue::poll`] makes one
/// that can give a slot back: a request's completion returns its
/// [`SlotBuffer`](crate::verbs::SlotBuffer) slot once, to that buffer alone.
///
/// ```compile_fail,E0277
/// # use ramslog_common::verbs::WorkCompletion;
/// // A second copy would give the same slot back twice: gone.
/// fn twice(wc: &WorkCompletion) -> (WorkCompletion, WorkCompletion) {
///     (WorkCompletion::clone(wc), WorkCompletion::clone(wc))
/// }
/// ```
#[derive(Debug, Default)]
pub struct WorkCompletion {
    pub wr_id: WrId,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// Bytes received (receive completions only).
    pub byte_len: u32,
    pub vendor_err: u32,
    /// The raw id as the adapter returned it, for a SlotBuffer's request
    /// (0 otherwise, or once the slot went back). Private: what gives a
    /// slot back cannot be forged or edited.
    pub(crate) lent: u64,
}

impl WorkCompletion {
    fn from_raw(wc: &ffi::ibv_wc) -> WorkCompletion {
        WorkCompletion {
            wr_id: WrId::from_raw(wc.wr_id),
            status: WcStatus::from_raw(wc.status),
            opcode: WcOpcode::from_raw(wc.opcode),
            byte_len: wc.byte_len,
            vendor_err: wc.vendor_err,
            lent: if wc.wr_id & LENT != 0 { wc.wr_id } else { 0 },
        }
    }

    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }

    /// Text for `status` (`ibv_wc_status_str`).
    pub fn status_str(&self) -> &'static str {
        // SAFETY: ibv_wc_status_str accepts any value and returns a pointer
        // to a static string in libibverbs (or "unknown").
        let p = unsafe { ffi::ibv_wc_status_str(self.status.raw()) };
        if p.is_null() {
            return "unknown";
        }
        // SAFETY: `p` is a NUL-terminated string in libibverbs' read-only
        // data, which stays mapped for the life of the process (the library
        // is linked, never unloaded).
        let s: &'static CStr = unsafe { CStr::from_ptr(p) };
        s.to_str().unwrap_or("unknown")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_ids_round_trip_and_may_be_posted() {
        for (kind, slot) in [(0, 0), (1, 7), (5, u32::MAX), ((1 << 31) - 1, 3)] {
            let id = WrId::new(kind, slot);
            assert_eq!(WrId::from_raw(id.to_raw()), id);
            assert!(!id.is_reserved());
        }
    }

    #[test]
    fn lent_ids_carry_kind_buffer_and_slot_and_no_one_else_may_post_them() {
        let id = WrId::lent(LENT_KIND_MAX, LENT_BUFFER_MAX, LENT_SLOT_MAX);
        let back = WrId::from_raw(id.to_raw());
        assert_eq!(back, id);
        assert_eq!((back.kind, back.slot), (LENT_KIND_MAX, LENT_SLOT_MAX));
        assert!(back.is_reserved());
        let id = WrId::lent(3, 42, 9);
        let raw = id.to_raw();
        assert_eq!(raw & LENT, LENT);
        assert_eq!((raw >> LENT_BUFFER_SHIFT) & LENT_BUFFER_MAX, 42);
        assert_eq!((WrId::from_raw(raw).kind, WrId::from_raw(raw).slot), (3, 9));
        // An ordinary id whose kind would set the lent bit is refused too.
        assert!(WrId::new(1 << 31, 0).is_reserved());
        assert_eq!(WrId::new(1 << 31, 0).to_raw() & LENT, LENT);
    }

    #[test]
    fn only_a_polled_lent_completion_can_give_a_slot_back() {
        let made = WorkCompletion::default();
        assert_eq!(made.lent, 0);
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of them).
        let mut raw: ffi::ibv_wc = unsafe { MaybeUninit::zeroed().assume_init() };
        raw.wr_id = WrId::new(2, 5).to_raw();
        assert_eq!(WorkCompletion::from_raw(&raw).lent, 0);
        raw.wr_id = WrId::lent(2, 11, 5).to_raw();
        let polled = WorkCompletion::from_raw(&raw);
        assert_eq!(polled.lent, raw.wr_id);
        assert_eq!((polled.wr_id.kind, polled.wr_id.slot), (2, 5));
    }
}
