//! iSER (RFC 7145, InfiniBand/RoCE through rdma_cm): a blocking, single-threaded
//! session that behaves like the Linux (ib_iser + open-iscsi) or the illumos
//! initiator, chosen by [`IserProfile`].
//!
//! Every control PDU travels in one SEND behind the 28-byte iSER header; the
//! data segment follows BHS+AHS unpadded. Read data arrives by the target's
//! RDMA WRITE into the command's buffer and write data leaves by its RDMA
//! READ from it: each command slot owns a registered buffer (REMOTE_READ |
//! REMOTE_WRITE) that the command advertises in the iSER header (WSV/RSV,
//! absolute VA, STag). Receive slots, send slots and command buffers are
//! registered once, at connect time, and reused: after setup a command
//! neither allocates nor registers memory.
//!
//! Login runs the same negotiation code as the TCP [`crate::Connection`]
//! (`exchange.rs`), iSER-assisted.
//!
//! ```no_run
//! use ramslog_initiator::iser::{IserOptions, IserProfile, IserSession};
//! use ramslog_initiator::LoginParams;
//! # fn main() -> Result<(), ramslog_initiator::Error> {
//! let addr = "10.0.0.1:3260".parse().unwrap();
//! let p = LoginParams::normal("iqn.2026-11.org.example:host", "iqn.2026-11.org.ramslog:slog0");
//! let mut s = IserSession::connect(addr, &p, &IserOptions::new(IserProfile::Illumos))?;
//! s.write16(0, 8, &[0xab; 4096], false)?;
//! let mut back = [0u8; 4096];
//! s.read16(0, 8, &mut back)?;
//! s.logout()?;
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ramslog_common::iscsi::{scsi_cmd, Bhs, Opcode, BHS_LEN, RESERVED_TAG};
use ramslog_common::iser::{peer, Header, RemoteBuffer, HEADER_LEN, LINUX_CM_PRIVATE_DATA};
use ramslog_common::scsi_wire::{be32, be64, Sense};
use ramslog_common::verbs::wait::{self, SpinBudget};
use ramslog_common::verbs::{
    Access, CmEventKind, RegisteredBuffer, WcOpcode, WcStatus, WorkCompletion,
};

use crate::cdb;
use crate::conn::{logout_request, nop_out_reply};
use crate::datain::{check_status, response_status, Residual};
use crate::discovery::parse_send_targets;
use crate::exchange::{LoginMachine, LoginStep, TextExchange};
use crate::login::{get, ChapParams, LoginDialect, LoginParams, Negotiated, SessionType};
use crate::pdu::LOGIN_MAX_DATA;
use crate::seq::SeqState;
use crate::url::{TargetUrl, Transport};
use crate::{encode_lun, Error};

mod transport;
use transport::Rdma;

/// iSER header plus BHS: where a PDU's AHS (and then data) starts in a message.
const HEADERS_LEN: usize = HEADER_LEN + BHS_LEN;
/// Linux ib_iser's login receive buffer: headers plus its data room.
const LINUX_RECV_LEN: usize = HEADERS_LEN + peer::LINUX_LOGIN_RECV_DATA;
/// Bytes of one send slot: illumos's fixed message, which no send exceeds.
const SEND_SLOT_LEN: usize = peer::ILLUMOS_MSG_LEN;
/// Receives and sends beyond the command slots: NOP-Ins, async messages,
/// rejects, and our NOP-Outs, text and logout.
const EXTRA_SLOTS: usize = 16;
/// What our NOP-Out pings carry (and the echo must carry back).
const PING_DATA: &[u8] = b"ramslog-ping";
/// Largest unanswered control PDU backlog before the target is at fault.
const MAX_CONTROL_BACKLOG: usize = 64;

/// Work request kinds (`WrId::kind`); the slot is a receive or send slot.
const RECV_WR: u32 = 0;
const SEND_WR: u32 = 1;

/// Which initiator to behave like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IserProfile {
    /// Linux ib_iser with open-iscsi: CM private data `iser_cm_hdr` (flags in
    /// byte 0), RFC 7145 login keys (`RDMAExtensions=Yes`, I/T RDSL),
    /// ImmediateData=Yes, the write VA pointing past the unsolicited data (as
    /// `iser_prepare_write_cmd` does), and 128 bytes of data room per receive
    /// in full feature phase.
    Linux,
    /// illumos `iser`: 56 bytes of private data with 0xC0 in byte 3 and
    /// uninitialised bytes after it, no iSER login keys (its RFC 7143 key
    /// set), 16 KiB receive buffers, 4 RDMA READ credits each way, retry and
    /// RNR retry counts of 2, and a login that fails unless
    /// MaxOutstandingR2T=1, MaxConnections=1 and ErrorRecoveryLevel=0 come back.
    Illumos,
}

impl IserProfile {
    pub fn name(self) -> &'static str {
        match self {
            IserProfile::Linux => "linux",
            IserProfile::Illumos => "illumos",
        }
    }

    /// Set the profile's key values on `p`; they replace the caller's
    /// (names, session type, CHAP and ISID stay).
    pub fn apply(self, p: &mut LoginParams) {
        p.header_digest = crate::Digest::None;
        p.data_digest = crate::Digest::None;
        p.max_recv_data_segment_length = 8192;
        p.initial_r2t = true;
        p.immediate_data = true;
        match self {
            IserProfile::Linux => {
                p.dialect = LoginDialect::IserRdmaExtensions;
                // open-iscsi's defaults (iscsid.conf).
                p.first_burst_length = 262_144;
                p.max_burst_length = 16_776_192;
            }
            IserProfile::Illumos => {
                p.dialect = LoginDialect::Illumos;
                // sys/iscsi_protocol.h defaults.
                p.first_burst_length = 65_536;
                p.max_burst_length = 262_144;
            }
        }
    }

    /// The iSER part of the CM REQ private data (rdma_cm adds its own IP header).
    fn private_data(self) -> Vec<u8> {
        match self {
            IserProfile::Linux => LINUX_CM_PRIVATE_DATA.to_vec(),
            IserProfile::Illumos => {
                // {rsvd1:30, sie:1, zbvae:1} little-endian: 0xC0 in byte 3;
                // `rsvd2[52]` is never initialised: garbage, never zero here.
                let mut d: Vec<u8> = (0..56).map(|_| rand::random::<u8>() | 0x01).collect();
                d[..4].copy_from_slice(&[0, 0, 0, 0xC0]);
                d
            }
        }
    }

    fn recv_len(self) -> usize {
        match self {
            IserProfile::Linux => LINUX_RECV_LEN,
            IserProfile::Illumos => peer::ILLUMOS_MSG_LEN,
        }
    }
}

/// Session sizes and behaviour.
#[derive(Debug, Clone)]
pub struct IserOptions {
    pub profile: IserProfile,
    /// Commands in flight at most (each has its own registered buffer).
    pub queue_depth: usize,
    /// Largest data transfer of one command, bytes.
    pub max_transfer: usize,
    /// Empty completion-queue polls before sleeping on the completion channel.
    pub spin: u32,
    /// How long to wait for any answer from the target before the session fails.
    pub timeout: Duration,
    /// Send a NOP-Out ping after this long without receiving anything (and
    /// without pinging): illumos `ISCSI_DEFAULT_NOP_DELAY`, open-iscsi
    /// `noop_out_interval`, both 5 s. `None`: never on our own.
    pub idle_ping: Option<Duration>,
    /// How often the target may retry a SEND that finds no receive posted
    /// (the CM connect parameter; 7 means for ever). `None`: the profile's
    /// value (Linux 6, illumos 2).
    pub rnr_retry: Option<u8>,
}

impl IserOptions {
    pub fn new(profile: IserProfile) -> IserOptions {
        IserOptions {
            profile,
            queue_depth: 16,
            max_transfer: 256 * 1024,
            spin: 0,
            timeout: Duration::from_secs(30),
            idle_ping: Some(Duration::from_secs(5)),
            rnr_retry: None,
        }
    }
}

/// A submitted command: its initiator task tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag(u32);

impl Tag {
    pub fn itt(self) -> u32 {
        self.0
    }
    fn slot(self) -> usize {
        (self.0 & 0xffff) as usize
    }
    fn generation(self) -> u16 {
        (self.0 >> 16) as u16
    }
}

/// How a command ended at the SCSI level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IserStatus {
    pub status: u8,
    pub sense: Option<Sense>,
    pub residual: Residual,
    /// Read data the target placed in the command's buffer: the expected
    /// length less any underflow.
    pub data_in_len: u32,
}

impl IserStatus {
    pub fn is_good(&self) -> bool {
        self.status == ramslog_common::scsi_wire::status::GOOD
    }

    /// Err(Error::Scsi) unless the status is GOOD.
    pub fn check(self) -> Result<IserStatus, Error> {
        check_status(self.status, self.sense).map(|()| self)
    }
}

/// A finished command.
#[derive(Debug, Clone)]
pub struct Completion {
    pub tag: Tag,
    /// Err for an iSCSI-level failure of this command (Reject, a non-zero
    /// response code); SCSI errors are an `Ok` status.
    pub result: Result<IserStatus, Error>,
}

/// Counters of what happened on the session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IserStats {
    pub commands: u64,
    /// Target NOP-In pings (TTT != 0xffffffff) we answered.
    pub target_pings_answered: u64,
    /// NOP-Out pings we sent (explicit and idle).
    pub pings_sent: u64,
    /// Of those, the ones sent because nothing arrived for `idle_ping`.
    pub idle_pings_sent: u64,
    /// NOP-In echoes of our pings.
    pub ping_replies: u64,
    pub async_messages: u64,
    /// Largest message received (iSER header included), bytes.
    pub largest_message: u32,
    /// Largest data segment received in full feature phase, bytes.
    pub largest_full_feature_data: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskState {
    Free,
    Busy {
        data_in_len: u32,
    },
    /// Completed: its read data stays in the buffer until the slot is reused.
    Done {
        data_in_len: u32,
    },
}

struct Task {
    buf: RegisteredBuffer,
    generation: u16,
    state: TaskState,
}

/// What a received PDU asks of the session (decided while its receive
/// buffer is borrowed).
enum Rx {
    Response {
        itt: u32,
        status: Result<crate::datain::ResponseStatus, Error>,
    },
    TargetPing {
        bhs: Bhs,
        data: Vec<u8>,
    },
    /// A PDU a waiting call picks up: Login/Text/Logout Response, NOP-In
    /// echo, Reject of a non-command.
    Control {
        bhs: Bhs,
        data: Vec<u8>,
    },
    Reject {
        itt: u32,
        reason: u8,
        bhs: Bhs,
        data: Vec<u8>,
    },
    Ignore,
}

/// A logged-in iSER session (or one logging in). Blocking; one thread.
pub struct IserSession {
    // Field order is drop order: the QP goes before the buffers it used.
    rdma: Rdma,
    tasks: Vec<Task>,
    free_tasks: VecDeque<usize>,
    done: VecDeque<Completion>,
    control: VecDeque<(Bhs, Vec<u8>)>,
    seq: SeqState,
    next_ctl_itt: u32,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    session_type: SessionType,
    negotiated: Negotiated,
    opts: IserOptions,
    /// Largest data segment we accept now.
    max_rx_data: u32,
    full_feature: bool,
    logging_out: bool,
    peer_disconnected: bool,
    fatal: Option<Error>,
    last_rx: Instant,
    last_ping: Instant,
    /// Our idle ping awaiting its echo: (ITT, sent at).
    idle_ping: Option<(u32, Instant)>,
    stats: IserStats,
    block_sizes: Vec<(u64, u32)>,
}

impl IserSession {
    /// Connect to `addr` over iSER and log in. The profile's key values
    /// replace those of `params` ([`IserProfile::apply`]).
    pub fn connect(
        addr: SocketAddr,
        params: &LoginParams,
        opts: &IserOptions,
    ) -> Result<IserSession, Error> {
        if opts.queue_depth == 0 || opts.queue_depth > 0x7fff {
            return Err(Error::InvalidArgument(format!(
                "queue depth {} (1..=32767)",
                opts.queue_depth
            )));
        }
        if opts.max_transfer == 0 || opts.max_transfer > 1 << 30 {
            return Err(Error::InvalidArgument(format!(
                "max transfer {} bytes (1 B..=1 GiB)",
                opts.max_transfer
            )));
        }
        let mut p = params.clone();
        opts.profile.apply(&mut p);
        let rdma = Rdma::connect(addr, opts)?;
        let mut tasks = Vec::new();
        if p.session_type == SessionType::Normal {
            let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
            for _ in 0..opts.queue_depth {
                tasks.push(Task {
                    buf: RegisteredBuffer::new(&rdma.pd, opts.max_transfer, access)?,
                    generation: 1,
                    state: TaskState::Free,
                });
            }
        }
        let now = Instant::now();
        let mut s = IserSession {
            rdma,
            free_tasks: (0..tasks.len()).collect(),
            done: VecDeque::with_capacity(tasks.len()),
            tasks,
            control: VecDeque::with_capacity(8),
            seq: SeqState::default(),
            next_ctl_itt: rand::random::<u32>() & 0x00ff_ffff,
            isid: [0; 6],
            tsih: 0,
            cid: p.cid,
            session_type: p.session_type,
            negotiated: Negotiated::defaults(p.max_recv_data_segment_length),
            opts: opts.clone(),
            max_rx_data: LOGIN_MAX_DATA,
            full_feature: false,
            logging_out: false,
            peer_disconnected: false,
            fatal: None,
            last_rx: now,
            last_ping: now,
            idle_ping: None,
            stats: IserStats::default(),
            block_sizes: Vec::new(),
        };
        s.login(&p)?;
        Ok(s)
    }

    /// Connect to an `iser://` URL's target and LUN's session, logging in
    /// as `initiator_name` (with the URL's CHAP credentials, if any).
    pub fn connect_url(
        url: &TargetUrl,
        initiator_name: &str,
        opts: &IserOptions,
    ) -> Result<IserSession, Error> {
        if url.transport != Transport::Iser {
            return Err(Error::InvalidArgument(format!(
                "{url} is not an iser:// URL"
            )));
        }
        IserSession::connect(url.resolve()?, &url.login_params(initiator_name), opts)
    }

    fn login(&mut self, p: &LoginParams) -> Result<(), Error> {
        let deadline = Instant::now() + self.opts.timeout;
        let itt = self.ctl_itt();
        let (mut m, mut b, mut data) = LoginMachine::start(p, itt, &mut self.seq)?;
        self.isid = m.isid();
        let outcome = loop {
            self.send(&Header::PLAIN, &b, &data, deadline)?;
            let (rsp, rdata) = self.wait_control(itt, "a Login Response", deadline)?;
            match m.handle(&rsp, &rdata, &mut self.seq)? {
                LoginStep::Send(nb, nd) => (b, data) = (nb, nd),
                LoginStep::Done(o) => break o,
            }
        };
        let neg = outcome.negotiated;
        self.check_profile_answers(&neg)?;
        self.tsih = outcome.tsih;
        self.max_rx_data = neg.max_recv_data_segment_length;
        if self.opts.profile == IserProfile::Linux && self.session_type == SessionType::Normal {
            self.max_rx_data = self.max_rx_data.min(peer::LINUX_FULL_FEATURE_RECV_DATA);
        }
        self.negotiated = neg;
        self.full_feature = true;
        Ok(())
    }

    /// What each profile's initiator insists on after login.
    fn check_profile_answers(&self, neg: &Negotiated) -> Result<(), Error> {
        match self.opts.profile {
            IserProfile::Linux => {
                if !neg.rdma_extensions {
                    return Err(Error::proto(format!(
                        "the target answered RDMAExtensions={:?}; open-iscsi over iSER needs Yes",
                        get(&neg.target_keys, "RDMAExtensions")
                    )));
                }
            }
            IserProfile::Illumos => {
                // iscsi_process_login_response: NEGO_FAIL unless these come back
                // (MaxOutstandingR2T and MaxConnections are skipped for discovery).
                let mut required = vec![("ErrorRecoveryLevel", "0")];
                if self.session_type == SessionType::Normal {
                    required.extend([("MaxOutstandingR2T", "1"), ("MaxConnections", "1")]);
                }
                for (key, want) in required {
                    match get(&neg.target_keys, key) {
                        Some(v) if v == want => {}
                        got => {
                            return Err(Error::proto(format!(
                                "the target answered {key}={got:?}: the illumos initiator fails \
                                 the login (NEGO_FAIL) unless {key}={want}"
                            )))
                        }
                    }
                }
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- accessors

    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }
    pub fn profile(&self) -> IserProfile {
        self.opts.profile
    }
    pub fn isid(&self) -> [u8; 6] {
        self.isid
    }
    pub fn tsih(&self) -> u16 {
        self.tsih
    }
    pub fn seq(&self) -> SeqState {
        self.seq
    }
    pub fn stats(&self) -> IserStats {
        self.stats
    }
    /// Largest data segment the target may send us now.
    pub fn max_recv_data(&self) -> u32 {
        self.max_rx_data
    }
    pub fn queue_depth(&self) -> usize {
        self.tasks.len()
    }
    pub fn max_transfer(&self) -> usize {
        self.opts.max_transfer
    }
    /// Commands submitted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.tasks
            .iter()
            .filter(|t| matches!(t.state, TaskState::Busy { .. }))
            .count()
    }
    /// Change the idle ping interval ([`IserOptions::idle_ping`]).
    pub fn set_idle_ping(&mut self, every: Option<Duration>) {
        self.opts.idle_ping = every;
    }
    /// The sticky error that ended the session, if any.
    pub fn error(&self) -> Option<Error> {
        self.fatal.clone()
    }

    // ---------------------------------------------------------------- commands

    /// Submit a SCSI command; `data_out` is copied into the command's
    /// registered buffer. Blocks while the command window or every command
    /// slot is full. Either `data_out` or `data_in_len` (or neither).
    pub fn submit(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: &[u8],
        data_in_len: u32,
    ) -> Result<Tag, Error> {
        let len = u32::try_from(data_out.len())
            .map_err(|_| Error::InvalidArgument("Data-Out longer than 4 GiB".into()))?;
        self.submit_in_place(lun, cdb, len, data_in_len, |buf| {
            buf.copy_from_slice(data_out)
        })
    }

    /// Like [`submit`](Self::submit), but `fill` writes the `data_out_len`
    /// bytes of write data straight into the registered buffer (no copy).
    pub fn submit_in_place(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out_len: u32,
        data_in_len: u32,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Tag, Error> {
        self.check()?;
        if !self.full_feature || self.session_type != SessionType::Normal {
            return Err(Error::InvalidArgument(
                "SCSI commands need a logged-in Normal session".into(),
            ));
        }
        let lun_field = encode_lun(lun)?;
        if cdb.is_empty() || cdb.len() > 16 {
            return Err(Error::Unsupported(format!(
                "CDB of {} bytes (1..=16 over iSER here)",
                cdb.len()
            )));
        }
        if data_out_len > 0 && data_in_len > 0 {
            return Err(Error::Unsupported("bidirectional commands".into()));
        }
        let out_len = data_out_len as usize;
        if out_len.max(data_in_len as usize) > self.opts.max_transfer {
            return Err(Error::InvalidArgument(format!(
                "{} bytes exceed the {}-byte command buffer",
                out_len.max(data_in_len as usize),
                self.opts.max_transfer
            )));
        }
        let deadline = Instant::now() + self.opts.timeout;
        while self.free_tasks.is_empty() || !self.seq.window_open() {
            if self.free_tasks.is_empty() && self.outstanding() == 0 {
                return Err(Error::InvalidArgument(
                    "every command slot holds a completion nobody collected: call wait()".into(),
                ));
            }
            self.turn_or_timeout(deadline, "a free command slot and an open command window")?;
        }
        let Some(slot) = self.free_tasks.pop_front() else {
            return Err(Error::InvalidArgument("no free command slot".into()));
        };
        let task = &mut self.tasks[slot];
        task.generation = if task.generation >= 0x7fff {
            1
        } else {
            task.generation + 1
        };
        let tag = Tag(u32::from(task.generation) << 16 | slot as u32);
        if out_len > 0 {
            let Some(dst) = task.buf.bytes_mut(0..out_len) else {
                return Err(Error::InvalidArgument(format!(
                    "{out_len} bytes of Data-Out exceed the task buffer"
                )));
            };
            fill(dst);
        }
        let neg = &self.negotiated;
        let imm_len = if neg.immediate_data {
            out_len
                .min(neg.first_burst_length as usize)
                .min(neg.target_max_recv_data_segment_length as usize)
                .min(SEND_SLOT_LEN - HEADERS_LEN)
        } else {
            0
        };
        let va = task.buf.addr();
        let stag = task.buf.rkey();
        let write = (out_len > imm_len).then(|| RemoteBuffer {
            stag,
            // Linux points the write VA past the unsolicited data; illumos
            // sends the buffer's start (it never has immediate data with a
            // COMSTAR-like target).
            va: match self.opts.profile {
                IserProfile::Linux => va + imm_len as u64,
                IserProfile::Illumos => va,
            },
        });
        let read = (data_in_len > 0).then_some(RemoteBuffer { stag, va });
        let mut b = Bhs::new(Opcode::ScsiCommand);
        let mut flags = 0x80 | (scsi_cmd::ATTR_MASK & 1); // F, SIMPLE
        if out_len > 0 {
            flags |= scsi_cmd::WRITE;
        }
        if data_in_len > 0 {
            flags |= scsi_cmd::READ;
        }
        b.set_flags(flags);
        b.set_lun(lun_field).set_itt(tag.0);
        b.set_expected_data_len(if out_len > 0 {
            data_out_len
        } else {
            data_in_len
        });
        b.0[32..32 + cdb.len()].copy_from_slice(cdb);
        let cmdsn = self.seq.take_cmdsn();
        b.set_cmdsn(cmdsn).set_exp_statsn(self.seq.exp_statsn);
        task.state = TaskState::Busy { data_in_len };
        let header = Header::Control { write, read };
        // Free slots exist: the send queue has room for every command slot.
        while self.rdma.free_send.is_empty() {
            self.turn_or_timeout(deadline, "a free send slot")?;
        }
        let task = &self.tasks[slot];
        let imm = task
            .buf
            .bytes(0..imm_len)
            .ok_or_else(|| Error::Rdma("immediate data beyond the task buffer".into()))?;
        if let Err(e) = self.rdma.post_pdu(&header, &b, imm) {
            return Err(self.fail(e));
        }
        self.stats.commands += 1;
        Ok(tag)
    }

    /// Hand a completion to the caller: its slot may be reused from now on
    /// (the least recently freed first, so its read data lasts).
    fn collect(&mut self, c: Completion) -> Completion {
        self.free_tasks.push_back(c.tag.slot());
        c
    }

    /// The next completed command, waiting for one if none is ready.
    pub fn wait(&mut self) -> Result<Completion, Error> {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(self.collect(c));
            }
            self.check()?;
            if self.outstanding() == 0 {
                return Err(Error::InvalidArgument("no command is outstanding".into()));
            }
            self.turn_or_timeout(deadline, "a SCSI Response")?;
        }
    }

    /// A completed command if one is ready; never sleeps.
    pub fn poll(&mut self) -> Result<Option<Completion>, Error> {
        if self.done.is_empty() {
            self.check()?;
            let r = self.poll_once();
            self.sticky(r)?;
        }
        Ok(self.done.pop_front().map(|c| self.collect(c)))
    }

    /// Wait for the command `tag` (completions of others are kept for
    /// [`wait`](Self::wait)).
    pub fn wait_for(&mut self, tag: Tag) -> Result<Completion, Error> {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            if let Some(i) = self.done.iter().position(|c| c.tag == tag) {
                if let Some(c) = self.done.remove(i) {
                    return Ok(self.collect(c));
                }
            }
            self.check()?;
            match self.tasks.get(tag.slot()) {
                Some(t)
                    if t.generation == tag.generation()
                        && matches!(t.state, TaskState::Busy { .. }) => {}
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{tag:?} is not outstanding"
                    )))
                }
            }
            self.turn_or_timeout(deadline, "a SCSI Response")?;
        }
    }

    /// The read data of a completed command; valid until its slot is reused
    /// by a later submit after the completion was collected (then
    /// InvalidArgument).
    pub fn data_in(&self, tag: Tag) -> Result<&[u8], Error> {
        match self.tasks.get(tag.slot()) {
            Some(t) if t.generation == tag.generation() => match t.state {
                TaskState::Done { data_in_len } => t
                    .buf
                    .bytes(0..data_in_len as usize)
                    .ok_or_else(|| Error::Rdma("Data-In beyond the task buffer".into())),
                _ => Err(Error::InvalidArgument(format!("{tag:?} has not completed"))),
            },
            _ => Err(Error::InvalidArgument(format!(
                "{tag:?}: its buffer was reused"
            ))),
        }
    }

    /// Run one command to completion: submit, wait, copy the read data to
    /// `data_in` (its length is the expected read length).
    pub fn command(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: &[u8],
        data_in: &mut [u8],
    ) -> Result<IserStatus, Error> {
        let in_len = u32::try_from(data_in.len())
            .map_err(|_| Error::InvalidArgument("Data-In longer than 4 GiB".into()))?;
        let tag = self.submit(lun, cdb, data_out, in_len)?;
        let st = self.wait_for(tag)?.result?;
        if in_len > 0 {
            let got = self.data_in(tag)?;
            data_in[..got.len()].copy_from_slice(got);
        }
        Ok(st)
    }

    /// WRITE (16) of `data`, a whole number of the LUN's blocks.
    pub fn write16(&mut self, lun: u64, lba: u64, data: &[u8], fua: bool) -> Result<(), Error> {
        let blocks = self.blocks(lun, data.len())?;
        self.command(lun, &cdb::write16(lba, blocks, fua), data, &mut [])?
            .check()
            .map(|_| ())
    }

    /// READ (16) filling `out` (a whole number of blocks); errors unless
    /// GOOD and every byte came.
    pub fn read16(&mut self, lun: u64, lba: u64, out: &mut [u8]) -> Result<(), Error> {
        let blocks = self.blocks(lun, out.len())?;
        let st = self
            .command(lun, &cdb::read16(lba, blocks), &[], out)?
            .check()?;
        if st.data_in_len as usize != out.len() {
            return Err(Error::proto(format!(
                "READ moved {} of {} bytes with GOOD status",
                st.data_in_len,
                out.len()
            )));
        }
        Ok(())
    }

    fn blocks(&mut self, lun: u64, len: usize) -> Result<u32, Error> {
        let bs = self.block_size(lun)? as usize;
        if len == 0 || !len.is_multiple_of(bs) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes is not a whole number of {bs}-byte blocks"
            )));
        }
        u32::try_from(len / bs).map_err(|_| Error::InvalidArgument("too many blocks".into()))
    }

    /// The LUN's logical block length (READ CAPACITY (16), asked once).
    pub fn block_size(&mut self, lun: u64) -> Result<u32, Error> {
        if let Some((_, bs)) = self.block_sizes.iter().find(|(l, _)| *l == lun) {
            return Ok(*bs);
        }
        Ok(self.read_capacity16(lun)?.1)
    }

    /// READ CAPACITY (16): (last LBA, logical block length).
    pub fn read_capacity16(&mut self, lun: u64) -> Result<(u64, u32), Error> {
        let mut d = [0u8; 32];
        let st = self
            .command(lun, &cdb::read_capacity16(32), &[], &mut d)?
            .check()?;
        if st.data_in_len < 12 {
            return Err(Error::proto(format!(
                "READ CAPACITY (16) returned {} bytes",
                st.data_in_len
            )));
        }
        let (last, bs) = (be64(&d, 0), be32(&d, 8));
        if bs == 0 {
            return Err(Error::proto("READ CAPACITY (16) reports block length 0"));
        }
        self.block_sizes.retain(|(l, _)| *l != lun);
        self.block_sizes.push((lun, bs));
        Ok((last, bs))
    }

    pub fn sync_cache(&mut self, lun: u64) -> Result<(), Error> {
        self.command(lun, &cdb::sync_cache10(), &[], &mut [])?
            .check()
            .map(|_| ())
    }

    pub fn test_unit_ready(&mut self, lun: u64) -> Result<IserStatus, Error> {
        self.command(lun, &cdb::test_unit_ready(), &[], &mut [])
    }

    /// INQUIRY: the bytes the target sent (at most `alloc`).
    pub fn inquiry(
        &mut self,
        lun: u64,
        evpd: bool,
        page: u8,
        alloc: u16,
    ) -> Result<Vec<u8>, Error> {
        let mut d = vec![0u8; usize::from(alloc)];
        let st = self
            .command(lun, &cdb::inquiry(evpd, page, alloc), &[], &mut d)?
            .check()?;
        d.truncate(st.data_in_len as usize);
        Ok(d)
    }

    // ---------------------------------------------------------------- control

    /// NOP-Out ping (immediate, with data); waits for the echo. Returns the
    /// round-trip time.
    pub fn nop(&mut self) -> Result<Duration, Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        let itt = self.ctl_itt();
        let b = self.ping(itt);
        let sent = Instant::now();
        self.send(&Header::PLAIN, &b, PING_DATA, deadline)?;
        self.stats.pings_sent += 1;
        self.last_ping = sent;
        let (rsp, data) = self.wait_control(itt, "a NOP-In echo", deadline)?;
        match rsp.opcode() {
            Some(Opcode::NopIn) if data == PING_DATA => {
                self.stats.ping_replies += 1;
                Ok(sent.elapsed())
            }
            Some(Opcode::NopIn) => {
                Err(self.fail(Error::proto("the NOP-In does not echo the ping data")))
            }
            Some(Opcode::Reject) => Err(Error::Rejected { reason: rsp.0[2] }),
            _ => Err(self.fail(Error::proto(format!(
                "unexpected {rsp:?} answering a NOP-Out"
            )))),
        }
    }

    /// A test hook for targets: behave as a peer that takes nothing. Send up
    /// to `count` immediate NOP-Out pings, each of which asks for a NOP-In,
    /// while never handling a receive or reposting a receive buffer (send
    /// completions are still reaped, to reuse send slots). Stops at
    /// `deadline` or once the send queue makes no progress for a second.
    /// Returns the pings sent; the session is useless afterwards.
    #[doc(hidden)]
    pub fn flood_pings_taking_nothing(
        &mut self,
        count: usize,
        deadline: Instant,
    ) -> Result<usize, Error> {
        self.check()?;
        let mut sent = 0;
        let mut wcs = [WorkCompletion::default(); 16];
        while sent < count && Instant::now() < deadline {
            let stalled_at = Instant::now();
            while self.rdma.free_send.is_empty() {
                let n = self.rdma.send_cq.poll(&mut wcs)?;
                for wc in &wcs[..n] {
                    if !wc.is_ok() {
                        return Ok(sent);
                    }
                    self.rdma.free_send.push(wc.wr_id.slot as usize);
                }
                if stalled_at.elapsed() > Duration::from_secs(1) || Instant::now() >= deadline {
                    return Ok(sent);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let itt = self.ctl_itt();
            let b = self.ping(itt);
            self.rdma.post_pdu(&Header::PLAIN, &b, PING_DATA)?;
            sent += 1;
        }
        Ok(sent)
    }

    fn ping(&self, itt: u32) -> Bhs {
        let mut b = Bhs::new(Opcode::NopOut);
        b.set_immediate(true);
        b.set_final(true)
            .set_itt(itt)
            .set_ttt(RESERVED_TAG)
            .set_cmdsn(self.seq.next_cmdsn)
            .set_exp_statsn(self.seq.exp_statsn);
        b
    }

    /// Do nothing for `dur` but keep the session alive as the profile's
    /// initiator would: answer target pings, ping after `idle_ping` of silence.
    pub fn idle(&mut self, dur: Duration) -> Result<(), Error> {
        let end = Instant::now() + dur;
        while Instant::now() < end {
            self.check()?;
            self.turn(end)?;
        }
        self.check()
    }

    /// A Text Request (with continuation) in full feature phase.
    pub fn text_request(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<Vec<(String, String)>, Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        let mut x = TextExchange::new(self.ctl_itt(), keys);
        loop {
            let (mut b, payload) = x.request()?;
            while !self.seq.window_open() {
                self.turn_or_timeout(deadline, "an open command window")?;
            }
            let sn = self.seq.take_cmdsn();
            b.set_cmdsn(sn).set_exp_statsn(self.seq.exp_statsn);
            self.send(&Header::PLAIN, &b, &payload, deadline)?;
            let (rsp, data) = self.wait_control(x.itt(), "a Text Response", deadline)?;
            match rsp.opcode() {
                Some(Opcode::TextResponse) => {
                    if let Some(keys) = x.response(&rsp, &data)? {
                        return Ok(keys);
                    }
                }
                Some(Opcode::Reject) => return Err(Error::Rejected { reason: rsp.0[2] }),
                _ => {
                    return Err(self.fail(Error::proto(format!(
                        "unexpected {rsp:?} answering a Text Request"
                    ))))
                }
            }
        }
    }

    /// `SendTargets=All`: each TargetName with its TargetAddress values.
    pub fn send_targets(&mut self) -> Result<Vec<(String, Vec<String>)>, Error> {
        let keys = self.text_request(&[("SendTargets".to_string(), "All".to_string())])?;
        parse_send_targets(&keys)
    }

    /// Log out (close the session): waits for outstanding commands, then
    /// for the Logout Response, then disconnects.
    pub fn logout(mut self) -> Result<(), Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        while self.outstanding() > 0 {
            self.turn_or_timeout(deadline, "outstanding commands before logout")?;
        }
        let itt = self.ctl_itt();
        let b = logout_request(itt, self.cid, self.seq.next_cmdsn, self.seq.exp_statsn);
        self.logging_out = true;
        self.send(&Header::PLAIN, &b, &[], deadline)?;
        let (rsp, _) = self.wait_control(itt, "a Logout Response", deadline)?;
        let r = match rsp.opcode() {
            Some(Opcode::LogoutResponse) => match rsp.0[2] {
                0 => Ok(()),
                code => Err(Error::proto(format!("Logout Response code {code}"))),
            },
            Some(Opcode::Reject) => Err(Error::Rejected { reason: rsp.0[2] }),
            _ => Err(Error::proto(format!("unexpected {rsp:?} answering Logout"))),
        };
        if !self.peer_disconnected {
            let _ = self.rdma.id.disconnect();
            let end = Instant::now() + Duration::from_secs(2);
            if let Err(e) = self.rdma.events.wait_for(CmEventKind::Disconnected, end) {
                tracing::debug!("iSER disconnect after logout: {e}");
            }
        }
        r
    }

    // ---------------------------------------------------------------- engine

    fn ctl_itt(&mut self) -> u32 {
        // Command tags have bit 31 clear; control tags set it (never 0xffffffff).
        self.next_ctl_itt = self.next_ctl_itt.wrapping_add(1) % 0x7fff_ffff;
        0x8000_0000 | self.next_ctl_itt
    }

    fn check(&self) -> Result<(), Error> {
        match &self.fatal {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Make `e` the session's sticky error (the first one stays) and return it.
    fn fail(&mut self, e: Error) -> Error {
        if self.fatal.is_none() {
            if self.logging_out {
                tracing::debug!(error = %e, "iSER session ended after logout");
            } else {
                tracing::warn!(error = %e, "iSER session failed");
            }
            self.fatal = Some(e);
        }
        self.fatal.clone().unwrap_or(Error::Closed)
    }

    fn sticky<T>(&mut self, r: Result<T, Error>) -> Result<T, Error> {
        r.map_err(|e| self.fail(e))
    }

    /// SEND a PDU, waiting for a free send slot.
    fn send(
        &mut self,
        header: &Header,
        bhs: &Bhs,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), Error> {
        while self.rdma.free_send.is_empty() {
            self.turn_or_timeout(deadline, "a free send slot")?;
        }
        let r = self.rdma.post_pdu(header, bhs, data);
        self.sticky(r)
    }

    /// Wait for the control PDU with `itt` (or a Reject of the PDU with it).
    fn wait_control(
        &mut self,
        itt: u32,
        what: &str,
        deadline: Instant,
    ) -> Result<(Bhs, Vec<u8>), Error> {
        loop {
            let hit = self.control.iter().position(|(b, d)| {
                b.itt() == itt
                    || (b.opcode() == Some(Opcode::Reject) && d.len() >= 48 && be32(d, 16) == itt)
            });
            if let Some(i) = hit {
                if let Some(found) = self.control.remove(i) {
                    return Ok(found);
                }
            }
            self.turn_or_timeout(deadline, what)?;
        }
    }

    /// One turn, or the session's timeout error once `deadline` has passed.
    fn turn_or_timeout(&mut self, deadline: Instant, what: &str) -> Result<(), Error> {
        if Instant::now() >= deadline {
            return Err(self.fail(Error::Timeout(what.to_string())));
        }
        self.turn(deadline)
    }

    /// Handle what has arrived; sleep until something does or `deadline`.
    fn turn(&mut self, deadline: Instant) -> Result<(), Error> {
        self.check()?;
        let r = self.turn_inner(deadline);
        self.sticky(r)
    }

    fn poll_once(&mut self) -> Result<usize, Error> {
        let n = self.reap()?;
        self.rdma.flush_reposts()?;
        Ok(n)
    }

    fn turn_inner(&mut self, deadline: Instant) -> Result<(), Error> {
        let mut spin = SpinBudget::new(self.opts.spin);
        loop {
            let found = self.poll_once()?;
            if found > 0 {
                return Ok(());
            }
            if self.peer_disconnected {
                // Everything that arrived before the disconnect is handled.
                return Err(Error::Closed);
            }
            let now = Instant::now();
            let next_ping = self.idle_ping_due(now)?;
            if now >= deadline {
                return Ok(());
            }
            if spin.poll_again(found) {
                continue;
            }
            spin.reset();
            // Receives always wake us; sends only when a send slot is awaited.
            let send_armed = self.rdma.free_send.is_empty();
            let armed_count = if send_armed { 2 } else { 1 };
            wait::arm(&[&*self.rdma.recv_cq, &*self.rdma.send_cq][..armed_count])?;
            if self.poll_once()? > 0 {
                return Ok(());
            }
            let wake = next_ping.map_or(deadline, |p| p.min(deadline));
            let woken = wait::sleep(
                &self.rdma.comp,
                &[&*self.rdma.recv_cq, &*self.rdma.send_cq][..armed_count],
                Some(&self.rdma.events),
                Some(wake.saturating_duration_since(now)),
            )?;
            if woken.cm {
                self.cm_events()?;
            }
            if woken.timed_out() && Instant::now() >= deadline {
                return Ok(());
            }
        }
    }

    /// Send the idle ping when due; the next time one may be due.
    fn idle_ping_due(&mut self, now: Instant) -> Result<Option<Instant>, Error> {
        let Some(every) = self.opts.idle_ping else {
            return Ok(None);
        };
        if !self.full_feature || self.logging_out {
            return Ok(None);
        }
        if let Some((_, sent)) = self.idle_ping {
            if now.duration_since(sent) > self.opts.timeout {
                return Err(Error::Timeout("the echo of our idle NOP-Out ping".into()));
            }
            return Ok(Some(sent + self.opts.timeout));
        }
        let due = self.last_rx.max(self.last_ping) + every;
        if now < due {
            return Ok(Some(due));
        }
        if self.rdma.free_send.is_empty() {
            return Ok(Some(now + Duration::from_millis(10)));
        }
        // illumos iscsi_timeout_checks: nothing received and no ping sent for
        // ISCSI_DEFAULT_NOP_DELAY: a NOP-Out with no data.
        let itt = self.ctl_itt();
        let b = self.ping(itt);
        self.rdma.post_pdu(&Header::PLAIN, &b, &[])?;
        self.idle_ping = Some((itt, now));
        self.last_ping = now;
        self.stats.pings_sent += 1;
        self.stats.idle_pings_sent += 1;
        tracing::debug!("idle for {every:?}: NOP-Out ping");
        Ok(Some(now + self.opts.timeout))
    }

    fn cm_events(&mut self) -> Result<(), Error> {
        loop {
            match self.rdma.events.get_event() {
                Ok(e) => {
                    tracing::debug!("iSER connection event {:?}", e.kind);
                    self.peer_disconnected |= e.kind.ends_connection();
                }
                Err(e) if e.is_would_block() => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn reap(&mut self) -> Result<usize, Error> {
        let mut wcs = [WorkCompletion::default(); 16];
        let mut total = 0;
        for recv in [true, false] {
            let cq = if recv {
                &self.rdma.recv_cq
            } else {
                &self.rdma.send_cq
            };
            let n = cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                self.completion(wc)?;
            }
            total += n;
        }
        Ok(total)
    }

    fn completion(&mut self, wc: &WorkCompletion) -> Result<(), Error> {
        let is_recv = wc.wr_id.kind == RECV_WR;
        let slot = wc.wr_id.slot as usize;
        if !wc.is_ok() {
            if wc.status == WcStatus::Flushed && (self.peer_disconnected || self.logging_out) {
                return Err(Error::Closed);
            }
            if is_recv && wc.status == WcStatus::LocalLength {
                return Err(Error::proto(format!(
                    "the target sent a message longer than our {}-byte receive buffer{}",
                    self.rdma.recv_len,
                    match self.opts.profile {
                        IserProfile::Illumos => " (illumos receives into fixed 16 KiB messages)",
                        IserProfile::Linux => " (ib_iser's login buffer: 76 + 8192 bytes)",
                    }
                )));
            }
            return Err(Error::Rdma(format!(
                "{} work request failed: {} (status {}, vendor error {:#x})",
                if is_recv { "receive" } else { "send" },
                wc.status_str(),
                wc.status.raw(),
                wc.vendor_err
            )));
        }
        if is_recv && slot < self.rdma.recv.len() {
            if wc.opcode != WcOpcode::Recv {
                return Err(Error::Rdma(format!(
                    "receive completion with opcode {:?}",
                    wc.opcode
                )));
            }
            let r = self.message(slot, wc.byte_len as usize);
            self.rdma.queue_recv(slot)?;
            r
        } else if wc.wr_id.kind == SEND_WR && slot < self.rdma.send.len() / SEND_SLOT_LEN {
            self.rdma.free_send.push(slot);
            Ok(())
        } else {
            Err(Error::Rdma(format!(
                "completion of an unknown work request {:?}",
                wc.wr_id
            )))
        }
    }

    /// One received message: an iSCSI PDU behind its iSER header.
    fn message(&mut self, slot: usize, len: usize) -> Result<(), Error> {
        self.stats.largest_message = self.stats.largest_message.max(len as u32);
        let (bhs, rx) = {
            let msg = self.rdma.recv[slot]
                .bytes(0..len)
                .ok_or_else(|| Error::Rdma(format!("{len}-byte receive completion")))?;
            match Header::decode(msg) {
                Ok(Header::Control { .. }) => {}
                Ok(h) => {
                    return Err(Error::proto(format!(
                        "the target sent {h:?}: initiators send Hello, targets answer it"
                    )))
                }
                Err(e) => return Err(Error::proto(format!("bad iSER header: {e}"))),
            }
            let bhs = msg
                .get(HEADER_LEN..HEADERS_LEN)
                .ok_or_else(|| Error::proto(format!("{len}-byte message holds no iSCSI header")))
                .and_then(|b| Bhs::decode(b).map_err(|e| Error::proto(e.to_string())))?;
            let data_start = HEADERS_LEN + bhs.total_ahs_len();
            let data_len = bhs.data_segment_len() as usize;
            // One PDU per message; the data segment may carry its iSCSI pad
            // to 4 bytes (LIO's isert sends it, ib_iser accepts it).
            let pdu_len = data_start + data_len;
            if pdu_len > len || len > ramslog_common::iscsi::padded(pdu_len) {
                return Err(Error::proto(format!(
                    "a {len}-byte message carries a PDU of {pdu_len} bytes (opcode {:#04x}; \
                     iSER sends one PDU per message)",
                    bhs.raw_opcode()
                )));
            }
            if bhs.data_segment_len() > self.max_rx_data {
                return Err(Error::proto(format!(
                    "data segment of {data_len} bytes exceeds the {} we receive{} (opcode {:#04x})",
                    self.max_rx_data,
                    if self.full_feature && self.opts.profile == IserProfile::Linux {
                        " (ib_iser's full-feature receive buffers hold 128 bytes of data)"
                    } else {
                        ""
                    },
                    bhs.raw_opcode()
                )));
            }
            let data = &msg[data_start..pdu_len];
            (bhs, classify(&bhs, data)?)
        };
        if self.full_feature {
            self.stats.largest_full_feature_data = self
                .stats
                .largest_full_feature_data
                .max(bhs.data_segment_len());
        }
        self.last_rx = Instant::now();
        self.seq.on_target_pdu(&bhs);
        match rx {
            Rx::Response { itt, status } => self.complete(itt, status),
            Rx::TargetPing { bhs, data } => {
                let b = nop_out_reply(&bhs, self.seq.next_cmdsn, self.seq.exp_statsn);
                if self.rdma.free_send.is_empty() {
                    return Err(Error::Rdma("no send slot to answer a NOP-In ping".into()));
                }
                self.rdma.post_pdu(&Header::PLAIN, &b, &data)?;
                self.stats.target_pings_answered += 1;
                Ok(())
            }
            Rx::Control { bhs, data } => {
                if bhs.opcode() == Some(Opcode::NopIn)
                    && self.idle_ping.is_some_and(|(itt, _)| itt == bhs.itt())
                {
                    self.idle_ping = None;
                    self.stats.ping_replies += 1;
                    return Ok(());
                }
                self.push_control(bhs, data)
            }
            Rx::Reject {
                itt,
                reason,
                bhs,
                data,
            } => {
                tracing::warn!(reason, itt, "the target rejected a PDU");
                if self.busy_task(itt).is_some() {
                    self.complete(itt, Err(Error::Rejected { reason }))
                } else {
                    self.push_control(bhs, data)
                }
            }
            Rx::Ignore => Ok(()),
        }
    }

    fn push_control(&mut self, bhs: Bhs, data: Vec<u8>) -> Result<(), Error> {
        if self.control.len() >= MAX_CONTROL_BACKLOG {
            return Err(Error::proto(format!(
                "{MAX_CONTROL_BACKLOG} unsolicited PDUs from the target nobody asked for"
            )));
        }
        self.control.push_back((bhs, data));
        Ok(())
    }

    fn busy_task(&self, itt: u32) -> Option<usize> {
        if itt & 0x8000_0000 != 0 {
            return None;
        }
        let tag = Tag(itt);
        let slot = tag.slot();
        self.tasks.get(slot).and_then(|t| {
            (t.generation == tag.generation() && matches!(t.state, TaskState::Busy { .. }))
                .then_some(slot)
        })
    }

    fn complete(
        &mut self,
        itt: u32,
        status: Result<crate::datain::ResponseStatus, Error>,
    ) -> Result<(), Error> {
        let Some(slot) = self.busy_task(itt) else {
            return Err(Error::proto(format!(
                "SCSI Response for ITT {itt:#x}, which no command of ours carries"
            )));
        };
        let TaskState::Busy {
            data_in_len: expected,
        } = self.tasks[slot].state
        else {
            return Err(Error::proto("task state changed under a response"));
        };
        let result = match status {
            Ok(r) => {
                let moved = match r.residual {
                    Residual::Under(n) if n <= expected => expected - n,
                    Residual::Under(n) if expected > 0 => {
                        return Err(Error::proto(format!(
                            "underflow of {n} bytes on a {expected}-byte read"
                        )))
                    }
                    _ => expected,
                };
                Ok(IserStatus {
                    status: r.status,
                    sense: r.sense,
                    residual: r.residual,
                    data_in_len: moved,
                })
            }
            Err(e @ Error::Protocol(_)) => return Err(e),
            Err(e) => Err(e),
        };
        let data_in_len = result.as_ref().map_or(0, |s| s.data_in_len);
        self.tasks[slot].state = TaskState::Done { data_in_len };
        // At most one completion per slot: the slot is free again once the
        // caller collects it, so this never grows past its capacity.
        self.done.push_back(Completion {
            tag: Tag(itt),
            result,
        });
        Ok(())
    }
}

/// Sort a received PDU (its data still in the receive buffer).
fn classify(bhs: &Bhs, data: &[u8]) -> Result<Rx, Error> {
    let itt = bhs.itt();
    Ok(match bhs.opcode() {
        Some(Opcode::ScsiResponse) => Rx::Response {
            itt,
            status: response_status(bhs, data),
        },
        Some(Opcode::NopIn) if itt == RESERVED_TAG => {
            if bhs.ttt() == RESERVED_TAG {
                Rx::Ignore // an unsolicited NOP-In that wants no answer
            } else {
                Rx::TargetPing {
                    bhs: *bhs,
                    data: data.to_vec(),
                }
            }
        }
        Some(Opcode::Reject) => {
            let rejected = if data.len() >= 48 {
                be32(data, 16)
            } else {
                RESERVED_TAG
            };
            Rx::Reject {
                itt: rejected,
                reason: bhs.0[2],
                bhs: *bhs,
                data: data.to_vec(),
            }
        }
        Some(Opcode::AsyncMessage) => {
            tracing::info!(
                event = bhs.0[36],
                vcode = bhs.0[37],
                "async message from the target"
            );
            Rx::Ignore
        }
        Some(Opcode::DataIn) | Some(Opcode::ReadyToTransfer) => {
            return Err(Error::proto(format!(
                "the target sent {:?} over iSER: read data must come by RDMA WRITE and write \
                 data is fetched by RDMA READ",
                bhs.opcode()
            )))
        }
        Some(op) if !op.is_initiator_opcode() => Rx::Control {
            bhs: *bhs,
            data: data.to_vec(),
        },
        _ => {
            return Err(Error::proto(format!(
                "the target sent opcode {:#04x}",
                bhs.raw_opcode()
            )))
        }
    })
}

/// Log in a Discovery session over iSER, ask `SendTargets=All`, log out.
pub fn discover(
    addr: SocketAddr,
    initiator_name: &str,
    chap: Option<ChapParams>,
    opts: &IserOptions,
) -> Result<Vec<(String, Vec<String>)>, Error> {
    let mut p = LoginParams::discovery(initiator_name);
    p.chap = chap;
    let mut s = IserSession::connect(addr, &p, opts)?;
    let targets = s.send_targets()?;
    if let Err(e) = s.logout() {
        tracing::debug!(error = %e, "iSER discovery logout");
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_set_their_keys() {
        let mut p = LoginParams::normal("iqn.i", "iqn.t");
        p.immediate_data = false;
        IserProfile::Linux.apply(&mut p);
        assert_eq!(p.dialect, LoginDialect::IserRdmaExtensions);
        let k = p.operational_keys();
        assert_eq!(get(&k, "RDMAExtensions"), Some("Yes"));
        assert_eq!(get(&k, "InitiatorRecvDataSegmentLength"), Some("8192"));
        assert_eq!(get(&k, "ImmediateData"), Some("Yes"));

        let mut p = LoginParams::normal("iqn.i", "iqn.t");
        IserProfile::Illumos.apply(&mut p);
        assert_eq!(p.dialect, LoginDialect::Illumos);
        let k = p.operational_keys();
        for (key, v) in [
            ("MaxRecvDataSegmentLength", "8192"),
            ("DefaultTime2Retain", "20"),
            ("InitialR2T", "Yes"),
            ("ImmediateData", "Yes"),
            ("MaxBurstLength", "262144"),
            ("FirstBurstLength", "65536"),
            ("MaxOutstandingR2T", "1"),
        ] {
            assert_eq!(get(&k, key), Some(v), "{key}");
        }
    }

    #[test]
    fn private_data_per_profile() {
        assert_eq!(IserProfile::Linux.private_data(), LINUX_CM_PRIVATE_DATA);
        let i = IserProfile::Illumos.private_data();
        assert_eq!(i.len(), 56);
        assert_eq!(&i[..4], &[0, 0, 0, 0xC0]);
        assert!(i[4..].iter().all(|b| *b != 0));
        let parsed = ramslog_common::iser::CmRequest::parse(&i);
        assert_eq!(parsed.peer, ramslog_common::iser::CmPeer::Illumos);
        assert_eq!(
            ramslog_common::iser::CmRequest::parse(&IserProfile::Linux.private_data()).peer,
            ramslog_common::iser::CmPeer::Linux
        );
    }

    #[test]
    fn tags() {
        let t = Tag(5 << 16 | 3);
        assert_eq!((t.slot(), t.generation()), (3, 5));
    }

    #[test]
    fn classify_rejects_data_pdus_and_sorts_the_rest() {
        let b = Bhs::new(Opcode::DataIn);
        assert!(matches!(classify(&b, &[]), Err(Error::Protocol(_))));
        let mut ping = Bhs::new(Opcode::NopIn);
        ping.set_itt(RESERVED_TAG).set_ttt(9);
        assert!(matches!(classify(&ping, b"x"), Ok(Rx::TargetPing { .. })));
        ping.set_ttt(RESERVED_TAG);
        assert!(matches!(classify(&ping, &[]), Ok(Rx::Ignore)));
        let mut rej = Bhs::new(Opcode::Reject);
        rej.0[2] = 4;
        let mut rejected = Bhs::new(Opcode::ScsiCommand);
        rejected.set_itt(0x10002);
        match classify(&rej, &rejected.0) {
            Ok(Rx::Reject { itt, reason, .. }) => assert_eq!((itt, reason), (0x10002, 4)),
            _ => panic!("expected a Reject"),
        }
        let mut rsp = Bhs::new(Opcode::ScsiResponse);
        rsp.set_itt(0x10001);
        assert!(matches!(
            classify(&rsp, &[]),
            Ok(Rx::Response {
                itt: 0x10001,
                status: Ok(_)
            })
        ));
        assert!(matches!(
            classify(&Bhs::new(Opcode::ScsiCommand), &[]),
            Err(Error::Protocol(_))
        ));
    }
}
