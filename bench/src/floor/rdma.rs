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

/// All of a buffer that no work request is writing now.
fn whole_mut(b: &mut RegisteredBuffer) -> Result<&mut [u8]> {
    let n = b.len();
    b.bytes_mut(0..n).context("buffer range")
}

/// One byte of a buffer (the flag byte the write-latency loop polls).
fn set_byte(b: &mut RegisteredBuffer, at: usize, v: u8) -> Result<()> {
    b.bytes_mut(at..at + 1).context("byte outside its buffer")?[0] = v;
    Ok(())
}

fn sge(b: &RegisteredBuffer, len: usize) -> Result<Sge> {
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
            .ok_or_else(|| anyhow!("the rdma_cm id has no device"))?;
        let pd = ProtectionDomain::new(dev)?;
        let comp = Arc::new(CompletionChannel::new(dev)?);
        comp.set_nonblocking(true)?;
        let cq = CompletionQueue::new(dev, CQ_SIZE, Some(&comp))?;
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
            wcs: [WorkCompletion::default(); 16],
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
            let wc = self.wcs[self.head];
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
            spin.reset();
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
        let f = Frame::decode_rdma(b.bytes(0..len).context("receive beyond its slot")?)
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

// ---------------------------------------------------------------- client

/// The client's end: one connection and its buffers, all registered once.
pub(super) struct Client {
    conn: Conn,
    bs: usize,
    accept: Accept,
    /// Headers + block for the `send` shape.
    msg: RegisteredBuffer,
    /// 76-byte control messages.
    ctl: RegisteredBuffer,
    /// What the server RDMA-READs in the `send/read` shape.
    block: RegisteredBuffer,
    /// Where ib_read_lat reads to.
    read_dst: RegisteredBuffer,
    /// ib_write_lat: what we write, and where the server writes.
    wsrc: RegisteredBuffer,
    wdst: RegisteredBuffer,
    seq: u32,
    wlat_n: u64,
    _pd: Arc<ProtectionDomain>,
}

impl Client {
    pub(super) fn connect(addr: SocketAddr, bs: u32, spin: u32) -> Result<Client> {
        let deadline = Instant::now() + CM_TIMEOUT;
        let events = EventChannel::new().map_err(no_rdma)?;
        events.set_nonblocking(true)?;
        let mut id = CmId::new(&events).map_err(no_rdma)?;
        id.resolve_addr(None, addr, RESOLVE_MS)
            .map_err(no_rdma)
            .with_context(|| format!("resolving {addr} to an RDMA device"))?;
        expect_event(&events, CmEventKind::AddrResolved, deadline, addr)?;
        id.resolve_route(RESOLVE_MS)?;
        expect_event(&events, CmEventKind::RouteResolved, deadline, addr)?;
        let parts = Parts::new(&mut id, RDMA_HDR_LEN)?;
        let pd = Arc::clone(&parts.pd);
        let bsz = bs as usize;
        let mut msg = buffer(&pd, RDMA_HDR_LEN + bsz, Access::empty())?;
        let payload = msg
            .bytes_mut(RDMA_HDR_LEN..RDMA_HDR_LEN + bsz)
            .context("message buffer")?;
        for (i, b) in payload.iter_mut().enumerate() {
            *b = i as u8;
        }
        let ctl = buffer(&pd, RDMA_HDR_LEN, Access::empty())?;
        let block = buffer(&pd, bsz, Access::REMOTE_READ)?;
        let read_dst = buffer(&pd, bsz, Access::LOCAL_WRITE)?;
        let wsrc = buffer(&pd, bsz, Access::empty())?;
        let wdst = buffer(&pd, bsz, Access::REMOTE_WRITE)?;
        let conn = parts.into_conn(id, events, spin, addr)?;
        let hello = Hello { bs }.encode();
        conn.id.connect(&ConnParam {
            private_data: &hello,
            responder_resources: 1,
            initiator_depth: 1,
            ..ConnParam::default()
        })?;
        let est = expect_event(&conn.events, CmEventKind::Established, deadline, addr)?;
        let accept = Accept::decode(&est.private_data)
            .with_context(|| format!("{addr} accepted, but not as a floor-server"))?;
        if accept.bs != bs {
            bail!(
                "floor-server {addr} offers {}-byte buffers for a {bs}-byte block",
                accept.bs
            );
        }
        Ok(Client {
            conn,
            bs: bsz,
            accept,
            msg,
            ctl,
            block,
            read_dst,
            wsrc,
            wdst,
            seq: 0,
            wlat_n: 0,
            _pd: pd,
        })
    }

    /// Wait for our SEND's completion and the server's answer to `seq`.
    fn await_reply(&mut self, seq: u32) -> Result<()> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            let wc = self.conn.wait(deadline, "the floor-server's answer")?;
            match wc.wr_id.kind {
                WR_SEND => sent = true,
                WR_RECV => {
                    let f = self.conn.take_frame(&wc)?;
                    if f.op != Op::Reply || f.seq != seq {
                        bail!(
                            "floor-server {} answered {:?} #{} to request #{seq}",
                            self.conn.peer,
                            f.op,
                            f.seq
                        );
                    }
                    answered = true;
                }
                _ => return Err(unexpected(&wc)),
            }
        }
        Ok(())
    }

    fn control(&mut self, f: Frame) -> Result<()> {
        f.encode_rdma(whole_mut(&mut self.ctl)?);
        let s = sge(&self.ctl, RDMA_HDR_LEN)?;
        self.conn.post(WR_SEND, SendOp::Send, s)?;
        self.await_reply(f.seq)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Shape `send`: SEND headers + block, SEND back. Returns ns.
    pub(super) fn send_block(&mut self) -> Result<u64> {
        let seq = self.next_seq();
        Frame {
            data_len: self.bs as u32,
            ..Frame::new(Op::Data, seq)
        }
        .encode_rdma(whole_mut(&mut self.msg)?);
        let s = sge(&self.msg, RDMA_HDR_LEN + self.bs)?;
        let t = Instant::now();
        self.conn.post(WR_SEND, SendOp::Send, s)?;
        self.await_reply(seq)?;
        Ok(ns(t))
    }

    /// Shape `send/read`: SEND naming our block, the server RDMA-READs it,
    /// SEND back. Returns ns.
    pub(super) fn send_read(&mut self) -> Result<u64> {
        let seq = self.next_seq();
        let f = Frame {
            remote_addr: self.block.addr(),
            rkey: self.block.rkey(),
            remote_len: self.bs as u32,
            ..Frame::new(Op::Read, seq)
        };
        let t = Instant::now();
        self.control(f)?;
        Ok(ns(t))
    }

    /// Shape `read` (ib_read_lat): RDMA READ of the server's block, post to
    /// completion. Returns ns.
    pub(super) fn read(&mut self) -> Result<u64> {
        let s = sge(&self.read_dst, self.bs)?;
        let op = SendOp::RdmaRead {
            remote_addr: self.accept.read_addr,
            rkey: self.accept.read_rkey,
        };
        let t = Instant::now();
        self.conn.post(WR_READ, op, s)?;
        let wc = self.conn.wait(t + IO_TIMEOUT, "an RDMA READ")?;
        if wc.wr_id.kind != WR_READ {
            return Err(unexpected(&wc));
        }
        Ok(ns(t))
    }

    /// Put the server into ib_write_lat mode.
    pub(super) fn wlat_start(&mut self) -> Result<()> {
        let last = self.bs - 1;
        set_byte(&mut self.wdst, last, 0)?;
        set_byte(&mut self.wsrc, last, 0)?;
        self.wlat_n = 0;
        let seq = self.next_seq();
        self.control(Frame {
            remote_addr: self.wdst.addr(),
            rkey: self.wdst.rkey(),
            remote_len: self.bs as u32,
            ..Frame::new(Op::WlatStart, seq)
        })
    }

    /// One ib_write_lat round trip: write the block with a new last byte,
    /// poll until the server's write of the same byte lands. Returns RTT/2
    /// in ns, as perftest reports it.
    pub(super) fn wlat(&mut self) -> Result<u64> {
        let last = self.bs - 1;
        let want = marker(self.wlat_n);
        self.wlat_n += 1;
        // The previous WRITE from wsrc has completed (reaped below).
        set_byte(&mut self.wsrc, last, want)?;
        let s = sge(&self.wsrc, self.bs)?;
        let op = SendOp::RdmaWrite {
            remote_addr: self.accept.write_addr,
            rkey: self.accept.write_rkey,
        };
        let t = Instant::now();
        self.conn.post(WR_WRITE, op, s)?;
        let deadline = t + IO_TIMEOUT;
        let mut written = false;
        let wdst = &self.wdst;
        self.conn.wait_byte(wdst, last, want, deadline, |_, wc| {
            match wc.wr_id.kind {
                WR_WRITE => written = true,
                _ => return Err(unexpected(&wc)),
            }
            Ok(false)
        })?;
        let half = ns(t) / 2;
        while !written {
            let wc = self.conn.wait(deadline, "an RDMA WRITE completion")?;
            match wc.wr_id.kind {
                WR_WRITE => written = true,
                _ => return Err(unexpected(&wc)),
            }
        }
        Ok(half)
    }

    /// Take the server out of ib_write_lat mode.
    pub(super) fn wlat_stop(&mut self) -> Result<()> {
        let seq = self.next_seq();
        self.control(Frame::new(Op::WlatStop, seq))
    }

    /// Disconnect (best effort: the measurements are already taken).
    pub(super) fn close(self) {
        if self.conn.id.disconnect().is_ok() {
            let _ = expect_event(
                &self.conn.events,
                CmEventKind::Disconnected,
                Instant::now() + Duration::from_secs(2),
                self.conn.peer,
            );
        }
    }
}

fn ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------- server

/// The rdma_cm listener of a floor-server.
pub(super) struct Listener {
    /// Kept for its life: dropping it stops the listening.
    _id: CmId,
    events: EventChannel,
    spin: u32,
}

impl Listener {
    pub(super) fn bind(addr: SocketAddr, spin: u32) -> Result<Listener> {
        let hint = "run floor-server with --no-rdma to serve TCP alone";
        let events = EventChannel::new().map_err(|e| no_rdma_server(e, hint))?;
        let id = CmId::new(&events).map_err(|e| no_rdma_server(e, hint))?;
        id.bind(addr)
            .map_err(|e| no_rdma_server(e, hint))
            .with_context(|| {
                format!("rdma_cm cannot bind {addr} (is it the address of an RDMA device? {hint})")
            })?;
        id.listen(16).context("rdma_listen")?;
        Ok(Listener {
            _id: id,
            events,
            spin,
        })
    }

    /// Accept connections forever, a thread each.
    pub(super) fn run(self) -> Result<()> {
        loop {
            let mut ev = match self.events.get_event() {
                Ok(ev) => ev,
                Err(e) if e.source.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    if let Some(id) = ev.new_id.take() {
                        self.request(id, &ev);
                    }
                }
                CmEventKind::DeviceRemoval => bail!("the RDMA device was removed"),
                _ => {}
            }
        }
    }

    fn request(&self, id: CmId, ev: &CmEvent) {
        let peer = id.peer_addr();
        let who = peer.map_or_else(|| "?".to_string(), |p| p.to_string());
        // A malformed hello: dropping the id rejects the request.
        let hello = match Hello::decode(&ev.private_data) {
            Ok(h) if h.bs > 0 => h,
            Ok(_) => return eprintln!("floor-server: rdma client {who}: zero block size"),
            Err(e) => return eprintln!("floor-server: rdma client {who}: {e}"),
        };
        let events = match EventChannel::new().and_then(|ch| {
            ch.set_nonblocking(true)?;
            id.migrate(&ch)?;
            Ok(ch)
        }) {
            Ok(ch) => ch,
            Err(e) => return eprintln!("floor-server: rdma client {who}: {e}"),
        };
        let (rr, depth, spin) = (ev.responder_resources, ev.initiator_depth, self.spin);
        let peer = peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let spawned = std::thread::Builder::new()
            .name(format!("floor-rdma {who}"))
            .spawn(move || {
                if let Err(e) = serve_connection(id, events, hello, rr, depth, spin, peer) {
                    if e.downcast_ref::<PeerGone>().is_none() {
                        eprintln!("floor-server: rdma client {who}: {e:#}");
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!("floor-server: rdma client: cannot start a thread: {e}");
        }
    }
}

fn no_rdma_server(e: verbs::Error, hint: &str) -> anyhow::Error {
    if e.is_no_rdma() {
        anyhow::Error::new(e).context(format!("no RDMA device on this host: {hint}"))
    } else {
        e.into()
    }
}

/// The server's buffers of one connection.
struct ServerBufs {
    bs: usize,
    reply: RegisteredBuffer,
    /// Where the `send/read` shape reads the client's block to.
    data: RegisteredBuffer,
    /// What ib_read_lat clients read.
    rsrc: RegisteredBuffer,
    /// ib_write_lat: where the client writes, and what we write back.
    wdst: RegisteredBuffer,
    wsrc: RegisteredBuffer,
}

fn serve_connection(
    mut id: CmId,
    events: EventChannel,
    hello: Hello,
    responder_resources: u8,
    initiator_depth: u8,
    spin: u32,
    peer: SocketAddr,
) -> Result<()> {
    let bs = hello.bs as usize;
    let dev = id
        .device()
        .ok_or_else(|| anyhow!("connect request without a device"))?;
    let attrs = dev.attrs()?;
    let parts = Parts::new(&mut id, RDMA_HDR_LEN + bs)?;
    let pd = Arc::clone(&parts.pd);
    let mut rsrc = buffer(&pd, bs, Access::REMOTE_READ)?;
    for (i, b) in whole_mut(&mut rsrc)?.iter_mut().enumerate() {
        *b = i as u8;
    }
    let mut bufs = ServerBufs {
        bs,
        reply: buffer(&pd, RDMA_HDR_LEN, Access::empty())?,
        data: buffer(&pd, bs, Access::LOCAL_WRITE)?,
        rsrc,
        wdst: buffer(&pd, bs, Access::REMOTE_WRITE)?,
        wsrc: buffer(&pd, bs, Access::empty())?,
    };
    let mut conn = parts.into_conn(id, events, spin, peer)?;
    let accept = Accept {
        bs: hello.bs,
        read_addr: bufs.rsrc.addr(),
        read_rkey: bufs.rsrc.rkey(),
        write_addr: bufs.wdst.addr(),
        write_rkey: bufs.wdst.rkey(),
    }
    .encode();
    let clamp = |v: u8, max: u32| u8::try_from(max).map_or(v, |m| v.min(m));
    conn.id.accept(&ConnParam {
        private_data: &accept,
        responder_resources: clamp(responder_resources.max(1), attrs.max_qp_rd_atom),
        initiator_depth: clamp(initiator_depth.max(1), attrs.max_qp_init_rd_atom),
        ..ConnParam::default()
    })?;
    expect_event(
        &conn.events,
        CmEventKind::Established,
        Instant::now() + CM_TIMEOUT,
        peer,
    )?;
    let r = message_loop(&mut conn, &mut bufs);
    if let Err(e) = &r {
        if e.downcast_ref::<PeerGone>().is_none() {
            let _ = conn.id.disconnect();
        }
    }
    drop(conn);
    drop(bufs);
    r
}

/// Server state for the SEND it answers with: the reply buffer is reused
/// only after the previous reply's completion.
struct Replier {
    send_done: bool,
}

impl Replier {
    fn on_send(&mut self) {
        self.send_done = true;
    }

    fn reply(&mut self, conn: &mut Conn, bufs: &mut ServerBufs, seq: u32) -> Result<()> {
        let deadline = Instant::now() + IO_TIMEOUT;
        while !self.send_done {
            let wc = conn.wait(deadline, "the previous answer's completion")?;
            match wc.wr_id.kind {
                WR_SEND => self.send_done = true,
                _ => return Err(unexpected(&wc)),
            }
        }
        Frame::new(Op::Reply, seq).encode_rdma(whole_mut(&mut bufs.reply)?);
        conn.post(WR_SEND, SendOp::Send, sge(&bufs.reply, RDMA_HDR_LEN)?)?;
        self.send_done = false;
        Ok(())
    }
}

fn message_loop(conn: &mut Conn, bufs: &mut ServerBufs) -> Result<()> {
    let mut rep = Replier { send_done: true };
    loop {
        let wc = conn.wait(
            Instant::now() + SERVER_IDLE,
            "the client's next message (idle)",
        )?;
        match wc.wr_id.kind {
            WR_SEND => rep.on_send(),
            WR_RECV => {
                let f = conn.take_frame(&wc)?;
                match f.op {
                    Op::Data => {
                        if f.data_len as usize > bufs.bs {
                            bail!("{}-byte block on a {}-byte connection", f.data_len, bufs.bs);
                        }
                        rep.reply(conn, bufs, f.seq)?;
                    }
                    Op::Read => {
                        read_block(conn, bufs, &mut rep, &f)?;
                        rep.reply(conn, bufs, f.seq)?;
                    }
                    Op::WlatStart => {
                        if f.remote_len as usize != bufs.bs {
                            bail!(
                                "ib_write_lat buffer of {} bytes on a {}-byte connection",
                                f.remote_len,
                                bufs.bs
                            );
                        }
                        let last = bufs.bs - 1;
                        set_byte(&mut bufs.wdst, last, 0)?;
                        set_byte(&mut bufs.wsrc, last, 0)?;
                        rep.reply(conn, bufs, f.seq)?;
                        let stop = write_lat(conn, bufs, &mut rep, &f)?;
                        rep.reply(conn, bufs, stop)?;
                    }
                    Op::WlatStop => rep.reply(conn, bufs, f.seq)?,
                    Op::Reply => bail!("a client sent a Reply"),
                }
            }
            _ => return Err(unexpected(&wc)),
        }
    }
}

/// The `send/read` shape: RDMA READ the client's block.
fn read_block(conn: &mut Conn, bufs: &ServerBufs, rep: &mut Replier, f: &Frame) -> Result<()> {
    let len = f.remote_len as usize;
    if len == 0 || len > bufs.bs {
        bail!("RDMA READ of {len} bytes on a {}-byte connection", bufs.bs);
    }
    let op = SendOp::RdmaRead {
        remote_addr: f.remote_addr,
        rkey: f.rkey,
    };
    conn.post(WR_READ, op, sge(&bufs.data, len)?)?;
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let wc = conn.wait(deadline, "the RDMA READ of the client's block")?;
        match wc.wr_id.kind {
            WR_READ => return Ok(()),
            WR_SEND => rep.on_send(),
            _ => return Err(unexpected(&wc)),
        }
    }
}

/// ib_write_lat, server side: whenever the last byte of `wdst` becomes the
/// next marker, RDMA-WRITE `wsrc` with that marker to the client. Ends at
/// the client's `WlatStop`; returns its sequence number.
fn write_lat(conn: &mut Conn, bufs: &mut ServerBufs, rep: &mut Replier, f: &Frame) -> Result<u32> {
    let last = bufs.bs - 1;
    let op = SendOp::RdmaWrite {
        remote_addr: f.remote_addr,
        rkey: f.rkey,
    };
    let mut n = 0u64;
    let mut write_pending = false;
    let mut stop = None;
    loop {
        let want = marker(n);
        let deadline = Instant::now() + SERVER_IDLE;
        let got = conn.wait_byte(&bufs.wdst, last, want, deadline, |c, wc| {
            match wc.wr_id.kind {
                WR_WRITE => write_pending = false,
                WR_SEND => rep.on_send(),
                WR_RECV => {
                    let m = c.take_frame(&wc)?;
                    if m.op != Op::WlatStop {
                        bail!("{:?} in ib_write_lat mode", m.op);
                    }
                    stop = Some(m.seq);
                    return Ok(true);
                }
                _ => return Err(unexpected(&wc)),
            }
            Ok(false)
        })?;
        if !got {
            // Let our last WRITE complete before answering.
            let deadline = Instant::now() + IO_TIMEOUT;
            while write_pending {
                let wc = conn.wait(deadline, "the last RDMA WRITE's completion")?;
                match wc.wr_id.kind {
                    WR_WRITE => write_pending = false,
                    WR_SEND => rep.on_send(),
                    _ => return Err(unexpected(&wc)),
                }
            }
            return stop.ok_or_else(|| anyhow!("ib_write_lat ended without a stop"));
        }
        // The client saw our previous WRITE, so it is done on the wire;
        // reap its completion before touching wsrc again.
        let deadline = Instant::now() + IO_TIMEOUT;
        while write_pending {
            let wc = conn.wait(deadline, "an RDMA WRITE's completion")?;
            match wc.wr_id.kind {
                WR_WRITE => write_pending = false,
                WR_SEND => rep.on_send(),
                _ => return Err(unexpected(&wc)),
            }
        }
        set_byte(&mut bufs.wsrc, last, want)?;
        conn.post(WR_WRITE, op, sge(&bufs.wsrc, bufs.bs)?)?;
        write_pending = true;
        n += 1;
    }
}
