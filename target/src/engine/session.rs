//! Full feature phase: SCSI commands and their data, NOP, task management,
//! text (SendTargets), logout.

use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::{
    parse_ahs, scsi_cmd, scsi_rsp, text, tmf, Bhs, Opcode, RejectReason, AHS_EXTENDED_CDB,
    RESERVED_TAG,
};
use ramslog_common::iser::{peer, RemoteBuffer};
use ramslog_common::lun::Lun;
use ramslog_common::scsi_wire::{status, Sense};
use ramslog_common::serial;

use super::login::{Login, SessionKind};
use super::params::Params;
use super::{
    is_reserved, rejected_header, Action, ConnInfo, DataInStream, Out, OutData, OutPdu, ReadDest,
};
use crate::metrics::{self, CommandKind, LimitHit, Served, SessionMetrics};
use crate::portal::{OpenSessionError, Portal, SessionControl, SessionKey};
use crate::scsi::{
    command_kind, DataIn, Nexus, NexusId, OutPlacement, Plan, ScsiTarget, SenseReason,
};

/// Largest RDMA READ into the iSER driver's own buffer (parameter lists and
/// compare data the SCSI device must see whole): the driver's bounce slots.
pub const ISER_BUFFERED_READ_MAX: u32 = 4 << 20;

/// Largest Data-In segment sent over TCP, whatever the initiator accepts:
/// it bounds the bytes one PDU makes the driver hold.
const DATA_IN_SEGMENT_MAX: u32 = 256 * 1024;

/// Staging buffers up to this capacity are kept for reuse; larger ones are freed.
const POOLED_BUFFER_MAX: usize = 1 << 20;

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
    /// Next offset not yet covered by unsolicited data or an R2T.
    solicit_next: u32,
    r2tsn: u32,
    r2ts: Vec<R2t>,
    /// Data the SCSI device must see whole before acting (parameter lists,
    /// compare data): gathered here. LUN writes go straight to the LUN.
    buf: Vec<u8>,
    /// Bytes of the daemon's staging budget this task holds.
    staged: u64,
    /// iSER: the initiator's buffer holding the write data that was not sent
    /// unsolicited: its address is that of byte `remote_base` as the command
    /// arrived (RFC 7145 9.2; Linux sets it to buffer + unsolicited length).
    remote: Option<RemoteBuffer>,
    remote_base: u32,
    /// iSER: the RDMA READ in flight, as (tag, offset, len).
    rdma_read: Option<(u32, u32, u32)>,
    /// Set once the command is bound to fail; its status waits until no
    /// sequence of it is open and no RDMA READ of it is in flight, because
    /// after the status the initiator may reuse the ITT.
    failure: Option<WriteFailure>,
    /// A non-immediate command: it holds a slot of the command window.
    in_window: bool,
    counting: Counting,
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
        self.unsolicited.is_none() && self.r2ts.is_empty() && self.rdma_read.is_none()
    }

    fn fail(&mut self, why: WriteFailure) {
        self.failure.get_or_insert(why);
    }
}

pub(super) struct Session {
    portal: Arc<Portal>,
    pub tsih: u16,
    pub params: Params,
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
    spare_bufs: Vec<Vec<u8>>,
    data_in: Vec<u8>,
    next_ttt: u32,
    ping_ttt: Option<u32>,
    text_rx: Vec<u8>,
    text_tx: Option<(u32, Vec<u8>)>,
    ended: bool,
    /// iSER: the tagged buffers of the PDU being handled.
    remote_write: Option<RemoteBuffer>,
    remote_read: Option<RemoteBuffer>,
    next_rdma_tag: u32,
    metrics: SessionMetrics,
    counting: Counting,
    /// Service times are measured (`Portal::service_times`).
    timed: bool,
}

impl Session {
    pub fn start(
        portal: &Arc<Portal>,
        login: Login,
        info: ConnInfo,
        control: Arc<dyn SessionControl>,
        cmdsn: u32,
    ) -> Result<Session, OpenSessionError> {
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
        let (tsih, nexus) = portal.open_session(key, discovery, info.peer, control)?;
        let scsi = target.map(|t| t.scsi.clone());
        let metrics = match &scsi {
            Some(scsi) => SessionMetrics::join(scsi.luns().cloned()),
            None => SessionMetrics::default(),
        };
        if let Some(scsi) = &scsi {
            scsi.attach(&Nexus {
                id: nexus,
                initiator_name: initiator_name.clone(),
                isid: login.isid(),
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
        if params.iser {
            // Everything we send over iSER is one SEND into a 16 KiB message.
            params.initiator_mrdsl = params.initiator_mrdsl.min(peer::ILLUMOS_MAX_RECV_DATA);
        }
        if params.rdma_extensions && login.kind == SessionKind::Normal {
            // Linux ib_iser receives full-feature PDUs into buffers with 128
            // bytes of data room, whatever it declared during login (a
            // discovery session keeps its login buffer).
            params.initiator_mrdsl = params
                .initiator_mrdsl
                .min(peer::LINUX_FULL_FEATURE_RECV_DATA);
        }
        Ok(Session {
            portal: portal.clone(),
            tsih,
            params,
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
            data_in: Vec::with_capacity(4096),
            next_ttt: 1,
            ping_ttt: None,
            text_rx: Vec::new(),
            text_tx: None,
            ended: false,
            remote_write: None,
            remote_read: None,
            next_rdma_tag: 1,
            metrics,
            counting: Counting::NONE,
            timed: portal.service_times,
        })
    }

    pub fn set_remote_buffers(&mut self, write: Option<RemoteBuffer>, read: Option<RemoteBuffer>) {
        self.remote_write = write;
        self.remote_read = read;
    }

    /// Release the session: the I_T nexus is lost.
    pub fn end(mut self: Box<Self>) {
        self.ended = true;
        for task in std::mem::take(&mut self.tasks) {
            self.portal.staging.release(task.staged);
        }
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

    pub fn scsi_target(&self) -> Option<Arc<ScsiTarget>> {
        self.scsi.clone()
    }

    pub fn reject(&mut self, out: &mut Out, bhs: &Bhs, reason: RejectReason) {
        let mut r = Bhs::new(Opcode::Reject);
        r.set_final(true);
        r.0[2] = reason as u8;
        r.set_itt(RESERVED_TAG);
        self.push_status(out, r, OutData::Owned(rejected_header(bhs)));
    }

    pub fn data_digest_error(&mut self, bhs: &Bhs, out: &mut Out) {
        // ERL 0: the data is discarded and the initiator recovers the task.
        self.reject(out, bhs, RejectReason::DataDigestError);
    }

    pub fn send_ping(&mut self, out: &mut Out) {
        let ttt = self.new_ttt();
        self.ping_ttt = Some(ttt);
        let mut b = Bhs::new(Opcode::NopIn);
        b.set_final(true)
            .set_itt(RESERVED_TAG)
            .set_ttt(ttt)
            .set_statsn(out.peek_statsn());
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

    pub fn handle_pdu(
        &mut self,
        _now: Instant,
        bhs: &Bhs,
        ahs: &[u8],
        data: &[u8],
        out: &mut Out,
    ) -> Flow {
        let Some(op) = bhs.opcode().filter(|o| o.is_initiator_opcode()) else {
            self.reject(out, bhs, RejectReason::CommandNotSupported);
            return Flow::Continue;
        };
        if op == Opcode::DataOut {
            self.data_out(bhs, data, out);
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
            Opcode::ScsiCommand => self.scsi_command(bhs, ahs, data, out),
            Opcode::NopOut => self.nop_out(bhs, data, out),
            Opcode::TaskMgmtRequest => self.task_mgmt(bhs, out),
            Opcode::TextRequest => self.text_request(bhs, data, out),
            Opcode::LogoutRequest => return self.logout(bhs, out),
            _ => self.reject(out, bhs, RejectReason::CommandNotSupported),
        }
        Flow::Continue
    }

    fn nop_out(&mut self, bhs: &Bhs, data: &[u8], out: &mut Out) {
        let mut b = Bhs::new(Opcode::NopIn);
        b.set_final(true)
            .set_lun(bhs.lun())
            .set_itt(bhs.itt())
            .set_ttt(RESERVED_TAG);
        let echo = &data[..data.len().min(self.params.initiator_mrdsl as usize)];
        self.push_status(out, b, OutData::bytes(echo.to_vec()));
    }

    // ---- SCSI commands -------------------------------------------------

    fn scsi_command(&mut self, bhs: &Bhs, ahs: &[u8], data: &[u8], out: &mut Out) {
        let itt = bhs.itt();
        if self.tasks.iter().any(|t| t.itt == itt) {
            self.reject(out, bhs, RejectReason::InvalidPduField);
            return;
        }
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut cdb_buf = [0u8; 16 + 260];
        let mut cdb_len = 16;
        cdb_buf[..16].copy_from_slice(bhs.cdb());
        for entry in parse_ahs(ahs) {
            match entry {
                Ok(a) if a.ahs_type == AHS_EXTENDED_CDB => {
                    let Some(dst) = cdb_buf.get_mut(16..16 + a.data.len()) else {
                        self.reject(out, bhs, RejectReason::InvalidPduField);
                        return;
                    };
                    dst.copy_from_slice(a.data);
                    cdb_len = 16 + a.data.len();
                }
                Ok(_) => {}
                Err(_) => {
                    self.reject(out, bhs, RejectReason::InvalidPduField);
                    return;
                }
            }
        }
        let cdb = &cdb_buf[..cdb_len];
        let flags = bhs.flags();
        let edtl = bhs.expected_data_len();
        self.counting = Counting {
            slot: NO_SLOT,
            kind: command_kind(cdb[0]),
            arrived: if self.timed {
                metrics::clock().raw()
            } else {
                0
            },
            bytes: 0,
        };
        let Some(lun) = Lun::from_wire(bhs.lun()) else {
            self.fail(out, itt, SenseReason::LuNotSupported, Residual::None);
            return;
        };
        if (data.len() as u32) > edtl
            || (!data.is_empty() && flags & scsi_cmd::WRITE == 0 && edtl == 0)
        {
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if !data.is_empty()
            && (!self.params.immediate_data || data.len() as u32 > self.params.first_burst_len)
        {
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if self.params.iser && flags & scsi_cmd::READ != 0 && edtl > 0 && self.remote_read.is_none()
        {
            // iSER reads are RDMA-written to a buffer the command must name.
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        self.counting.slot = self.metrics.slot_of(lun.number()).unwrap_or(NO_SLOT);
        let plan = match scsi.prepare(self.nexus, lun.number(), cdb) {
            Ok(p) => p,
            Err(reason) => {
                self.fail(out, itt, reason, Residual::None);
                return;
            }
        };
        let edtl_out = if flags & scsi_cmd::WRITE != 0 {
            edtl
        } else {
            0
        };
        if let Err(reason) = plan.check_expected_len(edtl_out) {
            let residual = Residual::between(edtl_out, plan.data_out_len);
            self.fail(out, itt, reason, residual);
            return;
        }
        if plan.data_out_len == 0 {
            let edtl_in = if flags & scsi_cmd::READ != 0 { edtl } else { 0 };
            self.execute(
                out,
                &scsi,
                itt,
                lun,
                &plan,
                &[],
                edtl_in,
                Residual::between(edtl, 0),
            );
            return;
        }
        let need = plan.data_out_len;
        let moved = need.min(edtl_out);
        let residual = Residual::between(edtl_out, need);
        if moved > 0
            && matches!(plan.out_placement, OutPlacement::Store { .. })
            && moved % scsi.block_size(lun.number()) != 0
        {
            // The data would end inside a block: refuse rather than write part of one.
            self.fail(out, itt, SenseReason::InvalidFieldInCommandIu, residual);
            return;
        }
        let unsol_end = if flags & 0x80 != 0 || self.params.initial_r2t {
            data.len() as u32
        } else {
            self.params
                .first_burst_len
                .min(edtl_out)
                .max(data.len() as u32)
        };
        if self.tasks.len() >= self.cmd_window as usize {
            // More commands waiting for data than the window allows: the
            // initiator is ignoring MaxCmdSN or flooding immediate commands.
            self.portal.counters.limit_hit(LimitHit::CommandWindow);
            self.respond(out, itt, status::TASK_SET_FULL, None, residual);
            return;
        }
        // Immediate data is the unsolicited sequence's first piece; Data-Out
        // PDUs continue it from DataSN 0.
        let unsolicited = Sequence::new(data.len() as u32, unsol_end);
        let mut task = Task {
            itt,
            lun,
            plan,
            moved,
            edtl: edtl_out,
            unsolicited: Some(unsolicited),
            solicit_next: unsol_end,
            r2tsn: 0,
            r2ts: Vec::new(),
            buf: Vec::new(),
            staged: 0,
            remote: self.remote_write,
            remote_base: unsol_end,
            rdma_read: None,
            failure: None,
            in_window: !bhs.immediate(),
            counting: self.counting,
        };
        if unsol_end == data.len() as u32 {
            task.unsolicited = None;
        }
        if self.params.iser && unsol_end < moved && task.remote.is_none() {
            // The rest must be RDMA-read, but the command named no buffer.
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if self.params.iser
            && matches!(task.plan.out_placement, OutPlacement::Buffer)
            && moved.saturating_sub(unsol_end) > ISER_BUFFERED_READ_MAX
        {
            // The driver reads such data into a buffer of its own, which
            // has this size: refuse the command rather than the connection.
            self.fail(
                out,
                itt,
                SenseReason::TransferTooLargeForTransport,
                residual,
            );
            return;
        }
        if matches!(task.plan.out_placement, OutPlacement::Buffer) {
            if !self.portal.staging.reserve(u64::from(moved)) {
                tracing::debug!(itt, moved, "staging budget exhausted: TASK SET FULL");
                self.portal.counters.limit_hit(LimitHit::StagingBudget);
                self.respond(out, itt, status::TASK_SET_FULL, None, residual);
                return;
            }
            task.staged = u64::from(moved);
            task.buf = self.spare_bufs.pop().unwrap_or_default();
            task.buf.clear();
            task.buf.resize(moved as usize, 0);
        }
        if task.in_window {
            // Released by finish_task, before the command's status is stamped.
            self.waiting_in_window += 1;
        }
        if !data.is_empty() && !self.place(&mut task, 0, data) {
            task.fail(WriteFailure::Placement);
        }
        self.advance(out, &scsi, task);
    }

    /// After any event of a write: complete it, fail it, or ask for more
    /// data and keep waiting.
    fn advance(&mut self, out: &mut Out, scsi: &Arc<ScsiTarget>, mut task: Task) {
        self.counting = task.counting;
        if self.drop_if_aborted(scsi, &task) {
            self.finish_task(task);
            return;
        }
        let residual = Residual::between(task.edtl, task.plan.data_out_len);
        if task.failure.is_none() && task.unsolicited.is_none() && !self.solicit(out, &mut task) {
            task.fail(WriteFailure::DataPhase);
        }
        if !task.transfer_quiet() {
            self.tasks.push(task);
            return;
        }
        match task.failure {
            Some(why) => {
                let itt = task.itt;
                self.finish_task(task);
                let reason = match why {
                    WriteFailure::DataPhase => SenseReason::DataPhaseError,
                    WriteFailure::Placement => SenseReason::InternalTargetFailure,
                };
                self.fail(out, itt, reason, residual);
            }
            None if task.solicit_next >= task.moved => {
                self.complete_write(out, scsi, task, residual)
            }
            // Quiet but not whole cannot happen: solicit() asked for the rest.
            None => self.tasks.push(task),
        }
    }

    /// Copy data-out bytes at `offset` into the LUN or the task buffer,
    /// ignoring what lies past the bytes the command consumes. Each byte of
    /// the transfer belongs to exactly one sequence, so nothing is placed twice.
    fn place(&self, task: &mut Task, offset: u32, data: &[u8]) -> bool {
        let end = (u64::from(offset) + data.len() as u64).min(u64::from(task.moved));
        if u64::from(offset) >= end {
            return true;
        }
        let useful = &data[..(end - u64::from(offset)) as usize];
        match task.plan.out_placement {
            // The policy for both transports: LUN writes land in the LUN as
            // they arrive (iSER's RDMA READ does the same). A write that is
            // never answered GOOD may leave its blocks partly written, as on
            // any disk; GOOD comes only when every byte is in place.
            OutPlacement::Store { offset: base } => self
                .scsi
                .as_ref()
                .and_then(|s| s.lu(task.lun.number()))
                .is_some_and(|lu| {
                    lu.volume()
                        .store()
                        .write(base + u64::from(offset), useful)
                        .is_ok()
                }),
            OutPlacement::Buffer => match task.buf.get_mut(offset as usize..end as usize) {
                Some(dst) => {
                    dst.copy_from_slice(useful);
                    true
                }
                None => false,
            },
            OutPlacement::None => true,
        }
    }

    /// Send R2Ts for the next ranges, up to MaxOutstandingR2T; over iSER,
    /// one RDMA READ of everything not sent unsolicited. Called only once
    /// the unsolicited sequence ended, so a short one is simply continued.
    fn solicit(&mut self, out: &mut Out, task: &mut Task) -> bool {
        if self.params.iser {
            return self.solicit_rdma(out, task);
        }
        while task.solicit_next < task.moved
            && (task.r2ts.len() as u32) < self.params.max_outstanding_r2t
        {
            let offset = task.solicit_next;
            let len = (task.moved - offset).min(self.params.max_burst_len);
            let ttt = self.new_ttt();
            let mut b = Bhs::new(Opcode::ReadyToTransfer);
            b.set_final(true)
                .set_lun(task.lun.to_wire())
                .set_itt(task.itt)
                .set_ttt(ttt)
                .set_statsn(out.peek_statsn())
                .set_datasn(task.r2tsn)
                .set_buffer_offset(offset)
                .set_residual(len);
            self.stamp(&mut b);
            task.r2tsn = task.r2tsn.wrapping_add(1);
            task.solicit_next += len;
            task.r2ts.push(R2t {
                ttt,
                seq: Sequence::new(offset, offset + len),
            });
            let pdu = self.pdu(b, OutData::None);
            out.push(pdu);
        }
        true
    }

    /// False when the data cannot be fetched: the command must fail.
    fn solicit_rdma(&mut self, out: &mut Out, task: &mut Task) -> bool {
        if task.rdma_read.is_some() || task.solicit_next >= task.moved {
            return true;
        }
        let (offset, len) = (task.solicit_next, task.moved - task.solicit_next);
        let Some(remote) = task.remote else {
            return false;
        };
        // Data the initiator meant to send unsolicited but did not is not in
        // the tagged buffer: refuse instead of reading the wrong bytes.
        let Some(remote_addr) = offset
            .checked_sub(task.remote_base)
            .and_then(|rel| remote.at(rel.into()))
        else {
            tracing::warn!(
                itt = task.itt,
                offset,
                "iSER write data missing below the tagged buffer"
            );
            return false;
        };
        let dest = match task.plan.out_placement {
            OutPlacement::Store { offset: base } => ReadDest::Store {
                lun: task.lun.number(),
                offset: base + u64::from(offset),
            },
            _ => ReadDest::Buffer,
        };
        let tag = self.next_rdma_tag;
        self.next_rdma_tag = self.next_rdma_tag.wrapping_add(1).max(1);
        task.rdma_read = Some((tag, offset, len));
        task.solicit_next = task.moved;
        out.push_action(Action::RdmaRead {
            tag,
            stag: remote.stag,
            remote_addr,
            len,
            dest,
        });
        true
    }

    /// iSER: an RDMA READ finished. A task aborted meanwhile is gone, and its
    /// late data is dropped.
    pub fn rdma_read_done(&mut self, tag: u32, data: &[u8], out: &mut Out) {
        let Some(idx) = self
            .tasks
            .iter()
            .position(|t| t.rdma_read.is_some_and(|(t, _, _)| t == tag))
        else {
            return;
        };
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut task = self.tasks.swap_remove(idx);
        let Some((_, offset, len)) = task.rdma_read.take() else {
            return;
        };
        // For the store the HCA already placed the bytes in LUN memory.
        if matches!(task.plan.out_placement, OutPlacement::Buffer)
            && task.failure.is_none()
            && !self.place(&mut task, offset, &data[..data.len().min(len as usize)])
        {
            task.fail(WriteFailure::Placement);
        }
        self.advance(out, &scsi, task);
    }

    fn data_out(&mut self, bhs: &Bhs, data: &[u8], out: &mut Out) {
        let Some(idx) = self.tasks.iter().position(|t| t.itt == bhs.itt()) else {
            // Data for a command that already ended (aborted, or failed before
            // any data was asked for) may still be in flight: drop it.
            return;
        };
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut task = self.tasks.swap_remove(idx);
        if self.drop_if_aborted(&scsi, &task) {
            // Aborted from another session: its data must not land.
            self.finish_task(task);
            return;
        }
        let offset = bhs.buffer_offset();
        let len = data.len() as u32;
        let datasn = bhs.datasn();
        let ttt = bhs.ttt();
        let last = bhs.final_bit();
        let failing_already = task.failure.is_some();
        let placed_ok = if is_reserved(ttt) {
            match task.unsolicited.as_mut() {
                Some(seq) => {
                    let fits = seq.take(offset, len, datasn);
                    if last {
                        if !seq.broken && seq.next < seq.end {
                            // Unsolicited data may end early: what is missing
                            // is solicited with ordinary R2Ts.
                            task.solicit_next = seq.next;
                        }
                        if seq.broken {
                            task.fail(WriteFailure::DataPhase);
                        }
                        task.unsolicited = None;
                    }
                    fits
                }
                None => false,
            }
        } else {
            match task.r2ts.iter().position(|r| r.ttt == ttt) {
                Some(ri) => {
                    let seq = &mut task.r2ts[ri].seq;
                    let fits = seq.take(offset, len, datasn);
                    if last {
                        if seq.broken || seq.next < seq.end {
                            // A solicited burst must deliver what its R2T
                            // asked for: ending early is a data-sequence error.
                            task.fail(WriteFailure::DataPhase);
                        }
                        task.r2ts.swap_remove(ri);
                    }
                    fits
                }
                None => false,
            }
        };
        if !placed_ok {
            if !failing_already {
                // Once per task: a peer must not be able to fill the log.
                tracing::warn!(
                    itt = task.itt,
                    datasn,
                    offset,
                    "Data-Out out of sequence; the command will fail once its transfer is over"
                );
            }
            task.fail(WriteFailure::DataPhase);
        } else if task.failure.is_none() && !self.place(&mut task, offset, data) {
            task.fail(WriteFailure::Placement);
        }
        self.advance(out, &scsi, task);
    }

    /// Whether another nexus aborted this task (PREEMPT AND ABORT, a reset)
    /// since it arrived. With TAS=0 in the Control mode page an aborted task
    /// ends without status; the initiator learns of it from the unit
    /// attention and its own task management.
    fn drop_if_aborted(&self, scsi: &ScsiTarget, task: &Task) -> bool {
        let aborted = scsi.is_aborted(self.nexus, &task.plan);
        if aborted {
            tracing::info!(
                initiator = %self.initiator_name.escape_debug(),
                itt = task.itt,
                "write aborted by another initiator; its data is dropped"
            );
        }
        aborted
    }

    fn complete_write(
        &mut self,
        out: &mut Out,
        scsi: &Arc<ScsiTarget>,
        task: Task,
        residual: Residual,
    ) {
        let moved = task.moved as usize;
        let data: &[u8] = match task.plan.out_placement {
            OutPlacement::Buffer => task.buf.get(..moved).unwrap_or(&[]),
            _ => &[],
        };
        let result = scsi.execute(self.nexus, &task.plan, data, &mut self.data_in);
        self.counting.bytes = task.moved;
        let itt = task.itt;
        self.finish_task(task);
        match result {
            Ok(_) => self.respond(out, itt, status::GOOD, None, residual),
            Err(reason) => self.fail(out, itt, reason, residual),
        }
    }

    fn finish_task(&mut self, mut task: Task) {
        if task.in_window {
            self.waiting_in_window = self.waiting_in_window.saturating_sub(1);
        }
        self.portal.staging.release(task.staged);
        task.staged = 0;
        task.buf.clear();
        let cap = task.buf.capacity();
        if cap > 0 && cap <= POOLED_BUFFER_MAX && self.spare_bufs.len() < 8 {
            self.spare_bufs.push(std::mem::take(&mut task.buf));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &mut self,
        out: &mut Out,
        scsi: &Arc<ScsiTarget>,
        itt: u32,
        lun: Lun,
        plan: &Plan,
        data_out: &[u8],
        edtl_in: u32,
        residual: Residual,
    ) {
        let mut data_in = std::mem::take(&mut self.data_in);
        let result = scsi.execute(self.nexus, plan, data_out, &mut data_in);
        match result {
            Ok(DataIn::None) => self.respond(out, itt, status::GOOD, None, residual),
            Ok(DataIn::Store { offset, len }) => {
                self.send_data_in(out, itt, lun, DataSource::Store(offset), len, edtl_in)
            }
            Ok(DataIn::Buffer { len }) => {
                let len = len.min(data_in.len() as u32);
                self.send_data_in(out, itt, lun, DataSource::Buffer(&data_in), len, edtl_in);
            }
            Err(reason) => self.fail(out, itt, reason, residual),
        }
        self.data_in = data_in;
    }

    /// Data-In PDUs for a read, the last one carrying GOOD status.
    fn send_data_in(
        &mut self,
        out: &mut Out,
        itt: u32,
        lun: Lun,
        src: DataSource,
        produced: u32,
        edtl: u32,
    ) {
        let xfer = produced.min(edtl);
        let residual = Residual::between(edtl, produced);
        self.counting.bytes = xfer;
        if xfer == 0 {
            self.respond(out, itt, status::GOOD, None, residual);
            return;
        }
        if self.params.iser {
            // Checked when the command arrived; the address cannot overflow
            // once the initiator registered that many bytes there.
            let Some(remote) = self.remote_read else {
                self.fail(out, itt, SenseReason::DataPhaseError, residual);
                return;
            };
            let data = match src {
                DataSource::Store(offset) => OutData::Store {
                    lun: lun.number(),
                    offset,
                    len: xfer,
                },
                DataSource::Buffer(v) => OutData::Owned(v[..xfer as usize].to_vec()),
            };
            out.push_action(Action::RdmaWrite {
                stag: remote.stag,
                remote_addr: remote.va,
                data,
            });
            self.respond(out, itt, status::GOOD, None, residual);
            return;
        }
        let seg = self.params.initiator_mrdsl.clamp(512, DATA_IN_SEGMENT_MAX);
        let burst = self.params.max_burst_len.max(seg);
        if let DataSource::Store(base) = src {
            let statsn = out.take_statsn();
            let mut stream = DataInStream {
                itt,
                lun: lun.number(),
                lun_wire: lun.to_wire(),
                base,
                xfer,
                off: 0,
                datasn: 0,
                seg,
                burst,
                statsn,
                exp_cmdsn: self.exp_cmdsn,
                max_cmdsn: self.max_cmdsn(),
                residual_flags: residual.flags(),
                residual_count: residual.count(),
                header_digest: self.params.header_digest,
                data_digest: self.params.data_digest,
                served: None,
            };
            stream.served = self.count_status(status::GOOD, None);
            self.note_max_cmdsn(stream.max_cmdsn);
            out.push_data_in(stream);
            return;
        }
        let mut off = 0u32;
        let mut datasn = 0u32;
        while off < xfer {
            let burst_end = ((off / burst) + 1).saturating_mul(burst).min(xfer);
            let len = (xfer - off).min(seg).min(burst_end - off);
            let last = off + len == xfer;
            let mut b = Bhs::new(Opcode::DataIn);
            let mut flags = 0u8;
            if last || off + len == burst_end {
                flags |= 0x80;
            }
            b.set_lun(lun.to_wire()).set_itt(itt).set_ttt(RESERVED_TAG);
            b.set_datasn(datasn).set_buffer_offset(off);
            if last {
                flags |= scsi_rsp::STATUS | residual.flags();
                b.0[3] = status::GOOD;
                b.set_statsn(out.take_statsn());
                b.set_residual(residual.count());
            }
            b.set_flags(flags);
            self.stamp(&mut b);
            let data = match src {
                DataSource::Store(base) => OutData::Store {
                    lun: lun.number(),
                    offset: base + off as u64,
                    len,
                },
                DataSource::Buffer(v) => {
                    OutData::Owned(v[off as usize..(off + len) as usize].to_vec())
                }
            };
            let mut pdu = self.pdu(b, data);
            if last {
                pdu.served = self.count_status(status::GOOD, None);
            }
            out.push(pdu);
            off += len;
            datasn += 1;
        }
    }

    /// A command that failed: its CHECK CONDITION (or other status), or,
    /// for a write that met the shutdown fence, no status and the end of
    /// the connection: the host then retries the write after the restart
    /// instead of seeing it fail.
    fn fail(&mut self, out: &mut Out, itt: u32, reason: SenseReason, residual: Residual) {
        if reason == SenseReason::Fenced {
            tracing::info!(
                itt,
                "write met the shutdown fence: no status, closing the connection"
            );
            out.close();
            return;
        }
        self.respond(out, itt, reason.status(), reason.sense(), residual);
    }

    fn respond(
        &mut self,
        out: &mut Out,
        itt: u32,
        st: u8,
        sense: Option<Sense>,
        residual: Residual,
    ) {
        let mut b = Bhs::new(Opcode::ScsiResponse);
        b.set_flags(0x80 | residual.flags());
        b.0[3] = st;
        b.set_itt(itt);
        b.set_residual(residual.count());
        let served = self.count_status(st, sense.as_ref());
        let data = match sense {
            Some(s) => {
                let enc = s.encode_fixed();
                let mut v = Vec::with_capacity(2 + enc.len());
                v.extend_from_slice(&(enc.len() as u16).to_be_bytes());
                v.extend_from_slice(&enc);
                OutData::Owned(v)
            }
            None => OutData::None,
        };
        b.set_statsn(out.take_statsn());
        self.stamp(&mut b);
        let mut pdu = self.pdu(b, data);
        pdu.served = served;
        out.push(pdu);
    }

    // ---- task management -------------------------------------------------

    fn task_mgmt(&mut self, bhs: &Bhs, out: &mut Out) {
        let function = bhs.flags() & 0x7f;
        // The LUN the request names, if this target has it.
        let known_lun = Lun::from_wire(bhs.lun()).filter(|l| {
            self.scsi
                .as_ref()
                .is_some_and(|s| s.lu(l.number()).is_some())
        });
        let response = match function {
            tmf::ABORT_TASK => {
                let rtt = bhs.ttt();
                match self.tasks.iter().position(|t| t.itt == rtt) {
                    Some(i) => {
                        let t = self.tasks.swap_remove(i);
                        self.finish_task(t);
                        tmf::RSP_COMPLETE
                    }
                    None => tmf::RSP_NO_TASK,
                }
            }
            tmf::ABORT_TASK_SET | tmf::CLEAR_TASK_SET | tmf::LOGICAL_UNIT_RESET => {
                if let Some(l) = known_lun {
                    self.abort_tasks(|t| t.lun == l);
                    if function == tmf::LOGICAL_UNIT_RESET {
                        if let Some(s) = &self.scsi {
                            s.reset(crate::scsi::ResetScope::Lu(l.number()), self.nexus);
                        }
                        tracing::info!(initiator = %self.initiator_name, lun = %l, "logical unit reset");
                    }
                    tmf::RSP_COMPLETE
                } else {
                    tmf::RSP_NO_LUN
                }
            }
            tmf::TARGET_WARM_RESET => {
                self.abort_tasks(|_| true);
                if let Some(s) = &self.scsi {
                    s.reset(crate::scsi::ResetScope::Target, self.nexus);
                }
                tracing::info!(initiator = %self.initiator_name, "target warm reset");
                tmf::RSP_COMPLETE
            }
            tmf::TASK_REASSIGN => tmf::RSP_NO_REASSIGN,
            _ => tmf::RSP_NOT_SUPPORTED,
        };
        let mut b = Bhs::new(Opcode::TaskMgmtResponse);
        b.set_final(true).set_itt(bhs.itt());
        b.0[2] = response;
        self.push_status(out, b, OutData::None);
    }

    fn abort_tasks(&mut self, pred: impl Fn(&Task) -> bool) {
        let mut i = 0;
        while i < self.tasks.len() {
            if pred(&self.tasks[i]) {
                let t = self.tasks.swap_remove(i);
                self.finish_task(t);
            } else {
                i += 1;
            }
        }
    }

    // ---- text and logout -------------------------------------------------

    fn text_request(&mut self, bhs: &Bhs, data: &[u8], out: &mut Out) {
        let ttt = bhs.ttt();
        if !is_reserved(ttt) {
            // Continuation of a long response.
            match self.text_tx.take() {
                Some((tag, rest)) if tag == ttt => self.send_text(out, bhs.itt(), rest),
                _ => self.reject(out, bhs, RejectReason::InvalidPduField),
            }
            return;
        }
        self.text_tx = None;
        self.text_rx.extend_from_slice(data);
        if self.text_rx.len() > 64 * 1024 {
            self.text_rx.clear();
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if bhs.flags() & 0x40 != 0 {
            // C bit: more text follows; acknowledge with an empty response.
            self.send_text_pdu(out, bhs.itt(), Vec::new(), false, RESERVED_TAG);
            return;
        }
        let rx = std::mem::take(&mut self.text_rx);
        let pairs = match text::decode(&rx) {
            Ok(p) => p,
            Err(e) => {
                tracing::info!("malformed text request: {e}");
                self.reject(out, bhs, RejectReason::ProtocolError);
                return;
            }
        };
        let mut resp = Vec::new();
        for p in pairs {
            if p.key == "SendTargets" {
                self.send_targets(p.value, &mut resp);
            } else {
                text::encode_pair(&mut resp, p.key, "NotUnderstood");
            }
        }
        self.send_text(out, bhs.itt(), resp);
    }

    fn send_targets(&self, which: &str, resp: &mut Vec<u8>) {
        let portal = &self.portal;
        for t in &portal.targets {
            let wanted = match (self.kind, which) {
                (SessionKind::Discovery, "All") => true,
                (_, "") => self
                    .target_name
                    .as_deref()
                    .is_some_and(|n| n.eq_ignore_ascii_case(&t.name)),
                (_, name) => {
                    name.eq_ignore_ascii_case(&t.name)
                        && (self.kind == SessionKind::Discovery
                            || self
                                .target_name
                                .as_deref()
                                .is_some_and(|n| n.eq_ignore_ascii_case(name)))
                }
            };
            if !wanted || !t.acl.allows(&self.initiator_name, self.info.peer.ip()) {
                continue;
            }
            text::encode_pair(resp, "TargetName", &t.name);
            for addr in portal_addresses(&portal.listen, self.info.local) {
                text::encode_pair(
                    resp,
                    "TargetAddress",
                    &format!("{},{}", fmt_addr(addr), portal.tpgt),
                );
            }
        }
    }

    fn send_text(&mut self, out: &mut Out, itt: u32, mut resp: Vec<u8>) {
        let limit = self.params.initiator_mrdsl as usize;
        if resp.len() > limit {
            let rest = resp.split_off(limit);
            let tag = self.new_ttt();
            self.text_tx = Some((tag, rest));
            self.send_text_pdu(out, itt, resp, false, tag);
        } else {
            self.send_text_pdu(out, itt, resp, true, RESERVED_TAG);
        }
    }

    fn send_text_pdu(&mut self, out: &mut Out, itt: u32, data: Vec<u8>, last: bool, ttt: u32) {
        let mut b = Bhs::new(Opcode::TextResponse);
        b.set_flags(if last { 0x80 } else { 0x40 });
        b.set_itt(itt).set_ttt(ttt);
        self.push_status(out, b, OutData::bytes(data));
    }

    fn logout(&mut self, bhs: &Bhs, out: &mut Out) -> Flow {
        let reason = bhs.flags() & 0x7f;
        let response = match reason {
            0 => 0,
            1 if bhs.cid() == self.cid => 0,
            1 => 1,
            // Connection recovery needs ErrorRecoveryLevel 2.
            _ => 2,
        };
        let mut b = Bhs::new(Opcode::LogoutResponse);
        b.set_final(true).set_itt(bhs.itt());
        b.0[2] = response;
        self.push_status(out, b, OutData::None);
        if response == 0 {
            self.abort_tasks(|_| true);
            tracing::info!(initiator = %self.initiator_name, "logout");
            out.close();
            return Flow::Close;
        }
        Flow::Continue
    }
}

enum DataSource<'a> {
    Store(u64),
    Buffer(&'a [u8]),
}

/// SCSI residual as reported in SCSI Response / final Data-In.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residual {
    None,
    Under(u32),
    Over(u32),
}

impl Residual {
    /// Compare the initiator's expected length with what the command moves.
    fn between(expected: u32, actual: u32) -> Residual {
        match expected.cmp(&actual) {
            std::cmp::Ordering::Equal => Residual::None,
            std::cmp::Ordering::Greater => Residual::Under(expected - actual),
            std::cmp::Ordering::Less => Residual::Over(actual - expected),
        }
    }
    fn flags(self) -> u8 {
        match self {
            Residual::None => 0,
            Residual::Under(_) => scsi_rsp::UNDERFLOW,
            Residual::Over(_) => scsi_rsp::OVERFLOW,
        }
    }
    fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Under(n) | Residual::Over(n) => n,
        }
    }
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
