//! Work requests and posting them (the providers' own post_send and
//! post_recv, in batches).

use super::*;

// ---------------------------------------------------------------- work requests

/// A scatter/gather entry: `len` bytes at `addr` in a region with `lkey`,
/// borrowing that region (`'r`).
///
/// Made only by [`MemoryRegion::sge`] and [`RegisteredBuffer::sge`], which
/// check the range against the registered memory: safe code cannot point
/// the adapter at memory it does not own. The borrow keeps the region
/// registered until the entry is posted: an entry kept past its region's
/// drop would name a key the next registration may reuse, over memory that
/// is gone. (Once posted, the region's drop deregisters it, after which the
/// adapter touches none of its memory.) The default is the empty entry (no
/// bytes), a placeholder to be overwritten before posting.
///
/// ```
/// use ramslog_common::verbs::{RegisteredBuffer, Sge};
/// // The way to an entry: a range of registered memory, checked.
/// fn slot(b: &RegisteredBuffer, i: usize) -> Option<Sge<'_>> {
///     b.sge(i * 512, 512)
/// }
/// ```
///
/// ```compile_fail,E0451
/// // Any address and key from safe code: refused by the compiler.
/// let _ = ramslog_common::verbs::Sge {
///     addr: 0x1000,
///     len: 4096,
///     lkey: 1,
///     region: std::marker::PhantomData,
/// };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge<'r> {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) lkey: u32,
    pub(super) region: std::marker::PhantomData<&'r ()>,
}

impl Sge<'_> {
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
}

/// The send-queue operations we use. (Never SEND_WITH_INV: the target
/// never lets an initiator invalidate its keys.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    Send,
    /// Write the local `sge` to the peer's `remote_addr` (`rkey`).
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    /// Read the peer's `remote_addr` (`rkey`) into the local `sge`.
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
}

/// One send-queue work request with a single SGE (`len == 0`: no SGE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr<'r> {
    pub wr_id: WrId,
    pub op: SendOp,
    pub sge: Sge<'r>,
    /// Generate a completion (the QP has sq_sig_all = 0).
    pub signaled: bool,
    /// Copy the data into the WQE (`IBV_SEND_INLINE`): the buffer is free as
    /// soon as the post returns and needs no valid lkey. SEND and RDMA WRITE
    /// only, up to the QP's `max_inline_data`.
    pub inline: bool,
}

/// One receive work request with a single SGE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr<'r> {
    pub wr_id: WrId,
    pub sge: Sge<'r>,
}

/// A batch post that failed part-way: the first `posted` work requests were
/// posted (they complete normally, or flushed when the QP goes down); the
/// rest were not.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({posted} work requests were posted before the failure)")]
pub struct PostError {
    pub posted: usize,
    pub error: Error,
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Error {
        e.error
    }
}

const SEND_CHUNK: usize = 16;
const RECV_CHUNK: usize = 64;

fn raw_sge(s: &Sge<'_>) -> ffi::ibv_sge {
    ffi::ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    }
}

/// Index of `bad` among the `n` elements starting at `base`, if it points
/// at one of them.
fn index_of<T>(base: *const T, n: usize, bad: *const T) -> Option<usize> {
    let size = std::mem::size_of::<T>();
    let (start, b) = (base as usize, bad as usize);
    if size == 0 || b < start {
        return None;
    }
    let i = (b - start) / size;
    (i < n).then_some(i)
}

/// After a chunk of `n` WRs at `base` was posted with result `rc`: the
/// count posted so far, or how far it got (the provider names the first WR
/// it refused in `bad`).
fn chunk_posted<T>(
    op: &'static str,
    rc: i32,
    before: usize,
    base: *const T,
    n: usize,
    bad: *const T,
) -> std::result::Result<usize, PostError> {
    if rc == 0 {
        return Ok(before + n);
    }
    Err(PostError {
        posted: before + index_of(base, n, bad).unwrap_or(0),
        error: Error::from_rc(op, rc),
    })
}

/// Post `wrs` on `qp`'s send queue, chained in chunks of SEND_CHUNK built on
/// the stack.
pub(crate) fn post_send(
    qp: NonNull<ffi::ibv_qp>,
    wrs: &[SendWr<'_>],
) -> std::result::Result<(), PostError> {
    const OP: &str = "ibv_post_send";
    let qp = qp.as_ptr();
    // SAFETY: the QP is alive (owned by the calling CmId); its context
    // pointer is set by libibverbs and valid while the QP exists.
    let f = unsafe { (*(*qp).context).ops.post_send };
    let Some(f) = f else {
        return Err(PostError {
            posted: 0,
            error: Error::from_errno(OP, libc::EOPNOTSUPP),
        });
    };
    // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero integers,
    // unions of plain data).
    let mut raw: [ffi::ibv_send_wr; SEND_CHUNK] = unsafe { MaybeUninit::zeroed().assume_init() };
    let mut sges = [ffi::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; SEND_CHUNK];
    // Every access below goes through these two pointers, so the links
    // between the entries stay valid.
    let wr_base = raw.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    let mut posted = 0;
    for chunk in wrs.chunks(SEND_CHUNK) {
        let n = chunk.len();
        for (i, w) in chunk.iter().enumerate() {
            let (opcode, remote_addr, rkey) = match w.op {
                SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, 0, 0),
                SendOp::RdmaWrite { remote_addr, rkey } => {
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, remote_addr, rkey)
                }
                SendOp::RdmaRead { remote_addr, rkey } => {
                    if w.inline {
                        return Err(PostError {
                            posted,
                            error: Error::from_errno(OP, libc::EINVAL),
                        });
                    }
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, remote_addr, rkey)
                }
            };
            let mut flags = 0;
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if w.inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            // SAFETY: i < n <= SEND_CHUNK, so entry i (and i + 1 when
            // i + 1 < n) is inside `raw` / `sges`, which outlive this loop.
            unsafe {
                sge_base.add(i).write(raw_sge(&w.sge));
                let r = wr_base.add(i);
                (*r).wr_id = w.wr_id.to_raw();
                (*r).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    ptr::null_mut()
                };
                (*r).sg_list = sge_base.add(i);
                // A zero-length SGE means 2 GiB on some HCAs: post none.
                (*r).num_sge = if w.sge.len == 0 { 0 } else { 1 };
                (*r).opcode = opcode;
                (*r).send_flags = flags;
                (*r).wr.rdma = ffi::rdma_t { remote_addr, rkey };
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the provider's post_send on its live QP (what the inline
        // ibv_post_send does). The chain of `n` WRs and their SGEs lives on
        // our stack across the call; the provider copies them into the WQ.
        let rc = unsafe { f(qp, wr_base, &mut bad) };
        posted = chunk_posted(OP, rc, posted, wr_base, n, bad)?;
    }
    Ok(())
}

/// Post `wrs` on `qp`'s receive queue, chained in chunks of RECV_CHUNK built
/// on the stack.
pub(crate) fn post_recv(
    qp: NonNull<ffi::ibv_qp>,
    wrs: &[RecvWr<'_>],
) -> std::result::Result<(), PostError> {
    const OP: &str = "ibv_post_recv";
    let qp = qp.as_ptr();
    // SAFETY: the QP is alive (owned by the calling CmId); its context
    // pointer is valid while the QP exists.
    let f = unsafe { (*(*qp).context).ops.post_recv };
    let Some(f) = f else {
        return Err(PostError {
            posted: 0,
            error: Error::from_errno(OP, libc::EOPNOTSUPP),
        });
    };
    let mut raw = [ffi::ibv_recv_wr {
        wr_id: 0,
        next: ptr::null_mut(),
        sg_list: ptr::null_mut(),
        num_sge: 0,
    }; RECV_CHUNK];
    let mut sges = [ffi::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; RECV_CHUNK];
    let wr_base = raw.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    let mut posted = 0;
    for chunk in wrs.chunks(RECV_CHUNK) {
        let n = chunk.len();
        for (i, w) in chunk.iter().enumerate() {
            // SAFETY: i < n <= RECV_CHUNK, so entry i (and i + 1 when
            // i + 1 < n) is inside `raw` / `sges`, which outlive this loop.
            unsafe {
                sge_base.add(i).write(raw_sge(&w.sge));
                wr_base.add(i).write(ffi::ibv_recv_wr {
                    wr_id: w.wr_id.to_raw(),
                    next: if i + 1 < n {
                        wr_base.add(i + 1)
                    } else {
                        ptr::null_mut()
                    },
                    sg_list: sge_base.add(i),
                    num_sge: if w.sge.len == 0 { 0 } else { 1 },
                });
            }
        }
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the provider's post_recv on its live QP (what the inline
        // ibv_post_recv does); the chain lives on our stack across the call.
        let rc = unsafe { f(qp, wr_base, &mut bad) };
        posted = chunk_posted(OP, rc, posted, wr_base, n, bad)?;
    }
    Ok(())
}
