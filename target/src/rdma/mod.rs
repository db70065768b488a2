//! iSER: the RDMA transport driver around the sans-IO engine.
//!
//! One rdma_cm listener thread accepts connect requests on every portal
//! address that belongs to an RDMA device. Each connection then runs on its
//! own thread, which owns its QP, completion queue, receive and send buffers
//! and its engine `Connection`: it polls the CQ (spinning for a configurable
//! number of empty polls before sleeping on the completion channel), feeds
//! received PDUs and finished RDMA READs to the engine, and turns the engine's
//! actions into SENDs, RDMA WRITEs from LUN memory and RDMA READs into it.
//! A connection registers a few receive and send slots at connect time and
//! its full rings and large buffers when its normal session begins (see
//! `slots`); the I/O path neither allocates nor locks nor copies payload
//! (immediate data excepted: it arrives in a receive buffer; and the small
//! parameter data and non-LUN read data, copied in and out of their
//! registered buffers).
//!
//! Work requests are posted in the order the engine queued its actions, so an
//! RDMA WRITE of read data always precedes the SCSI Response that follows it.
//! When a resource runs short (send slots, RDMA READ credits), the action is
//! held and everything behind it waits: order is never traded for speed.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::iser::{
    self, peer, CmPeer, CmRequest, Header, IserError, Message, HEADER_LEN, VERSION,
};
use ramslog_common::verbs::wait::{self, SpinBudget};
use ramslog_common::verbs::{
    self, Access, CmEvent, CmEventKind, CmId, CompletionChannel, CompletionQueue, ConnParam,
    Device, EventChannel, ProtectionDomain, QpCaps, RegisteredBuffer, SendOp, SendWr, Slot,
    WcOpcode, WorkCompletion, WrId,
};

use crate::admission::Transfers;
use crate::admission::{Door, Link, Permit, SessionControl};
use crate::clock::CoarseClock;
use crate::iscsi::engine::{
    Action, ConnInfo, Connection, Event, Input, IserPeer, OutData, OutPdu, ReadDest,
    ISER_BUFFERED_READ_MAX,
};
use crate::iscsi::portal::Portal;
use crate::metrics::LimitHit;
use crate::store::RdmaRegion;
use crate::volume::VolumeId;

/// Data segment room of each receive buffer: our TargetRecvDataSegmentLength
/// (and MaxRecvDataSegmentLength for the illumos initiator).
pub const RECV_DATA_LEN: u32 = 8192;
/// iSER header + BHS + the largest AHS + the data segment, rounded up.
const RECV_SLOT_LEN: usize = 10 * 1024;
/// Receives posted per connection: the command window plus room for
/// unsolicited Data-Out, NOP-Outs and task management.
const RECV_SLOTS: usize = 320;
/// Receives posted while a connection logs in or holds a discovery session:
/// one PDU at a time each way, plus the pings and a logout.
const LOGIN_RECV_SLOTS: usize = 8;
/// The illumos initiator receives into fixed 16 KiB messages: nothing we
/// SEND is ever larger.
const SEND_SLOT_LEN: usize = peer::ILLUMOS_MSG_LEN;
const SEND_SLOTS: usize = 256;
/// Send slots before a normal session begins: a login response, a Text
/// response, a ping and an Async Message at once, at most.
const LOGIN_SEND_SLOTS: usize = 4;
/// How long a new iSER connection waits for login slots while evicted
/// connections are torn down, before it is refused.
const LOGIN_SLOTS_PATIENCE: Duration = Duration::from_secs(5);
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

mod driver;
mod reads;
mod slots;

pub use driver::encode_pdu;
use driver::Driver;
use reads::{PendingRead, ReadTable};
use slots::SlotRing;

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
    if let Some(listening) = Listening::on(listen) {
        listening.serve(portal, opts);
    }
}

/// The iSER listeners, bound and listening, their connection requests not
/// yet taken. A restarted program listens before it takes over the memory:
/// a host that reconnects meanwhile waits in the queue (the kernel answers
/// its request with "message received, reply later") instead of being
/// refused and retrying seconds later.
pub struct Listening {
    channel: EventChannel,
    listeners: Vec<Listener>,
}

impl Listening {
    /// Listen on every address of `listen` that has an RDMA device; `None`
    /// (logged) when there is none.
    pub fn on(listen: &[SocketAddr]) -> Option<Listening> {
        match verbs::device_count() {
            Ok(0) => {
                tracing::info!("iSER: no RDMA device; serving iSCSI/TCP only");
                return None;
            }
            Err(e) if e.is_no_rdma() => {
                tracing::info!(
                    "iSER: this kernel has no RDMA support ({e}); serving iSCSI/TCP only"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!("iSER disabled: {e}; serving iSCSI/TCP only");
                return None;
            }
            Ok(_) => {}
        }
        let channel = match EventChannel::new().and_then(|c| c.set_nonblocking(true).map(|()| c)) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("iSER disabled: {e}; serving iSCSI/TCP only");
                return None;
            }
        };
        let mut listeners = Vec::new();
        for addr in listen {
            match listen_on(&channel, *addr) {
                Ok(id) => {
                    tracing::info!("iSER listening on {addr}");
                    listeners.push(Listener {
                        addr: *addr,
                        id: Some(id),
                        gone_since: None,
                    });
                }
                Err(e) => tracing::warn!(
                    "iSER: not listening on {addr}: {e} (no RDMA device has this address; iSCSI/TCP still serves it)"
                ),
            }
        }
        if listeners.is_empty() {
            return None;
        }
        Some(Listening { channel, listeners })
    }

    /// Take the connection requests (those queued first) and serve them.
    pub fn serve(self, portal: Arc<Portal>, opts: IserOptions) {
        let Listening { channel, listeners } = self;
        let spawned = std::thread::Builder::new()
            .name("iser-cm".into())
            .spawn(move || listen_loop(channel, listeners, portal, opts));
        if let Err(e) = spawned {
            tracing::warn!("iSER disabled: cannot start its thread: {e}");
        }
    }
}

/// How often the listener looks for removed devices (their removal waits
/// for us to let go of them) and tries again to listen on addresses whose
/// device went away.
const DEVICE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// A portal address the listener serves, and its rdma_cm id while the
/// address has a device under it.
struct Listener {
    addr: SocketAddr,
    id: Option<CmId>,
    /// When its device was removed (the id is then gone).
    gone_since: Option<Instant>,
}

fn listen_on(channel: &EventChannel, addr: SocketAddr) -> Result<CmId, verbs::Error> {
    let id = CmId::new(channel)?;
    id.bind(addr)?;
    id.listen(64)?;
    Ok(id)
}

/// What one RDMA device shares between its connections: the protection
/// domain and every volume registered once (`regions[i]` for `VolumeId`
/// i, see [`LunRegistration`]). The entry holds the device open; it leaves the cache when the
/// device is removed, and the device closes once the connections that still
/// hold the entry have ended.
struct DeviceResources {
    device: Device,
    pd: Arc<ProtectionDomain>,
    regions: Vec<LunRegistration>,
}

/// A LUN's memory registered with one device: at the device's first use
/// when the memory is resident, at the LUN's first transfer when
/// accept-empty made it resident later (a NOT READY LUN's memory is not
/// taken, so it cannot be registered at start).
pub(super) struct LunRegistration {
    store: Arc<crate::store::Store>,
    region: std::sync::OnceLock<RdmaRegion>,
}

impl LunRegistration {
    fn new(
        store: &Arc<crate::store::Store>,
        pd: &Arc<ProtectionDomain>,
    ) -> Result<LunRegistration, verbs::Error> {
        let region = std::sync::OnceLock::new();
        if store.is_resident() {
            let _ = region.set(store.register_rdma(pd)?);
        }
        Ok(LunRegistration {
            store: store.clone(),
            region,
        })
    }

    /// The registration, made now if the memory became resident since;
    /// `None` while it is not (nothing transfers to a NOT READY LUN).
    pub(super) fn region(&self, pd: &Arc<ProtectionDomain>) -> Option<&RdmaRegion> {
        if let Some(r) = self.region.get() {
            return Some(r);
        }
        if !self.store.is_resident() {
            return None;
        }
        let started = std::time::Instant::now();
        match self.store.register_rdma(pd) {
            // Two connections may race here: the loser's region is dropped
            // (deregistered) and both use the winner's.
            Ok(r) => {
                if self.region.set(r).is_ok() {
                    tracing::info!(
                        bytes = self.store.len(),
                        ms = started.elapsed().as_secs_f64() * 1e3,
                        "iSER: LUN memory made resident by accept-empty registered with the RDMA device"
                    );
                }
                self.region.get()
            }
            Err(e) => {
                tracing::error!("iSER: cannot register LUN memory with the RDMA device: {e}");
                None
            }
        }
    }
}

fn device_resources(
    cache: &mut Vec<Arc<DeviceResources>>,
    dev: Device,
    portal: &Portal,
) -> Result<Arc<DeviceResources>, verbs::Error> {
    if let Some(r) = cache.iter().find(|r| r.device == dev) {
        return Ok(r.clone());
    }
    let pd = ProtectionDomain::new(&dev)?;
    // Registration pins and maps every page for the device: the part of a
    // start (and of a restart that keeps the memory) that grows with the
    // LUNs' size, so the log says how long it took.
    let started = std::time::Instant::now();
    let regions = portal
        .core
        .volumes
        .iter()
        .map(|v| LunRegistration::new(v.store(), &pd))
        .collect::<Result<Vec<_>, _>>()?;
    tracing::info!(
        device = %dev.name(),
        luns = regions.len(),
        bytes = portal
            .core
            .volumes
            .iter()
            .filter(|v| v.store().is_resident())
            .map(|v| v.store().len())
            .sum::<u64>(),
        ms = started.elapsed().as_secs_f64() * 1e3,
        "iSER: LUN memory registered with the RDMA device"
    );
    let r = Arc::new(DeviceResources {
        device: dev,
        pd,
        regions,
    });
    cache.push(r.clone());
    Ok(r)
}

/// Drop the cache entries of removed devices, so that a device added back
/// is registered afresh and the removed one can close.
fn forget_removed_devices(cache: &mut Vec<Arc<DeviceResources>>) {
    cache.retain(|r| match r.device.is_removed() {
        Ok(false) => true,
        Ok(true) => {
            tracing::warn!(
                device = %r.device.name(),
                "iSER: RDMA device removed; its LUN registrations are released as its connections end"
            );
            false
        }
        Err(e) => {
            tracing::warn!("iSER: cannot list RDMA devices: {e}");
            true
        }
    });
}

fn listen_loop(
    channel: EventChannel,
    mut listeners: Vec<Listener>,
    portal: Arc<Portal>,
    opts: IserOptions,
) {
    let mut devices = Vec::new();
    register_listening_devices(&listeners, &mut devices, &portal);
    let mut last_check = Instant::now();
    loop {
        if last_check.elapsed() >= DEVICE_CHECK_INTERVAL {
            last_check = Instant::now();
            // A removed device nothing of ours holds closes now, one we hold
            // once the connections on it end.
            if let Err(e) = verbs::rescan_devices() {
                tracing::debug!("iSER: cannot list RDMA devices: {e}");
            }
            forget_removed_devices(&mut devices);
            if listen_again(&channel, &mut listeners) {
                register_listening_devices(&listeners, &mut devices, &portal);
            }
        }
        let event = match channel.get_event() {
            Ok(e) => e,
            Err(e) if e.is_would_block() => {
                let mut ready = [false];
                if let Err(e) =
                    verbs::wait_readable(&[channel.fd()], Some(DEVICE_CHECK_INTERVAL), &mut ready)
                {
                    tracing::warn!("iSER: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
            Err(e) => {
                tracing::warn!("iSER: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        match event.kind {
            CmEventKind::ConnectRequest => accept_request(event, &mut devices, &portal, opts),
            CmEventKind::DeviceRemoval => {
                // librdmacm closes a removed device once no id or handle
                // is left on it: ours go now, the listener's included.
                for l in listeners.iter_mut() {
                    if l.id.as_ref().is_some_and(|id| id.raw_handle() == event.id) {
                        if let Some(id) = l.id.take() {
                            devices.retain(|r| !id.is_on(&r.device));
                        }
                        l.gone_since = Some(Instant::now());
                        tracing::warn!(
                            "iSER: the RDMA device under {} was removed; listening there again once it is back (iSCSI/TCP still serves it)",
                            l.addr
                        );
                    }
                }
                forget_removed_devices(&mut devices);
            }
            kind => tracing::debug!("iSER listener: {kind:?} (status {})", event.status),
        }
    }
}

/// Listen again on addresses whose device was removed, once it is back;
/// true when one listens again.
fn listen_again(channel: &EventChannel, listeners: &mut [Listener]) -> bool {
    let mut again = false;
    for l in listeners.iter_mut().filter(|l| l.id.is_none()) {
        match listen_on(channel, l.addr) {
            Ok(id) => {
                let after = l.gone_since.map_or(0, |t| t.elapsed().as_secs());
                tracing::info!(
                    "iSER listening on {} again ({after} s after its device went away)",
                    l.addr
                );
                l.id = Some(id);
                l.gone_since = None;
                again = true;
            }
            Err(e) => tracing::debug!("iSER: not yet listening on {} again: {e}", l.addr),
        }
    }
    again
}

/// Register the LUN memory with the device under each listener now rather
/// than at its first connect request: after a planned restart the hosts come
/// back after the notice's Time2Wait, and registration (pinning every page
/// for the device) would otherwise sit in their login. A listener bound to
/// a wildcard address has no device yet; a failure here is logged and the
/// first connect request on that device tries again (and is refused if it
/// fails again).
fn register_listening_devices(
    listeners: &[Listener],
    devices: &mut Vec<Arc<DeviceResources>>,
    portal: &Portal,
) {
    for id in listeners.iter().filter_map(|l| l.id.as_ref()) {
        let Ok(dev) = id.device() else { continue };
        if let Err(e) = device_resources(devices, dev, portal) {
            tracing::warn!(
                "iSER: cannot register the LUN memory with the device yet: {e}; trying again at the first connection"
            );
        }
    }
}

fn accept_request(
    event: CmEvent,
    devices: &mut Vec<Arc<DeviceResources>>,
    portal: &Arc<Portal>,
    opts: IserOptions,
) {
    let CmEvent {
        new_id,
        private_data,
        responder_resources,
        initiator_depth,
        ..
    } = event;
    let Some(id) = new_id else { return };
    let peer = id.peer_addr();
    let source = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.ip());
    let permit = match portal.core.gate.admit(source, Door::iscsi(Link::Rdma)) {
        Ok(p) => p,
        Err(why) => {
            let shown = peer.map_or_else(|| "?".to_string(), |p| p.to_string());
            portal
                .core
                .gate
                .log_refusal(format_args!("iSER {shown}"), why);
            let _ = id.reject(&[]);
            return;
        }
    };
    let request = CmRequest::parse(&private_data);
    let offer = Offer {
        request,
        responder_resources,
        initiator_depth,
    };
    match prepare(&id, devices, portal) {
        Ok((res, events)) => {
            let portal = portal.clone();
            let spawned = std::thread::Builder::new()
                .name("iser-conn".into())
                .spawn(move || {
                    if let Err(e) = run_connection(id, events, res, portal, opts, offer, permit) {
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
    devices: &mut Vec<Arc<DeviceResources>>,
    portal: &Portal,
) -> Result<(Arc<DeviceResources>, EventChannel), verbs::Error> {
    let dev = id.device()?;
    let res = device_resources(devices, dev, portal)?;
    let events = EventChannel::new()?;
    id.migrate(&events)?;
    events.set_nonblocking(true)?;
    Ok((res, events))
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
    let dev = &res.device;
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
    // What a connection nobody admitted pins is bounded across all of
    // them, including those evicted and still tearing down.
    if let Err(why) = permit.reserve_login_slots(LOGIN_SLOTS_PATIENCE) {
        portal.core.gate.log_refusal(
            format_args!(
                "iSER {}",
                peer.map_or_else(|| "?".to_string(), |p| p.to_string())
            ),
            why,
        );
        let _ = id.reject(&[]);
        return Err(ConnError::Protocol(format!("refused: {why}")));
    }
    let sq_depth = (LOGIN_SEND_SLOTS + SEND_SLOTS + DATAIN_SLOTS + MAX_READ_CREDITS + 256)
        .min(attrs.max_qp_wr as usize);
    // Room for the full ring while the last login receives are still posted.
    let rq_depth = (LOGIN_RECV_SLOTS + RECV_SLOTS).min(attrs.max_qp_wr as usize);
    let full_recv_slots = rq_depth.saturating_sub(LOGIN_RECV_SLOTS);
    if full_recv_slots == 0 {
        let _ = id.reject(&[]);
        return Err(ConnError::Protocol(format!(
            "the device allows {} receives per queue pair; iSER needs more",
            attrs.max_qp_wr
        )));
    }
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
    // The full rings, Data-In and parameter-data buffers (16 MiB) are
    // registered only once a normal session begins.
    let (mut recv, receives) =
        SlotRing::new(&res.pd, wr::RECV, RECV_SLOT_LEN, LOGIN_RECV_SLOTS as u32)?;
    let (send, free_send) =
        SlotRing::new(&res.pd, wr::SEND, SEND_SLOT_LEN, LOGIN_SEND_SLOTS as u32)?;
    recv.flush(&id, receives)?;
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
    let control = SessionControl::with_wake_fd();
    permit.watch(control.clone());
    let output_stall_timeout = portal.core.limits.output_stall_timeout;
    let conn = Connection::iser(
        portal,
        info,
        control.clone(),
        Instant::now(),
        RECV_DATA_LEN,
        offer.request.peer,
    );
    let mut driver = Driver {
        id: &id,
        send_cq: &send_cq,
        recv_cq: &recv_cq,
        free_send,
        recv,
        full_recv_slots,
        pd: &res.pd,
        send,
        large: None,
        regions: &res.regions,
        conn,
        free_datain: (0..DATAIN_SLOTS as u32).rev().collect(),
        free_bounce: (0..BOUNCE_SLOTS as u32).rev().collect(),
        reads: ReadTable::new(credits),
        sq_in_flight: 0,
        sq_depth,
        held: None,
        closing: None,
        peer_gone: false,
        hello_credits: credits as u16,
        _permit: permit,
        blocked_since: None,
        output_stall: output_stall_timeout,
        transfers: None,
    };
    let result = driver.run(&events, &comp, &control, opts);
    driver.conn.handle(Instant::now(), Input::Closed);
    let unfinished_reads = driver.reads_into_lun();
    let transfers = driver.transfers.take();
    let peer_gone = driver.peer_gone;
    // Kept past the QP's end: the adapter may still be writing into a
    // posted receive until the QP is gone.
    let buffers = (driver.recv, driver.send, driver.large);
    if !peer_gone {
        let _ = id.disconnect();
    }
    tracing::info!(peer = %info.peer, "iSER connection closed");
    // The QP goes first, then the buffers its requests named: the adapter
    // may still be writing into a posted receive until the QP is gone.
    id.destroy_qp();
    if let Some(t) = transfers {
        for _ in 0..unfinished_reads {
            t.end();
        }
    }
    drop(buffers);
    drop(id);
    result
}
