//! The floor over RDMA: rdma_cm RC (`RDMA_PS_TCP`), blocking verbs.
//!
//! Shapes, all at queue depth 1 on one connection:
//! - `send`: SEND of the 76 bytes of headers and the block, SEND of 76
//!   bytes back (a SCSI WRITE with immediate data over iSER);
//! - `send/read`: SEND of 76 bytes naming a client buffer, the server
//!   RDMA-READs the block from it, SEND of 76 bytes back (a WRITE without
//!   immediate data, as illumos negotiates);
//! - `write`: ib_write_lat: each side RDMA-WRITEs the block into the
//!   other's buffer when the last byte of its own buffer changes; the
//!   figure is RTT/2;
//! - `read`: ib_read_lat: the client RDMA-READs the block from the
//!   server's buffer; the figure is post to completion.
//!
//! Waiting for a completion spins for `spin` empty CQ polls, then arms the
//! CQ and sleeps on its completion channel (and on the CM event channel, so
//! a disconnect is noticed). The ib_write_lat shape polls memory and so
//! always spins: `spin` polls flat out, then it yields the CPU between
//! polls; it gives up after a timeout. Every buffer is registered once per
//! connection; nothing is allocated per iteration.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use ramslog_common::verbs::wait::{self, SpinBudget};
use ramslog_common::verbs::{
    self, Access, CmEvent, CmEventKind, CmId, CmWaitError, CompletionChannel, CompletionQueue,
    ConnParam, EventChannel, ProtectionDomain, QpCaps, RecvWr, RegisteredBuffer, SendOp, SendWr,
    Sge, WcStatus, WorkCompletion, WrId,
};

use super::wire::{marker, Accept, Frame, Hello, Op, RDMA_HDR_LEN};

/// Receive buffers posted per connection (queue depth is 1; the rest is
/// slack for control messages).
const RECV_SLOTS: usize = 4;
const SEND_WRS: u32 = 16;
const CQ_SIZE: u32 = 64;
/// Inline sizes asked for, in turn, when creating the QP (perftest's
/// default for RC sends first; some devices take no inline data at all).
const INLINE_TRIES: [u32; 3] = [236, RDMA_HDR_LEN as u32, 0];
const RESOLVE_MS: i32 = 5000;
/// Connection setup and teardown steps.
const CM_TIMEOUT: Duration = Duration::from_secs(10);
/// The client's wait for any one completion or answer.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The server closes a connection whose client says nothing for this long.
const SERVER_IDLE: Duration = Duration::from_secs(120);
// Work request kinds (`WrId::kind`); only receives use the slot.
const WR_RECV: u32 = 1;
const WR_SEND: u32 = 2;
const WR_READ: u32 = 3;
const WR_WRITE: u32 = 4;

pub(super) const NO_RDMA: &str =
    "no RDMA device: floor over rdma needs one (on this machine use the SoftRoCE lab: \
     tests/softroce/run tests/softroce/bench-floor.sh)";

/// The peer went away (disconnect, or our requests flushed): the end of a
/// server connection, not a server error.
#[derive(Debug)]
struct PeerGone(String);

impl fmt::Display for PeerGone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the peer disconnected ({})", self.0)
    }
}

impl std::error::Error for PeerGone {}

fn no_rdma(e: verbs::Error) -> anyhow::Error {
    if e.is_no_rdma() {
        anyhow::Error::new(e).context(NO_RDMA)
    } else {
        e.into()
    }
}

/// Wait for `want` on a non-blocking event channel, with hints for the
/// failures a user of the bench can fix.
fn expect_event(
    events: &EventChannel,
    want: CmEventKind,
    deadline: Instant,
    peer: SocketAddr,
) -> Result<CmEvent> {
    events.wait_for(want, deadline).map_err(|e| match e {
        CmWaitError::Rejected { reason, .. } => anyhow!(
            "{peer} rejected the RDMA connection (CM reason {reason}): is an rdma-bench \
             floor-server (without --no-rdma) listening there?"
        ),
        CmWaitError::Ended {
            kind: kind @ (CmEventKind::AddrError | CmEventKind::RouteError),
            status,
            ..
        } => {
            let os = std::io::Error::from_raw_os_error(status.saturating_abs());
            anyhow!(
                "{peer} is not reachable over RDMA ({kind:?}: {os}); over SoftRoCE use the \
                 rxe device's own address, never 127.0.0.1"
            )
        }
        CmWaitError::Timeout { .. } => anyhow!(
            "{peer}: no rdma_cm {want:?} within {} s",
            CM_TIMEOUT.as_secs()
        ),
        other => anyhow!("{peer}: rdma_cm: {other}"),
    })
}

fn buffer(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Result<RegisteredBuffer> {
    RegisteredBuffer::new(pd, len, access).with_context(|| {
        format!("registering a {len}-byte buffer (RLIMIT_MEMLOCK too low? see ulimit -l)")
    })
}

/// A frame's RDMA headers, copied to the start of `b` (registered memory
/// is copied in and out, never referenced: the adapter may write it).
fn put_headers(b: &RegisteredBuffer, f: &Frame) -> Result<()> {
    let mut headers = [0u8; RDMA_HDR_LEN];
    f.encode_rdma(&mut headers);
    b.write(0, &headers)
        .context("buffer shorter than the RDMA headers")
}

/// `len` bytes of the pattern `i as u8` from `offset`.
fn put_pattern(b: &RegisteredBuffer, offset: usize, len: usize) -> Result<()> {
    let pattern: Vec<u8> = (0..len).map(|i| i as u8).collect();
    b.write(offset, &pattern)
        .context("pattern outside its buffer")
}

/// One byte of a buffer (the flag byte the write-latency loop polls).
fn set_byte(b: &RegisteredBuffer, at: usize, v: u8) -> Result<()> {
    b.write(at, &[v]).context("byte outside its buffer")
}

fn sge(b: &RegisteredBuffer, len: usize) -> Result<Sge<'_>> {
    b.sge(0, len as u32)
        .ok_or_else(|| anyhow!("{len} bytes do not fit a {}-byte buffer", b.len()))
}

/// One connected id with its completion queue, channels and the state of
/// the completion reaper.
struct Conn {
    id: CmId,
    events: EventChannel,
    cq: Arc<CompletionQueue>,
    comp: Arc<CompletionChannel>,
    recv: Vec<RegisteredBuffer>,
    recv_len: u32,
    max_inline: u32,
    spin: u32,
    wcs: [WorkCompletion; 16],
    head: usize,
    len: usize,
    peer: SocketAddr,
}

/// What a connection is made of before it connects: the PD, the queues,
/// the receive buffers, and the QP on the id.
struct Parts {
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    comp: Arc<CompletionChannel>,
    recv: Vec<RegisteredBuffer>,
    max_inline: u32,
}

impl Parts {
    fn new(id: &mut CmId, recv_len: usize) -> Result<Parts> {
        let dev = id
            .device()
            .map_err(|e| anyhow!("the rdma_cm id has no device: {e}"))?;
        let pd = ProtectionDomain::new(&dev)?;
        let comp = Arc::new(CompletionChannel::new(&dev)?);
        comp.set_nonblocking(true)?;
        let cq = CompletionQueue::new(&dev, CQ_SIZE, Some(&comp))?;
        let mut recv = Vec::with_capacity(RECV_SLOTS);
        for _ in 0..RECV_SLOTS {
            recv.push(buffer(&pd, recv_len, Access::LOCAL_WRITE)?);
        }
        let mut last = None;
        for inline in INLINE_TRIES {
            let caps = QpCaps {
                max_send_wr: SEND_WRS,
                max_recv_wr: RECV_SLOTS as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: inline,
            };
            match id.create_qp(&pd, &cq, caps) {
                Ok(()) => {
                    let max_inline = id.qp_caps().map_or(0, |c| c.max_inline_data);
                    return Ok(Parts {
                        pd,
                        cq,
                        comp,
                        recv,
                        max_inline,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        match last {
            Some(e) => Err(e).context("creating the queue pair"),
            None => bail!("creating the queue pair"),
        }
    }

    fn into_conn(
        self,
        id: CmId,
        events: EventChannel,
        spin: u32,
        peer: SocketAddr,
    ) -> Result<Conn> {
        let recv_len = self.recv.first().map_or(0, RegisteredBuffer::len) as u32;
        let conn = Conn {
            id,
            events,
            cq: self.cq,
            comp: self.comp,
            recv: self.recv,
            recv_len,
            max_inline: self.max_inline,
            spin,
            wcs: std::array::from_fn(|_| WorkCompletion::default()),
            head: 0,
            len: 0,
            peer,
        };
        for slot in 0..RECV_SLOTS {
            conn.repost(slot)?;
        }
        Ok(conn)
    }
}

impl Conn {
    fn repost(&self, slot: usize) -> Result<()> {
        let b = self
            .recv
            .get(slot)
            .ok_or_else(|| anyhow!("receive slot {slot} does not exist"))?;
        self.id.post_recv(&[RecvWr {
            wr_id: WrId::new(WR_RECV, slot as u32),
            sge: sge(b, self.recv_len as usize)?,
        }])?;
        Ok(())
    }

    fn post(&self, kind: u32, op: SendOp, sge: Sge) -> Result<()> {
        let inline = !matches!(op, SendOp::RdmaRead { .. }) && sge.len() <= self.max_inline;
        self.id.post_send(&SendWr {
            wr_id: WrId::new(kind, 0),
            op,
            sge,
            signaled: true,
            inline,
        })?;
        Ok(())
    }

    /// A completion already reaped or on the CQ, without waiting.
    fn poll_now(&mut self) -> Result<Option<WorkCompletion>> {
        if self.head == self.len {
            self.head = 0;
            self.len = self.cq.poll(&mut self.wcs)?;
        }
        if self.head < self.len {
            let wc = std::mem::take(&mut self.wcs[self.head]);
            self.head += 1;
            return check(wc).map(Some);
        }
        Ok(None)
    }

    /// The next completion: spin for the budget, then sleep on the
    /// completion channel (and the CM channel) until `deadline`.
    fn wait(&mut self, deadline: Instant, what: &str) -> Result<WorkCompletion> {
        let mut spin = SpinBudget::new(self.spin);
        let mut spins = 0u32;
        loop {
            if let Some(wc) = self.poll_now()? {
                return Ok(wc);
            }
            if spin.poll_again(0) {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(1024) && Instant::now() >= deadline {
                    return Err(self.timeout(what));
                }
                continue;
            }
            // The budget is spent once per wait: after a wake that brought
            // no completion, sleep again at once.
            wait::arm(&[&*self.cq])?;
            if let Some(wc) = self.poll_now()? {
                return Ok(wc);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout(what));
            }
            let woken = wait::sleep(
                &self.comp,
                &[&*self.cq],
                Some(&self.events),
                Some(deadline - now),
            )?;
            if woken.cm {
                self.cm_check()?;
            }
        }
    }

    fn timeout(&self, what: &str) -> anyhow::Error {
        anyhow!("{}: timed out waiting for {what}", self.peer)
    }

    /// Read pending CM events; one that ends the connection is `PeerGone`.
    fn cm_check(&self) -> Result<()> {
        loop {
            match self.events.get_event() {
                Ok(e) if e.kind.ends_connection() => {
                    return Err(PeerGone(format!("rdma_cm {:?}", e.kind)).into())
                }
                Ok(_) => {}
                Err(e) if e.is_would_block() => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The frame in receive slot `slot` after its completion `wc`; reposts
    /// the slot.
    fn take_frame(&self, wc: &WorkCompletion) -> Result<Frame> {
        let slot = wc.wr_id.slot as usize;
        let b = self
            .recv
            .get(slot)
            .ok_or_else(|| anyhow!("receive completion for unknown slot {slot}"))?;
        let len = (wc.byte_len as usize).min(b.len());
        // The slot's receive has completed: nothing writes it until repost.
        // Only the headers are copied out (the data may be megabytes).
        let mut headers = [0u8; RDMA_HDR_LEN];
        let have = len.min(RDMA_HDR_LEN);
        b.read(0, &mut headers[..have])
            .context("receive beyond its slot")?;
        let f = Frame::decode_rdma_headers(&headers[..have], len)
            .with_context(|| format!("message from {}", self.peer));
        self.repost(slot)?;
        f
    }

    /// Poll memory until `buf[off] == want`: `spin` polls flat out, then
    /// yielding the CPU between polls; the CQ and the CM channel are looked
    /// at every 1024 polls (`on_wc` gets any completion).
    fn wait_byte(
        &mut self,
        buf: &RegisteredBuffer,
        off: usize,
        want: u8,
        deadline: Instant,
        mut on_wc: impl FnMut(&Conn, WorkCompletion) -> Result<bool>,
    ) -> Result<bool> {
        let mut polls = 0u32;
        loop {
            if buf.load_volatile(off) == Some(want) {
                return Ok(true);
            }
            polls = polls.wrapping_add(1);
            if polls < self.spin {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            if polls.is_multiple_of(1024) {
                if Instant::now() >= deadline {
                    return Err(self.timeout("an RDMA WRITE (ib_write_lat)"));
                }
                self.cm_check()?;
                while let Some(wc) = self.poll_now()? {
                    if on_wc(self, wc)? {
                        return Ok(false);
                    }
                }
            }
        }
    }
}

fn check(wc: WorkCompletion) -> Result<WorkCompletion> {
    if wc.is_ok() {
        return Ok(wc);
    }
    let what = match wc.wr_id.kind {
        WR_RECV => "receive",
        WR_SEND => "SEND",
        WR_READ => "RDMA READ",
        WR_WRITE => "RDMA WRITE",
        _ => "work request",
    };
    if wc.status == WcStatus::Flushed {
        return Err(PeerGone(format!("{what} flushed")).into());
    }
    bail!(
        "{what} failed: {} (status {}, vendor error {:#x})",
        wc.status_str(),
        wc.status.raw(),
        wc.vendor_err
    )
}

fn unexpected(wc: &WorkCompletion) -> anyhow::Error {
    anyhow!("unexpected completion ({:?}, {:?})", wc.wr_id, wc.opcode)
}

mod client;
mod server;

pub(super) use client::Client;
pub(super) use server::Listener;
