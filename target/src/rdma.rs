//! iSER: the RDMA transport driver around the sans-IO engine.
//!
//! One rdma_cm listener thread accepts connect requests on every portal
//! address that belongs to an RDMA device. Each connection then runs on its
//! own thread, which owns its QP, completion queue, receive and send buffers
//! and its engine `Connection`: it polls the CQ (spinning for a configurable
//! number of empty polls before sleeping on the completion channel), feeds
//! received PDUs and finished RDMA READs to the engine, and turns the engine's
//! actions into SENDs, RDMA WRITEs from LUN memory and RDMA READs into it.
//! Every buffer is allocated and registered at connect time; the I/O path
//! neither allocates nor locks nor copies payload (immediate data excepted:
//! it arrives in a receive buffer).
//!
//! Work requests are posted in the order the engine queued its actions, so an
//! RDMA WRITE of read data always precedes the SCSI Response that follows it.
//! When a resource runs short (send slots, RDMA READ credits), the action is
//! held and everything behind it waits: order is never traded for speed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ramslog_common::iscsi::{Bhs, BHS_LEN};
use ramslog_common::iser::{peer, CmPeer, CmRequest, Header, HEADER_LEN, VERSION};
use ramslog_common::verbs::wait::{self, SpinBudget};
use ramslog_common::verbs::{
    self, Access, CmEvent, CmEventKind, CmId, CompletionChannel, CompletionQueue, ConnParam,
    Device, EventChannel, ProtectionDomain, QpCaps, RecvWr, RegisteredBuffer, SendOp, SendWr,
    WcOpcode, WorkCompletion, WrId,
};

use crate::clock::CoarseClock;
use crate::engine::{
    Action, ConnInfo, Connection, OutData, OutPdu, ReadDest, ISER_BUFFERED_READ_MAX,
};
use crate::metrics::{self, LimitHit};
use crate::portal::{Link, Permit, Portal, SessionControl};
use crate::store::RdmaRegion;

/// Data segment room of each receive buffer: our TargetRecvDataSegmentLength
/// (and MaxRecvDataSegmentLength for the illumos initiator).
pub const RECV_DATA_LEN: u32 = 8192;
/// iSER header + BHS + the largest AHS + the data segment, rounded up.
const RECV_SLOT_LEN: usize = 10 * 1024;
/// Receives posted per connection: the command window plus room for
/// unsolicited Data-Out, NOP-Outs and task management.
const RECV_SLOTS: usize = 320;
/// The illumos initiator receives into fixed 16 KiB messages: nothing we
/// SEND is ever larger.
const SEND_SLOT_LEN: usize = peer::ILLUMOS_MSG_LEN;
const SEND_SLOTS: usize = 256;
/// Read data that is not LUN memory (INQUIRY, MODE SENSE, ...) is RDMA-written
/// from these; they are small.
const DATAIN_SLOT_LEN: usize = 256 * 1024;
const DATAIN_SLOTS: usize = 4;
/// Parameter lists and other write data the SCSI device must see before it
/// reaches the LUN are RDMA-read into these.
const BOUNCE_SLOT_LEN: usize = ISER_BUFFERED_READ_MAX as usize;
const BOUNCE_SLOTS: usize = 2;
/// RDMA READs in flight per connection, at most (and never more than the
/// initiator offered: illumos offers 4).
const MAX_READ_CREDITS: usize = 16;
/// Longest sleep between checks of the session's termination flag.
const MAX_SLEEP: Duration = Duration::from_millis(100);
/// Consumed receive buffers are reposted in batches of this many (or before
/// sleeping): one doorbell instead of one per command.
const REPOST_BATCH: usize = 16;
/// How long a closing connection waits for its last SENDs to complete.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Work request kinds (`WrId::kind`); the slot is the kind's buffer slot.
mod wr {
    pub const RECV: u32 = 1;
    pub const SEND: u32 = 2;
    pub const DATAIN: u32 = 3;
    pub const WRITE_STORE: u32 = 4;
    pub const READ: u32 = 5;
}

#[derive(Debug, Clone, Copy)]
pub struct IserOptions {
    /// Empty CQ polls before sleeping on the completion channel.
    pub spin: u32,
}

/// Start the iSER listener on every address that has an RDMA device. Without
/// RDMA in the kernel or without a device this logs once and returns: the
/// target keeps serving iSCSI/TCP.
pub fn start(portal: Arc<Portal>, listen: &[SocketAddr], opts: IserOptions) {
    match verbs::device_count() {
        Ok(0) => {
            tracing::info!("iSER: no RDMA device; serving iSCSI/TCP only");
            return;
        }
        Err(e) if e.is_no_rdma() => {
            tracing::info!("iSER: this kernel has no RDMA support ({e}); serving iSCSI/TCP only");
            return;
        }
        Err(e) => {
            tracing::warn!("iSER disabled: {e}; serving iSCSI/TCP only");
            return;
        }
        Ok(_) => {}
    }
    let channel = match EventChannel::new() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("iSER disabled: {e}; serving iSCSI/TCP only");
            return;
        }
    };
    let mut listeners = Vec::new();
    for addr in listen {
        let id = match CmId::new(&channel) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!("iSER disabled: {e}");
                return;
            }
        };
        if let Err(e) = id.bind(*addr).and_then(|()| id.listen(64)) {
            tracing::warn!(
                "iSER: not listening on {addr}: {e} (no RDMA device has this address; iSCSI/TCP still serves it)"
            );
            continue;
        }
        tracing::info!("iSER listening on {addr}");
        listeners.push(id);
    }
    if listeners.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("iser-cm".into())
        .spawn(move || listen_loop(channel, listeners, portal, opts));
    if let Err(e) = spawned {
        tracing::warn!("iSER disabled: cannot start its thread: {e}");
    }
}

/// What one RDMA device shares between its connections: the protection
/// domain and every LUN registered once.
struct DeviceResources {
    device: usize,
    pd: Arc<ProtectionDomain>,
    regions: Vec<RdmaRegion>,
}

fn device_resources(
    cache: &Mutex<Vec<Arc<DeviceResources>>>,
    dev: Device,
    portal: &Portal,
) -> Result<Arc<DeviceResources>, verbs::Error> {
    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = cache.iter().find(|r| r.device == dev.raw_handle()) {
        return Ok(r.clone());
    }
    let pd = ProtectionDomain::new(dev)?;
    let mut regions = Vec::new();
    for t in &portal.targets {
        for lu in t.scsi.luns() {
            regions.push(lu.volume().store().register_rdma(&pd)?);
        }
    }
    tracing::info!(
        device = %dev.name(),
        luns = regions.len(),
        "iSER: LUN memory registered with the RDMA device"
    );
    let r = Arc::new(DeviceResources {
        device: dev.raw_handle(),
        pd,
        regions,
    });
    cache.push(r.clone());
    Ok(r)
}

fn listen_loop(
    channel: EventChannel,
    _listeners: Vec<CmId>,
    portal: Arc<Portal>,
    opts: IserOptions,
) {
    let devices = Mutex::new(Vec::new());
    loop {
        let event = match channel.get_event() {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("iSER: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if event.kind != CmEventKind::ConnectRequest {
            tracing::debug!("iSER listener: {:?} (status {})", event.kind, event.status);
            continue;
        }
        let CmEvent {
            new_id,
            private_data,
            responder_resources,
            initiator_depth,
            ..
        } = event;
        let Some(id) = new_id else { continue };
        let peer = id.peer_addr();
        let source = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.ip());
        let permit = match portal.gate.admit(source, Link::Iser) {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(?peer, "iSER: connection refused: {why}");
                let _ = id.reject(&[]);
                continue;
            }
        };
        let request = CmRequest::parse(&private_data);
        let offer = Offer {
            request,
            responder_resources,
            initiator_depth,
        };
        match prepare(&id, &devices, &portal) {
            Ok((res, events)) => {
                let portal = portal.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("iser-conn".into())
                        .spawn(move || {
                            if let Err(e) =
                                run_connection(id, events, res, portal, opts, offer, permit)
                            {
                                tracing::info!("iSER connection ended: {e}");
                            }
                        });
                if let Err(e) = spawned {
                    tracing::warn!("iSER: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                tracing::warn!(?peer, "iSER: refusing connection: {e}");
                let _ = id.reject(&[]);
            }
        }
    }
}

/// What the initiator's connect request offered.
struct Offer {
    request: CmRequest,
    /// RDMA READs the initiator accepts from us at once.
    initiator_depth: u8,
    responder_resources: u8,
}

/// Move the new id to its own event channel (before accepting, so its
/// Established and Disconnected events go to its thread) and get the
/// device's shared resources.
fn prepare(
    id: &CmId,
    devices: &Mutex<Vec<Arc<DeviceResources>>>,
    portal: &Portal,
) -> Result<(Arc<DeviceResources>, EventChannel), verbs::Error> {
    let dev = id.device().ok_or_else(|| verbs::Error {
        op: "connect request without a device",
        source: std::io::Error::from_raw_os_error(libc::ENODEV),
    })?;
    let res = device_resources(devices, dev, portal)?;
    let events = EventChannel::new()?;
    id.migrate(&events)?;
    events.set_nonblocking(true)?;
    Ok((res, events))
}

struct IserControl {
    terminated: AtomicBool,
}

impl SessionControl for IserControl {
    fn terminate(&self) {
        self.terminated.store(true, Ordering::Release);
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    #[error("{0}")]
    Protocol(String),
}

fn run_connection(
    mut id: CmId,
    events: EventChannel,
    res: Arc<DeviceResources>,
    portal: Arc<Portal>,
    opts: IserOptions,
    offer: Offer,
    permit: Permit,
) -> Result<(), ConnError> {
    let peer = id.peer_addr();
    let dev = id
        .device()
        .ok_or_else(|| ConnError::Protocol("connection lost its device".into()))?;
    let attrs = dev.attrs()?;
    let credit_cap = match offer.request.peer {
        CmPeer::Illumos => usize::from(peer::ILLUMOS_RDMA_READ_CREDITS),
        _ => MAX_READ_CREDITS,
    };
    let credits = (offer.initiator_depth as usize)
        .min(attrs.max_qp_init_rd_atom as usize)
        .min(credit_cap);
    if credits == 0 {
        let _ = id.reject(&[]);
        return Err(ConnError::Protocol(format!(
            "{peer:?} offers no RDMA READ resources; iSER writes need them"
        )));
    }
    let sq_depth =
        (SEND_SLOTS + DATAIN_SLOTS + MAX_READ_CREDITS + 256).min(attrs.max_qp_wr as usize);
    let rq_depth = RECV_SLOTS.min(attrs.max_qp_wr as usize);
    let comp = Arc::new(CompletionChannel::new(dev)?);
    comp.set_nonblocking(true)?;
    // Separate queues: the thread sleeps on receives (and on send-side
    // completions only while it waits for one), so the completion of every
    // response SEND does not cost a wake-up.
    let send_cq = CompletionQueue::new(dev, sq_depth as u32, Some(&comp))?;
    let recv_cq = CompletionQueue::new(dev, rq_depth as u32, Some(&comp))?;
    id.create_qp_split(
        &res.pd,
        &send_cq,
        &recv_cq,
        QpCaps {
            max_send_wr: sq_depth as u32,
            max_recv_wr: rq_depth as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
    )?;
    let recv = RegisteredBuffer::new(&res.pd, rq_depth * RECV_SLOT_LEN, Access::LOCAL_WRITE)?;
    let send = RegisteredBuffer::new(&res.pd, SEND_SLOTS * SEND_SLOT_LEN, Access::LOCAL_WRITE)?;
    // The Data-In and parameter-data buffers (9 MiB) are registered only
    // once the login succeeds: a peer that never logs in pins only these.
    let mut initial = Vec::with_capacity(rq_depth);
    for slot in 0..rq_depth {
        initial.push(recv_wr(&recv, slot)?);
    }
    id.post_recv(&initial)?;
    id.accept(&ConnParam {
        private_data: &[],
        responder_resources: offer
            .responder_resources
            .min(attrs.max_qp_rd_atom.min(255) as u8),
        initiator_depth: credits as u8,
        retry_count: 7,
        rnr_retry_count: 7,
    })?;
    let unknown = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
    let info = ConnInfo {
        local: id.local_addr().unwrap_or(unknown),
        peer: peer.unwrap_or(unknown),
    };
    tracing::info!(
        peer = %info.peer,
        initiator = ?offer.request.peer,
        read_credits = credits,
        "iSER connection accepted"
    );
    let control = Arc::new(IserControl {
        terminated: AtomicBool::new(false),
    });
    permit.watch(control.clone());
    let output_stall_timeout = portal.limits.output_stall_timeout;
    let conn = Connection::new_iser(portal, info, control.clone(), Instant::now(), RECV_DATA_LEN);
    let mut driver = Driver {
        id: &id,
        send_cq: &send_cq,
        recv_cq: &recv_cq,
        recv: &recv,
        pd: &res.pd,
        send,
        large: None,
        regions: &res.regions,
        conn,
        free_send: (0..SEND_SLOTS as u32).rev().collect(),
        free_datain: (0..DATAIN_SLOTS as u32).rev().collect(),
        free_bounce: (0..BOUNCE_SLOTS as u32).rev().collect(),
        reads: [None; MAX_READ_CREDITS],
        reads_in_flight: 0,
        credits,
        sq_in_flight: 0,
        sq_depth,
        held: None,
        reposts: [RecvWr {
            wr_id: WrId::default(),
            sge: verbs::Sge::default(),
        }; 32],
        n_reposts: 0,
        closing: None,
        peer_gone: false,
        hello_credits: credits as u16,
        permit,
        blocked_since: None,
        output_stall: output_stall_timeout,
    };
    let result = driver.run(&events, &comp, &control, opts);
    driver.conn.shutdown();
    let peer_gone = driver.peer_gone;
    // Kept past the QP's end, like `recv`.
    let buffers = (driver.send, driver.large);
    if !peer_gone {
        let _ = id.disconnect();
    }
    tracing::info!(peer = %info.peer, "iSER connection closed");
    // The QP goes first, then the buffers its requests named: the adapter
    // may still be writing into a posted receive until the QP is gone.
    id.destroy_qp();
    drop(buffers);
    drop(recv);
    drop(id);
    result
}

fn recv_wr(recv: &RegisteredBuffer, slot: usize) -> Result<RecvWr, ConnError> {
    let sge = recv
        .sge(slot * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)
        .ok_or_else(|| ConnError::Protocol("receive slot outside its buffer".into()))?;
    Ok(RecvWr {
        wr_id: WrId::new(wr::RECV, slot as u32),
        sge,
    })
}

#[derive(Debug, Clone, Copy)]
struct PendingRead {
    tag: u32,
    len: u32,
    bounce: Option<u32>,
}

enum Posted {
    Done,
    /// Out of a resource: retry once completions free it.
    Blocked(Action),
    Close,
}

/// The buffers only a logged-in connection needs.
struct LargeBuffers {
    /// Read data that is not LUN memory, RDMA-written from here.
    datain: RegisteredBuffer,
    /// Parameter data, RDMA-read into here.
    bounce: RegisteredBuffer,
}

impl LargeBuffers {
    fn new(pd: &Arc<ProtectionDomain>) -> Result<LargeBuffers, verbs::Error> {
        Ok(LargeBuffers {
            datain: RegisteredBuffer::new(pd, DATAIN_SLOTS * DATAIN_SLOT_LEN, Access::LOCAL_WRITE)?,
            bounce: RegisteredBuffer::new(pd, BOUNCE_SLOTS * BOUNCE_SLOT_LEN, Access::LOCAL_WRITE)?,
        })
    }
}

struct Driver<'a> {
    id: &'a CmId,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    recv: &'a RegisteredBuffer,
    pd: &'a Arc<ProtectionDomain>,
    send: RegisteredBuffer,
    /// Registered after login.
    large: Option<LargeBuffers>,
    regions: &'a [RdmaRegion],
    conn: Connection,
    free_send: Vec<u32>,
    free_datain: Vec<u32>,
    free_bounce: Vec<u32>,
    reads: [Option<PendingRead>; MAX_READ_CREDITS],
    reads_in_flight: usize,
    credits: usize,
    sq_in_flight: usize,
    sq_depth: usize,
    held: Option<Action>,
    reposts: [RecvWr; 32],
    n_reposts: usize,
    /// Set when the engine asked to close: wait for our SENDs until then.
    closing: Option<Instant>,
    peer_gone: bool,
    hello_credits: u16,
    /// Its place among the portal's connections.
    permit: Permit,
    /// Since when an action waits for a send slot or credit.
    blocked_since: Option<Instant>,
    /// A send that makes no progress this long ends the connection.
    output_stall: Duration,
}

impl Driver<'_> {
    fn run(
        &mut self,
        events: &EventChannel,
        comp: &CompletionChannel,
        control: &IserControl,
        opts: IserOptions,
    ) -> Result<(), ConnError> {
        let mut wcs = [WorkCompletion::default(); 32];
        let mut spin = SpinBudget::new(opts.spin);
        // The timers here are whole seconds: the coarse clock serves them
        // without a system call per round.
        let clock = CoarseClock::new();
        loop {
            let now = clock.now();
            // While output is blocked no receive is consumed: the peer's
            // messages wait in the receive queue (and then RNR-retry), so the
            // engine queues nothing more for a peer that takes nothing.
            let n = self.reap(now, &mut wcs, self.held.is_none())?;
            if self.conn.poll_timeout().is_some_and(|t| t <= now) {
                self.conn.handle_timeout(now);
            }
            if self.drain_actions()? || self.conn.is_closed() {
                self.closing.get_or_insert(now);
            }
            match (&self.held, self.blocked_since) {
                (Some(_), None) => self.blocked_since = Some(now),
                (None, Some(_)) => self.blocked_since = None,
                (Some(_), Some(since)) if now.duration_since(since) > self.output_stall => {
                    self.conn.portal().counters.limit_hit(LimitHit::OutputStall);
                    return Err(ConnError::Protocol(format!(
                        "no send completed for {:?}: the initiator takes nothing (posts no receives); closing",
                        self.output_stall
                    )));
                }
                _ => {}
            }
            if let Some(since) = self.closing {
                if self.sq_in_flight == 0 || now.duration_since(since) > CLOSE_GRACE {
                    return Ok(());
                }
            }
            if self.peer_gone || control.terminated.load(Ordering::Acquire) {
                return Ok(());
            }
            if spin.poll_again(n) {
                continue;
            }
            // Sleep. Receives always wake us; send-side completions only when
            // something waits for them (an RDMA READ, a held action, a close).
            let recv_armed = self.held.is_none();
            let send_armed =
                self.reads_in_flight > 0 || self.held.is_some() || self.closing.is_some();
            let (recv_cq, send_cq) = (self.recv_cq, self.send_cq);
            let armed_buf = [recv_cq, send_cq];
            let armed: &[&CompletionQueue] = match (recv_armed, send_armed) {
                (true, true) => &armed_buf,
                (true, false) => &armed_buf[..1],
                (false, true) => &armed_buf[1..],
                (false, false) => &[],
            };
            wait::arm(armed)?;
            if self.reap(now, &mut wcs, recv_armed)? > 0 {
                spin.reset();
                continue;
            }
            let timeout = self
                .conn
                .poll_timeout()
                .map(|t| t.saturating_duration_since(now))
                .unwrap_or(MAX_SLEEP)
                .min(MAX_SLEEP);
            let woken = wait::sleep(comp, armed, Some(events), Some(timeout))?;
            if woken.cm {
                self.cm_events(events);
            }
            spin.reset();
        }
    }

    /// Poll the completion queues once (the receive queue only when
    /// `receive`) and handle what they hold.
    fn reap(
        &mut self,
        now: Instant,
        wcs: &mut [WorkCompletion],
        receive: bool,
    ) -> Result<usize, ConnError> {
        let mut total = 0;
        for recv in [true, false] {
            if recv && !receive {
                continue;
            }
            let cq = if recv { self.recv_cq } else { self.send_cq };
            let n = cq.poll(wcs)?;
            for wc in &wcs[..n] {
                self.completion(now, wc)?;
            }
            total += n;
        }
        if self.n_reposts >= REPOST_BATCH {
            self.flush_reposts()?;
        }
        Ok(total)
    }

    fn cm_events(&mut self, events: &EventChannel) {
        loop {
            match events.get_event() {
                Ok(e) if e.kind.ends_connection() => {
                    tracing::info!(peer = %self.conn_peer(), "iSER: {:?}", e.kind);
                    self.peer_gone = true;
                }
                Ok(e) => tracing::debug!("iSER connection event {:?}", e.kind),
                Err(e) if e.source.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("iSER: {e}");
                    self.peer_gone = true;
                    return;
                }
            }
        }
    }

    fn conn_peer(&self) -> String {
        self.id
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into())
    }

    fn completion(&mut self, now: Instant, wc: &WorkCompletion) -> Result<(), ConnError> {
        let WrId { kind, slot } = wc.wr_id;
        let slot = slot as usize;
        if kind != wr::RECV {
            self.sq_in_flight = self.sq_in_flight.saturating_sub(1);
        }
        if !wc.is_ok() {
            // After a disconnect every posted request comes back flushed.
            self.peer_gone = true;
            return Err(ConnError::Protocol(format!(
                "work request failed: {} (opcode {:?}, vendor error {:#x})",
                wc.status_str(),
                wc.opcode,
                wc.vendor_err
            )));
        }
        match kind {
            wr::RECV => {
                if self.closing.is_none() {
                    self.received(now, slot, wc.byte_len as usize)?;
                }
                self.reposts[self.n_reposts] = recv_wr(self.recv, slot)?;
                self.n_reposts += 1;
                if self.n_reposts == self.reposts.len() {
                    self.flush_reposts()?;
                }
            }
            wr::SEND => self.free_send.push(slot as u32),
            wr::DATAIN => self.free_datain.push(slot as u32),
            wr::WRITE_STORE => {}
            wr::READ => {
                let Some(read) = self.reads.get_mut(slot).and_then(Option::take) else {
                    return Err(ConnError::Protocol(
                        "completion for an unknown RDMA READ".into(),
                    ));
                };
                self.reads_in_flight -= 1;
                match read.bounce {
                    Some(b) => {
                        let start = b as usize * BOUNCE_SLOT_LEN;
                        let Some(large) = &self.large else {
                            return Err(ConnError::Protocol("no parameter-data buffer".into()));
                        };
                        let Some(data) = large.bounce.bytes(start..start + read.len as usize)
                        else {
                            return Err(ConnError::Protocol("RDMA READ beyond its buffer".into()));
                        };
                        self.conn.handle_rdma_read_done(now, read.tag, data);
                        self.free_bounce.push(b);
                    }
                    None => self.conn.handle_rdma_read_done(now, read.tag, &[]),
                }
            }
            _ => {
                debug_assert!(wc.opcode != WcOpcode::Recv);
                return Err(ConnError::Protocol(format!(
                    "unknown work request {:?}",
                    wc.wr_id
                )));
            }
        }
        Ok(())
    }

    fn flush_reposts(&mut self) -> Result<(), ConnError> {
        if self.n_reposts > 0 {
            self.id.post_recv(&self.reposts[..self.n_reposts])?;
            self.n_reposts = 0;
        }
        Ok(())
    }

    /// One received message: an iSCSI PDU behind its iSER header, or a Hello.
    fn received(&mut self, now: Instant, slot: usize, len: usize) -> Result<(), ConnError> {
        let start = slot * RECV_SLOT_LEN;
        let Some(msg) = self.recv.bytes(start..start + len.min(RECV_SLOT_LEN)) else {
            return Err(ConnError::Protocol(
                "receive slot outside its buffer".into(),
            ));
        };
        let header = Header::decode(msg)
            .map_err(|e| ConnError::Protocol(format!("bad iSER header: {e}")))?;
        let (write, read) = match header {
            Header::Control { write, read } => (write, read),
            Header::Hello {
                max_ver, min_ver, ..
            } => {
                let reject = !(min_ver..=max_ver).contains(&VERSION);
                return self.send_hello_reply(reject);
            }
            Header::HelloReply { .. } => {
                return Err(ConnError::Protocol("HelloReply sent to a target".into()));
            }
        };
        let pdu = &msg[HEADER_LEN..];
        let Some(bhs_bytes) = pdu.get(..BHS_LEN) else {
            return Err(ConnError::Protocol(format!(
                "{len}-byte message holds no iSCSI header"
            )));
        };
        let mut raw = [0u8; BHS_LEN];
        raw.copy_from_slice(bhs_bytes);
        let bhs = Bhs(raw);
        let ahs_len = bhs.total_ahs_len();
        let data_len = bhs.data_segment_len() as usize;
        if bhs.data_segment_len() > self.conn.max_rx_data_segment() {
            self.conn.handle_oversized(now, &bhs);
            return Ok(());
        }
        // iSER carries the data segment unpadded right after the header(s).
        let Some(ahs) = pdu.get(BHS_LEN..BHS_LEN + ahs_len) else {
            return Err(ConnError::Protocol("AHS longer than the message".into()));
        };
        let data_start = BHS_LEN + ahs_len;
        let Some(data) = pdu.get(data_start..data_start + data_len) else {
            return Err(ConnError::Protocol(format!(
                "data segment of {data_len} bytes longer than the {len}-byte message"
            )));
        };
        self.conn.handle_iser_pdu(now, write, read, &bhs, ahs, data);
        if self.conn.is_logged_in() && self.large.is_none() {
            self.permit.logged_in();
            self.large = Some(LargeBuffers::new(self.pd)?);
        }
        Ok(())
    }

    fn send_hello_reply(&mut self, reject: bool) -> Result<(), ConnError> {
        let Some(slot) = self.free_send.pop() else {
            return Err(ConnError::Protocol(
                "no send slot for the HelloReply".into(),
            ));
        };
        let start = slot as usize * SEND_SLOT_LEN;
        let reply = Header::HelloReply {
            reject,
            max_ver: VERSION,
            cur_ver: VERSION,
            ord: self.hello_credits,
        };
        reply
            .encode_into(
                self.send
                    .bytes_mut(start..start + HEADER_LEN)
                    .ok_or_else(|| ConnError::Protocol("send slot outside its buffer".into()))?,
            )
            .map_err(|e| ConnError::Protocol(e.to_string()))?;
        self.post(
            WrId::new(wr::SEND, slot),
            SendOp::Send,
            Self::buffer_sge(&self.send, start, HEADER_LEN)?,
        )
    }

    fn buffer_sge(
        buf: &RegisteredBuffer,
        start: usize,
        len: usize,
    ) -> Result<verbs::Sge, ConnError> {
        buf.sge(start, len as u32)
            .ok_or_else(|| ConnError::Protocol("slot outside its buffer".into()))
    }

    /// Post one send-queue request. All are signaled: every completion frees
    /// a slot or a credit, and the send CQ wakes nobody unless armed.
    fn post(&mut self, wr_id: WrId, op: SendOp, sge: verbs::Sge) -> Result<(), ConnError> {
        self.id.post_send(&SendWr {
            wr_id,
            op,
            sge,
            signaled: true,
            inline: false,
        })?;
        self.sq_in_flight += 1;
        Ok(())
    }

    /// Post what the engine queued, in order; true when it asked to close.
    fn drain_actions(&mut self) -> Result<bool, ConnError> {
        loop {
            let Some(action) = self.held.take().or_else(|| self.conn.poll_action()) else {
                return Ok(false);
            };
            if self.sq_in_flight >= self.sq_depth {
                self.held = Some(action);
                return Ok(false);
            }
            match self.post_action(action)? {
                Posted::Done => {}
                Posted::Blocked(a) => {
                    self.held = Some(a);
                    return Ok(false);
                }
                Posted::Close => return Ok(true),
            }
        }
    }

    fn post_action(&mut self, action: Action) -> Result<Posted, ConnError> {
        match action {
            Action::Send(pdu) => self.post_pdu(pdu),
            Action::RdmaWrite {
                stag,
                remote_addr,
                data,
            } => self.post_rdma_write(stag, remote_addr, data),
            Action::RdmaRead {
                tag,
                stag,
                remote_addr,
                len,
                dest,
            } => self.post_rdma_read(tag, stag, remote_addr, len, dest),
            Action::Close => Ok(Posted::Close),
        }
    }

    fn post_pdu(&mut self, pdu: OutPdu) -> Result<Posted, ConnError> {
        let Some(slot) = self.free_send.pop() else {
            return Ok(Posted::Blocked(Action::Send(pdu)));
        };
        let start = slot as usize * SEND_SLOT_LEN;
        let Some(slot_buf) = self.send.bytes_mut(start..start + SEND_SLOT_LEN) else {
            self.free_send.push(slot);
            return Err(ConnError::Protocol("send slot outside its buffer".into()));
        };
        let total = match encode_pdu(&self.conn, &pdu, slot_buf) {
            Ok(n) => n,
            Err(e) => {
                self.free_send.push(slot);
                return Err(ConnError::Protocol(e));
            }
        };
        let sge = Self::buffer_sge(&self.send, start, total)?;
        self.post(WrId::new(wr::SEND, slot), SendOp::Send, sge)?;
        if let Some(served) = pdu.served {
            // A fresh reading: the loop's `now` may be rounds old.
            self.conn.served(served, metrics::clock().raw());
        }
        Ok(Posted::Done)
    }

    fn lun_sge(&self, lun: u64, offset: u64, len: u32) -> Result<verbs::Sge, ConnError> {
        self.conn
            .scsi_target()
            .and_then(|s| s.lu(lun))
            .and_then(|lu| {
                self.regions
                    .iter()
                    .find(|r| Arc::ptr_eq(r.store(), lu.volume().store()))
            })
            .and_then(|r| r.sge(offset, len))
            .ok_or_else(|| {
                ConnError::Protocol(format!(
                    "RDMA names LUN {lun} bytes {offset}+{len} outside a registered LUN"
                ))
            })
    }

    fn post_rdma_write(
        &mut self,
        stag: u32,
        remote_addr: u64,
        data: OutData,
    ) -> Result<Posted, ConnError> {
        let op = SendOp::RdmaWrite {
            remote_addr,
            rkey: stag,
        };
        match data {
            OutData::None => Ok(Posted::Done),
            OutData::Store { lun, offset, len } => {
                let sge = self.lun_sge(lun, offset, len)?;
                self.post(WrId::new(wr::WRITE_STORE, 0), op, sge)?;
                Ok(Posted::Done)
            }
            OutData::Owned(v) => {
                if v.len() > DATAIN_SLOT_LEN {
                    return Err(ConnError::Protocol(format!(
                        "{} bytes of read data exceed the {DATAIN_SLOT_LEN}-byte staging slot",
                        v.len()
                    )));
                }
                let Some(slot) = self.free_datain.pop() else {
                    return Ok(Posted::Blocked(Action::RdmaWrite {
                        stag,
                        remote_addr,
                        data: OutData::Owned(v),
                    }));
                };
                let start = slot as usize * DATAIN_SLOT_LEN;
                let Some(large) = self.large.as_mut() else {
                    return Err(ConnError::Protocol("Data-In before login".into()));
                };
                let Some(dst) = large.datain.bytes_mut(start..start + v.len()) else {
                    return Err(ConnError::Protocol(
                        "Data-In slot outside its buffer".into(),
                    ));
                };
                dst.copy_from_slice(&v);
                let sge = Self::buffer_sge(&large.datain, start, v.len())?;
                self.post(WrId::new(wr::DATAIN, slot), op, sge)?;
                Ok(Posted::Done)
            }
        }
    }

    fn post_rdma_read(
        &mut self,
        tag: u32,
        stag: u32,
        remote_addr: u64,
        len: u32,
        dest: ReadDest,
    ) -> Result<Posted, ConnError> {
        let blocked = Action::RdmaRead {
            tag,
            stag,
            remote_addr,
            len,
            dest,
        };
        if self.reads_in_flight >= self.credits {
            return Ok(Posted::Blocked(blocked));
        }
        let Some(read_slot) = self.reads.iter().position(Option::is_none) else {
            return Ok(Posted::Blocked(blocked));
        };
        let (sge, bounce) = match dest {
            ReadDest::Store { lun, offset } => (self.lun_sge(lun, offset, len)?, None),
            ReadDest::Buffer => {
                if len as usize > BOUNCE_SLOT_LEN {
                    return Err(ConnError::Protocol(format!(
                        "{len}-byte parameter data exceeds the {BOUNCE_SLOT_LEN}-byte buffer"
                    )));
                }
                let Some(b) = self.free_bounce.pop() else {
                    return Ok(Posted::Blocked(blocked));
                };
                let Some(large) = &self.large else {
                    return Err(ConnError::Protocol("parameter data before login".into()));
                };
                let sge =
                    Self::buffer_sge(&large.bounce, b as usize * BOUNCE_SLOT_LEN, len as usize)?;
                (sge, Some(b))
            }
        };
        self.post(
            WrId::new(wr::READ, read_slot as u32),
            SendOp::RdmaRead {
                remote_addr,
                rkey: stag,
            },
            sge,
        )?;
        self.reads[read_slot] = Some(PendingRead { tag, len, bounce });
        self.reads_in_flight += 1;
        Ok(Posted::Done)
    }
}

/// Encode one PDU as an iSER message (header, BHS, unpadded data) into
/// `out`; returns its length. Errors say why it cannot be sent: larger than
/// `out` (the 16 KiB iSER message), or LUN bytes that cannot be read — then
/// nothing must be sent in their place.
pub fn encode_pdu(conn: &Connection, pdu: &OutPdu, out: &mut [u8]) -> Result<usize, String> {
    let total = HEADER_LEN + BHS_LEN + pdu.data.len();
    let Some(msg) = out.get_mut(..total) else {
        return Err(format!(
            "{:?} PDU of {total} bytes exceeds the {}-byte iSER message",
            pdu.bhs.opcode(),
            out.len()
        ));
    };
    Header::PLAIN.encode_into(msg).map_err(|e| e.to_string())?;
    msg[HEADER_LEN..HEADER_LEN + BHS_LEN].copy_from_slice(&pdu.bhs.0);
    let data = &mut msg[HEADER_LEN + BHS_LEN..];
    match &pdu.data {
        OutData::None => {}
        OutData::Owned(v) => data.copy_from_slice(v),
        OutData::Store { lun, offset, .. } => {
            if !conn.read_store(*lun, *offset, data) {
                return Err("PDU names bytes outside the LUN".into());
            }
        }
    }
    Ok(total)
}
