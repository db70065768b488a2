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

use ramslog_common::iscsi::{scsi_cmd, Bhs, Opcode, RESERVED_TAG};
use ramslog_common::iser::{
    peer, Header, IserError, Message, RemoteBuffer, HEADERS_LEN, LINUX_CM_PRIVATE_DATA,
};
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

mod commands;
mod control;
mod engine;
mod transport;
use transport::Rdma;

/// iSER header plus BHS: where a PDU's AHS (and then data) starts in a message.
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
    /// Connect from this local address (a test playing several hosts);
    /// `None`: the one the route gives.
    pub source: Option<std::net::IpAddr>,
    /// Fill a read's registered buffer with [`POISON`] before the command
    /// goes out. A command slot's buffer serves its writes and its reads,
    /// so without this a read the target answered GOOD without placing a
    /// byte would hand back whatever the slot held last, often the very
    /// bytes a check expects. Checks turn it on; a benchmark leaves it off
    /// (it costs a memset per read).
    pub poison_reads: bool,
}

/// What a poisoned read buffer holds until the target's data lands.
pub const POISON: u8 = 0xe7;

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
            source: None,
            poison_reads: false,
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
mod tests;
