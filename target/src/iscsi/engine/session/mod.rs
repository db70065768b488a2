//! Full feature phase: SCSI commands and their data, NOP, task management,
//! text (SendTargets), logout.

mod aborts;
mod command;
mod control;
mod datapath;
mod write;

use datapath::{DataPath, Fetch};
use write::DataOutPayload;

use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::{Bhs, Opcode, RejectReason, RESERVED_TAG};
use ramslog_common::lun::Lun;
use ramslog_common::scsi_wire::Sense;
use ramslog_common::serial;

use super::login::{Login, SessionKind};
use super::params::Params;
use super::{is_reserved, rejected_header, ConnInfo, Out, OutData, OutPdu, RemoteBuffers};
use crate::admission::SessionControl;
use crate::admission::Transfers;
use crate::iscsi::portal::{OpenSessionError, OpenedSession, Portal, SessionKey};
use crate::metrics::{self, CommandKind, Served, SessionMetrics};
use crate::scsi::{Nexus, NexusId, Plan, ScsiTarget};
use crate::volume::{PlacingWrite, VolumeId};
use aborts::Deferred;
pub use aborts::ABORT_CUT_OFF;

/// Largest RDMA READ into the iSER driver's own buffer (parameter lists and
/// compare data the SCSI device must see whole): the driver's bounce slots.
pub const ISER_BUFFERED_READ_MAX: u32 = 4 << 20;

/// Largest Data-In segment sent over TCP, whatever the initiator accepts:
/// it bounds the bytes one PDU makes the driver hold.
const DATA_IN_SEGMENT_MAX: u32 = 256 * 1024;

/// Staging buffers up to this capacity are kept for reuse; larger ones are freed.
const POOLED_BUFFER_MAX: usize = 1 << 20;
/// How many such buffers a session keeps.
const SPARE_BUFFERS: usize = 8;

pub(super) enum Flow {
    Continue,
    PingAnswered,
    Close,
}

/// One data sequence the initiator is sending: the unsolicited one or the
/// answer to one R2T. PDUs must come in order (DataPDUInOrder=Yes); a PDU
/// out of order breaks the sequence, which still ends only with its F bit.
#[derive(Debug, Clone, Copy)]
struct Sequence {
    /// Offset of the next byte expected.
    next: u32,
    /// The sequence may not go past this offset.
    end: u32,
    next_datasn: u32,
    broken: bool,
}

impl Sequence {
    fn new(start: u32, end: u32) -> Sequence {
        Sequence {
            next: start,
            end,
            next_datasn: 0,
            broken: false,
        }
    }

    /// Whether a PDU continues the sequence exactly; advances it if so.
    fn take(&mut self, offset: u32, len: u32, datasn: u32) -> bool {
        let fits = !self.broken
            && datasn == self.next_datasn
            && offset == self.next
            && u64::from(offset) + u64::from(len) <= u64::from(self.end);
        if fits {
            self.next += len;
            self.next_datasn = datasn.wrapping_add(1);
        } else {
            self.broken = true;
        }
        fits
    }
}

/// One outstanding R2T: the burst [offset, seq.end).
#[derive(Debug, Clone, Copy)]
struct R2t {
    ttt: u32,
    seq: Sequence,
}

/// Why a write-direction command will fail once its data transfer is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteFailure {
    /// A data sequence broke the rules (ABORTED COMMAND, DATA PHASE ERROR).
    DataPhase,
    /// Data failed its digest (ABORTED COMMAND, PROTOCOL SERVICE CRC ERROR).
    Digest,
    /// Data could not be placed (HARDWARE ERROR).
    Placement,
}

/// A write-direction command waiting for its data.
///
/// Which byte ranges arrived is structural, never a count: the unsolicited
/// sequence covers [0, its end), each R2T one disjoint burst after it, and
/// each sequence only grows by exactly its next bytes. The write is whole
/// when the unsolicited sequence ended, every solicited range was asked for,
/// and every burst ended complete.
struct Task {
    itt: u32,
    lun: Lun,
    plan: Plan,
    /// Bytes of data-out the command consumes: min(EDTL, CDB transfer length).
    moved: u32,
    /// Bytes the initiator may send: its ExpectedDataTransferLength.
    edtl: u32,
    /// Immediate data and unsolicited Data-Out; `None` once it ended.
    unsolicited: Option<Sequence>,
    /// Next offset not yet covered by unsolicited data or solicited.
    solicit_next: u32,
    fetch: Fetch,
    /// Data the SCSI device must see whole before acting (parameter lists,
    /// compare data): gathered here. LUN writes go straight to the LUN.
    buf: Vec<u8>,
    /// Bytes of the daemon's staging budget this task holds.
    staged: u64,
    /// Set once the command is bound to fail; its status waits until no
    /// sequence of it is open and no RDMA READ of it is in flight, because
    /// after the status the initiator may reuse the ITT.
    failure: Option<WriteFailure>,
    /// A non-immediate command: it holds a slot of the command window.
    in_window: bool,
    counting: Counting,
    /// The page checksums' claim of a write into the LUN: dropped with the
    /// task, however it ends (`volume::PlacingWrite`).
    _placing: PlacingWrite,
}

/// How the command whose status is being produced is counted. Every entry
/// point that can end a command sets it first (a task keeps its own copy).
/// Sixteen bytes: tasks carry a copy, and they are moved by value.
#[derive(Debug, Clone, Copy)]
struct Counting {
    /// `metrics::clock()`'s raw reading when the command arrived.
    arrived: u64,
    /// Data bytes the command moves if it succeeds.
    bytes: u32,
    /// The LU's counters; `NO_SLOT` for a LUN the target lacks.
    slot: u16,
    kind: CommandKind,
}

const NO_SLOT: u16 = u16::MAX;

impl Counting {
    const NONE: Counting = Counting {
        arrived: 0,
        bytes: 0,
        slot: NO_SLOT,
        kind: CommandKind::Other,
    };
}

impl Task {
    /// Nothing of this task can still arrive.
    fn transfer_quiet(&self) -> bool {
        self.unsolicited.is_none() && self.fetch.idle()
    }

    fn fail(&mut self, why: WriteFailure) {
        self.failure.get_or_insert(why);
    }
}

pub(super) struct Session {
    portal: Arc<Portal>,
    pub tsih: u16,
    pub params: Params,
    /// How data moves on this transport, chosen once at the start.
    data_path: DataPath,
    kind: SessionKind,
    nexus: NexusId,
    scsi: Option<Arc<ScsiTarget>>,
    target_name: Option<String>,
    initiator_name: String,
    cid: u16,
    info: ConnInfo,
    cmd_window: u32,
    exp_cmdsn: u32,
    /// Non-immediate commands accepted and not yet answered.
    waiting_in_window: u32,
    max_cmdsn_sent: Cell<u32>,
    tasks: Vec<Task>,
    /// Staging buffers kept for reuse; their capacity stays taken from the
    /// daemon's staging budget (`pooled_bytes`) until used or freed.
    spare_bufs: Vec<Vec<u8>>,
    pooled_bytes: u64,
    data_in: Vec<u8>,
    next_ttt: u32,
    ping_ttt: Option<u32>,
    text_rx: Vec<u8>,
    text_tx: Option<(u32, Vec<u8>)>,
    ended: bool,
    /// iSER: the tag the next RDMA READ gets (never 0), so its completion
    /// finds its task.
    next_rdma_tag: u32,
    metrics: SessionMetrics,
    counting: Counting,
    /// Service times are measured (`Portal::service_times`).
    timed: bool,
    /// Its transfers into LUN memory (see `admission::Transfers`).
    transfers: Arc<Transfers>,
    /// Abort answers waiting for transfers, oldest first.
    deferred: Vec<Deferred>,
    /// The time of the input being handled.
    now: Instant,
}

impl Session {
    pub fn start(
        portal: &Arc<Portal>,
        login: Login,
        info: ConnInfo,
        control: Arc<SessionControl>,
        cmdsn: u32,
    ) -> Result<(Session, Vec<Arc<SessionControl>>), OpenSessionError> {
        let initiator_name = login.initiator_name.clone().unwrap_or_default();
        // A discovery session belongs to no target, whatever TargetName it
        // named: it must never take a normal session's key.
        let target = match login.kind {
            SessionKind::Normal => login.target.and_then(|t| portal.targets.get(t)),
            SessionKind::Discovery => None,
        };
        let target_name = target.map(|t| t.name.clone());
        let key = SessionKey {
            initiator: initiator_name.clone(),
            isid: login.isid(),
            target: target_name.clone().unwrap_or_default(),
        };
        let discovery = login.kind == SessionKind::Discovery;
        let OpenedSession {
            tsih,
            nexus,
            replaced,
        } = portal.open_session(key, discovery, info.peer, control.clone())?;
        let transfers = Transfers::new(control);
        let scsi = target.map(|t| t.scsi.clone());
        let metrics = match &scsi {
            Some(scsi) => SessionMetrics::join(scsi.luns().map(|lu| lu.volume().metrics().clone())),
            None => SessionMetrics::default(),
        };
        if let Some(scsi) = &scsi {
            scsi.attach(&Nexus {
                id: nexus,
                initiator_name: initiator_name.clone(),
                isid: login.isid(),
                transfers: transfers.clone(),
            });
        }
        tracing::info!(
            peer = %info.peer,
            initiator = %initiator_name,
            target = target_name.as_deref().unwrap_or("(discovery)"),
            tsih,
            "session started"
        );
        let window = portal.limits.cmd_window.max(1);
        let mut params = login.params.clone();
        let data_path = DataPath::of(&params);
        data_path.settle(&mut params, login.kind);
        let session = Session {
            portal: portal.clone(),
            tsih,
            params,
            data_path,
            kind: login.kind,
            nexus,
            scsi,
            target_name,
            initiator_name,
            cid: login.cid(),
            info,
            cmd_window: window,
            exp_cmdsn: cmdsn,
            waiting_in_window: 0,
            // What the login response advertised.
            max_cmdsn_sent: Cell::new(cmdsn.wrapping_add(window - 1)),
            tasks: Vec::with_capacity(window as usize + 8),
            spare_bufs: Vec::new(),
            pooled_bytes: 0,
            data_in: Vec::with_capacity(4096),
            next_ttt: 1,
            ping_ttt: None,
            text_rx: Vec::new(),
            text_tx: None,
            ended: false,
            next_rdma_tag: 1,
            metrics,
            counting: Counting::NONE,
            timed: portal.core.service_times,
            transfers,
            deferred: Vec::new(),
            now: Instant::now(),
        };
        Ok((session, replaced))
    }

    /// Release the session: the I_T nexus is lost.
    pub fn end(mut self: Box<Self>) {
        self.ended = true;
        for task in std::mem::take(&mut self.tasks) {
            self.portal.core.staging.release(task.staged);
        }
        self.spare_bufs.clear();
        self.portal
            .core
            .staging
            .release(std::mem::take(&mut self.pooled_bytes));
        if let Some(scsi) = &self.scsi {
            scsi.detach(self.nexus);
        }
        self.portal.close_session(self.tsih, self.nexus);
        tracing::info!(peer = %self.info.peer, initiator = %self.initiator_name, tsih = self.tsih, "session ended");
    }

    /// MaxCmdSN = ExpCmdSN + window − 1 − (non-immediate commands not yet
    /// answered). ExpCmdSN advances as commands arrive, so without the
    /// subtraction the window would never shut and a peer could queue
    /// without bound.
    fn max_cmdsn(&self) -> u32 {
        let open = self.cmd_window.saturating_sub(self.waiting_in_window);
        self.exp_cmdsn.wrapping_add(open).wrapping_sub(1)
    }

    /// Remember the highest MaxCmdSN ever advertised: an initiator ignores
    /// a lower one, so commands up to it stay acceptable.
    fn note_max_cmdsn(&self, sent: u32) {
        if serial::gt(sent, self.max_cmdsn_sent.get()) {
            self.max_cmdsn_sent.set(sent);
        }
    }

    fn stamp(&self, bhs: &mut Bhs) {
        let max = self.max_cmdsn();
        bhs.set_exp_cmdsn(self.exp_cmdsn);
        bhs.set_max_cmdsn(max);
        self.note_max_cmdsn(max);
    }

    fn pdu(&self, bhs: Bhs, data: OutData) -> OutPdu {
        let mut bhs = bhs;
        bhs.set_data_segment_len(data.len() as u32);
        OutPdu {
            bhs,
            data,
            header_digest: self.params.header_digest,
            data_digest: self.params.data_digest,
            served: None,
        }
    }

    /// Send a PDU that carries status: it takes the next StatSN and the
    /// current command window.
    fn push_status(&self, out: &mut Out, mut bhs: Bhs, data: OutData) {
        bhs.set_statsn(out.take_statsn());
        self.stamp(&mut bhs);
        out.push(self.pdu(bhs, data));
    }

    /// Count the current command as ended with `st`; what the driver
    /// reports back once the response is out.
    #[inline]
    fn count_status(&mut self, st: u8, sense: Option<&Sense>) -> Option<Served> {
        let c = std::mem::replace(&mut self.counting, Counting::NONE);
        let slot = c.slot;
        self.metrics
            .slot(slot)?
            .completed(c.kind, st, sense, c.bytes);
        if !self.timed {
            return None;
        }
        Some(Served {
            slot,
            kind: c.kind,
            arrived: c.arrived,
        })
    }

    /// The response of a command left the daemon: its service time.
    #[inline]
    pub fn served(&self, s: Served, now_raw: u64) {
        if let Some(c) = self.metrics.slot(s.slot) {
            c.served(s.kind, metrics::clock().delta_as_nanos(s.arrived, now_raw));
        }
    }

    pub fn reject(&mut self, out: &mut Out, bhs: &Bhs, reason: RejectReason) {
        let r = Bhs::reject(reason);
        self.push_status(out, r, OutData::Owned(rejected_header(bhs)));
    }

    /// A PDU whose data failed its digest (RFC 7143 § 7.8): Rejected and
    /// its data discarded. Returns whether the connection must close.
    pub fn data_digest_error(&mut self, bhs: &Bhs, out: &mut Out) -> bool {
        self.reject(out, bhs, RejectReason::DataDigestError);
        if bhs.opcode() == Some(Opcode::DataOut) {
            // Its header is sound: the sequence goes on without the data,
            // and the task ends with PROTOCOL SERVICE CRC ERROR once the
            // sequence has (option b).
            self.data_out(bhs, DataOutPayload::Damaged, out);
            false
        } else {
            // Any other PDU, a command with immediate data above all, was
            // never accounted for: at ErrorRecoveryLevel 0 the host recovers
            // the session, so end it now rather than at its timeout.
            true
        }
    }

    pub fn kind(&self) -> SessionKind {
        self.kind
    }

    /// Ask the initiator to log out within `seconds` (an Async Message).
    pub fn ask_logout(&mut self, out: &mut Out, seconds: u16) {
        let mut b = Bhs::async_logout_request(seconds);
        b.set_statsn(out.take_statsn());
        self.stamp(&mut b);
        let pdu = self.pdu(b, OutData::None);
        out.push(pdu);
    }

    /// Tell the initiator that every connection is about to drop and that
    /// it may log in again after `time2wait` seconds, within `time2retain`
    /// (an Async Message, AsyncEvent 3). Returns the message's StatSN.
    pub fn announce_drop(&mut self, out: &mut Out, time2wait: u16, time2retain: u16) -> u32 {
        let mut b = Bhs::async_dropping_all_connections(time2wait, time2retain);
        let statsn = out.take_statsn();
        b.set_statsn(statsn);
        self.stamp(&mut b);
        let pdu = self.pdu(b, OutData::None);
        out.push(pdu);
        statsn
    }

    pub fn send_ping(&mut self, out: &mut Out) {
        let ttt = self.new_ttt();
        self.ping_ttt = Some(ttt);
        let mut b = Bhs::nop_in(0, RESERVED_TAG, ttt);
        b.set_statsn(out.peek_statsn());
        self.stamp(&mut b);
        let pdu = self.pdu(b, OutData::None);
        out.push(pdu);
    }

    fn new_ttt(&mut self) -> u32 {
        let t = self.next_ttt;
        self.next_ttt = self.next_ttt.wrapping_add(1);
        if is_reserved(self.next_ttt) {
            self.next_ttt = 1;
        }
        t
    }

    #[inline]
    pub fn handle_pdu(
        &mut self,
        now: Instant,
        bhs: &Bhs,
        ahs: &[u8],
        data: &[u8],
        buffers: &RemoteBuffers,
        out: &mut Out,
    ) -> Flow {
        self.now = now;
        let Some(op) = bhs.opcode().filter(|o| o.is_initiator_opcode()) else {
            self.reject(out, bhs, RejectReason::CommandNotSupported);
            return Flow::Continue;
        };
        if op == Opcode::DataOut {
            self.data_out(bhs, DataOutPayload::Sound(data), out);
            return Flow::Continue;
        }
        if matches!(op, Opcode::LoginRequest | Opcode::SnackRequest) {
            // No login in full feature phase; no SNACK at ErrorRecoveryLevel 0.
            self.reject(out, bhs, RejectReason::ProtocolError);
            return Flow::Continue;
        }
        if op == Opcode::NopOut && is_reserved(bhs.itt()) {
            // An answer to our ping (or an unsolicited ping acknowledgement): no reply.
            if self.ping_ttt.is_some() && self.ping_ttt == Some(bhs.ttt()) {
                self.ping_ttt = None;
                return Flow::PingAnswered;
            }
            return Flow::Continue;
        }
        if self.kind == SessionKind::Discovery
            && matches!(op, Opcode::ScsiCommand | Opcode::TaskMgmtRequest)
        {
            self.reject(out, bhs, RejectReason::ProtocolError);
            return Flow::Continue;
        }
        // CmdSN ordering (RFC 7143 4.2.2.1): immediate PDUs go at once; others
        // must be ExpCmdSN exactly. One connection delivers in order, so a gap
        // or an out-of-window CmdSN is an initiator error: drop it silently.
        if !bhs.immediate() {
            let sn = bhs.cmdsn();
            if sn != self.exp_cmdsn || !serial::le(sn, self.max_cmdsn_sent.get()) {
                tracing::debug!(
                    sn,
                    exp = self.exp_cmdsn,
                    "dropping command outside the CmdSN window"
                );
                return Flow::Continue;
            }
            self.exp_cmdsn = self.exp_cmdsn.wrapping_add(1);
        } else if !serial::in_window(bhs.cmdsn(), self.exp_cmdsn, self.max_cmdsn_sent.get())
            && op == Opcode::ScsiCommand
        {
            tracing::debug!("immediate command with CmdSN outside the window; dropped");
            return Flow::Continue;
        }
        match op {
            Opcode::ScsiCommand => self.scsi_command(bhs, ahs, data, buffers, out),
            Opcode::NopOut => self.nop_out(bhs, data, out),
            Opcode::TaskMgmtRequest => self.task_mgmt(bhs, out),
            Opcode::TextRequest => self.text_request(bhs, data, out),
            Opcode::LogoutRequest => return self.logout(bhs, out),
            _ => self.reject(out, bhs, RejectReason::CommandNotSupported),
        }
        Flow::Continue
    }

    fn nop_out(&mut self, bhs: &Bhs, data: &[u8], out: &mut Out) {
        let b = Bhs::nop_in(bhs.lun(), bhs.itt(), RESERVED_TAG);
        let echo = &data[..data.len().min(self.params.initiator_mrdsl as usize)];
        self.push_status(out, b, OutData::bytes(echo.to_vec()));
    }

    // ---- SCSI commands -------------------------------------------------
}

enum DataSource<'a> {
    Store { volume: VolumeId, offset: u64 },
    Buffer(&'a [u8]),
}

/// Addresses to advertise: listen addresses, with a wildcard replaced by the
/// address this connection arrived on.
fn portal_addresses(listen: &[SocketAddr], local: SocketAddr) -> Vec<SocketAddr> {
    let mut v: Vec<SocketAddr> = listen
        .iter()
        .map(|a| {
            if a.ip().is_unspecified() {
                SocketAddr::new(local.ip(), a.port())
            } else {
                *a
            }
        })
        .collect();
    if v.is_empty() {
        v.push(local);
    }
    v.dedup();
    v
}

fn fmt_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(v4) => v4.to_string(),
        SocketAddr::V6(v6) => format!("[{}]:{}", v6.ip(), v6.port()),
    }
}
