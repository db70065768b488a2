//! The sans-IO iSCSI engine: one `Connection` per transport connection.
//!
//! One input, [`Connection::handle`], carries everything a transport delivers
//! ([`Input`]: a whole PDU with the buffers its iSER header named, digests
//! already checked by the driver; a data digest error; an oversized PDU; a
//! finished RDMA READ; a timeout; a response that went out, which ends its
//! command's service time; the transport's end). Outputs: [`Connection::poll_event`]
//! (what the driver learns once: a normal session began, with its peer
//! profile and transfers), [`Connection::poll_action`] (PDUs to send, RDMA
//! transfers, close) and [`Connection::poll_timeout`]. The driver polls in
//! that order after every input: events, then `poll_action` until `None`,
//! then it re-arms its timer from `poll_timeout`. The engine never touches
//! sockets, and the current time is passed in; the one clock it reads
//! itself is [`metrics::clock`](crate::metrics::clock), for service times
//! when they are measured. Besides `handle` and the `poll_*` calls the
//! driver only asks: [`Connection::may_post_rdma_read`] before it posts a
//! READ it was told to, and facts fixed at login (`max_rx_data_segment`,
//! digests).
//!
//! Sessions have exactly one connection (MaxConnections=1, ErrorRecoveryLevel=0),
//! so the session state lives inside the connection.

mod io;
mod joining;
mod login;
mod output;
mod params;
mod session;
#[cfg(test)]
mod tests;
mod timers;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::iscsi::frame::Digests;
use ramslog_common::iscsi::{Bhs, Opcode, RejectReason};
use ramslog_common::iser::CmPeer;
use ramslog_common::serial;

pub use io::{Action, ConnInfo, Event, Input, OutData, OutPdu, ReadDest, RemoteBuffers, Transport};
pub use login::{LoginFailure, SessionKind};
pub use params::{IserPeer, Params};
pub use session::{ABORT_CUT_OFF, ISER_BUFFERED_READ_MAX};

use crate::admission::{SessionControl, Transfers};
use crate::iscsi::portal::Portal;
use crate::metrics::{LimitHit, Served};
use login::Login;
use output::{is_reserved, rejected_header, DataInStream, Out, Queued};
use session::Session;
use timers::{Timer, TimerTable};

/// Time2Retain of a restart's notice. At ErrorRecoveryLevel 0 nothing is
/// retained, but the illumos initiator takes Parameter3 as how long it
/// keeps trying to log in (every 5 s) before it falls back to polling once
/// a minute: 180 s is its own default window, so the notice never shortens
/// it. open-iscsi ignores Parameter3.
const RESTART_RECONNECT_WINDOW: u16 = 180;

/// How long a host waits after a planned restart dropped its connection
/// before it logs in again, by transport.
///
/// - TCP: at once, since the listening socket passes to the new program
///   and the kernel queues the login meanwhile.
/// - iSER: one second, since the rdma_cm listener cannot pass to the new
///   program (it listens again early in its start-up, before taking over
///   the memory) and open-iscsi waits 3 s more after a refused connect.
fn restart_time2wait(transport: Transport) -> u16 {
    match transport {
        Transport::Tcp => 0,
        Transport::Iser => 1,
    }
}

/// How often a reinstating login looks whether the old connections are gone.
const REINSTATEMENT_RECHECK: Duration = Duration::from_millis(5);
/// How long a reinstating login waits for them before it is refused with
/// Service Unavailable: a TCP connection ends at once, an iSER one within
/// its driver's sleep (100 ms) and the queue pair's destruction.
pub const REINSTATEMENT_WAIT: Duration = Duration::from_secs(5);
/// How long a discovery session asked to log out has before it is closed.
const DISCOVERY_LOGOUT_GRACE: Duration = Duration::from_secs(2);

enum Phase {
    Login(Box<Login>),
    /// The login succeeded and reinstated sessions whose connections have
    /// not released everything yet: its response waits until they have, so
    /// none of their writes can land after this session's.
    Reinstating(Box<Reinstating>),
    FullFeature(Box<Session>),
    /// The session ended for a planned restart and its host was told when
    /// to come back (over iSER), with the notice's StatSN: nothing more is
    /// processed, and the connection ends once a PDU of the host shows it
    /// took the notice, or at the restart drain (see `restarting`).
    Notified(u32),
    /// Sticky: nothing more is processed; queued PDUs can still be drained.
    Closed,
}

pub struct Connection {
    portal: Arc<Portal>,
    info: ConnInfo,
    control: Arc<SessionControl>,
    phase: Phase,
    actions: VecDeque<Queued>,
    /// Empty, and unallocated, but at login.
    events: VecDeque<Event>,
    timers: TimerTable,
    statsn: u32,
    /// CmdSN of the login request: the session's first CmdSN.
    login_cmdsn: Option<u32>,
    rx_header_digest: bool,
    rx_data_digest: bool,
    transport: Transport,
    /// When the connection was made: the login timeout runs from here.
    started: Instant,
    /// The first PDU arrived (until then the first-PDU timeout applies).
    heard_from: bool,
    /// A discovery session was asked to log out.
    logout_asked: bool,
    /// [`Input::Terminated`] was handled.
    termination_seen: bool,
}

struct Reinstating {
    session: Session,
    /// The login response, held.
    rsp: Bhs,
    text: Vec<u8>,
    old: Vec<Arc<SessionControl>>,
    give_up: Instant,
}

impl Connection {
    /// An iSCSI/TCP connection.
    pub fn tcp(
        portal: Arc<Portal>,
        info: ConnInfo,
        control: Arc<SessionControl>,
        now: Instant,
    ) -> Connection {
        let mrdsl = portal.limits.max_recv_data_segment_len;
        let login = Login::new(mrdsl, Transport::Tcp, info.peer.ip(), CmPeer::Unknown);
        Connection::with_login(portal, info, control, now, Transport::Tcp, login)
    }

    /// An iSER connection whose receive buffers hold `recv_data_len` bytes of
    /// data segment after the iSER header, BHS and AHS. `proposed` is the
    /// initiator family its connect request's private data looks like; the
    /// login confirms it (docs/iser-compat.md).
    pub fn iser(
        portal: Arc<Portal>,
        info: ConnInfo,
        control: Arc<SessionControl>,
        now: Instant,
        recv_data_len: u32,
        proposed: CmPeer,
    ) -> Connection {
        let login = Login::new(recv_data_len, Transport::Iser, info.peer.ip(), proposed);
        Connection::with_login(portal, info, control, now, Transport::Iser, login)
    }

    fn with_login(
        portal: Arc<Portal>,
        info: ConnInfo,
        control: Arc<SessionControl>,
        now: Instant,
        transport: Transport,
        login: Login,
    ) -> Connection {
        let mut timers = TimerTable::default();
        let first_pdu = portal
            .limits
            .first_pdu_timeout
            .min(portal.limits.login_timeout);
        timers.set(Timer::Login, now + first_pdu);
        Connection {
            portal,
            info,
            control,
            phase: Phase::Login(Box::new(login)),
            actions: VecDeque::with_capacity(64),
            events: VecDeque::new(),
            timers,
            statsn: 0,
            login_cmdsn: None,
            rx_header_digest: false,
            rx_data_digest: false,
            transport,
            started: now,
            heard_from: false,
            logout_asked: false,
            termination_seen: false,
        }
    }

    pub fn portal(&self) -> &Arc<Portal> {
        &self.portal
    }

    /// What the daemon ends this connection through (the tests end it).
    #[cfg(test)]
    pub(crate) fn control(&self) -> &Arc<SessionControl> {
        &self.control
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The one way in: whatever the transport delivers, at `now`.
    // Always inlined: each driver call names one variant, so inlined the
    // match folds away and the input is never built in memory; called, it
    // cost about 45 instructions per input (callgrind, iser read).
    #[inline(always)]
    pub fn handle(&mut self, now: Instant, input: Input<'_>) {
        match input {
            Input::Pdu {
                bhs,
                ahs,
                data,
                buffers,
            } => self.pdu(now, bhs, ahs, data, &buffers),
            Input::DataDigestError(bhs) => self.data_digest_error(now, bhs),
            Input::Oversized(bhs) => self.oversized(now, bhs),
            Input::RdmaReadDone { tag, data } => self.rdma_read_done(now, tag, data),
            Input::Timeout => self.timeout(now),
            Input::Served { served, at_raw } => self.served(served, at_raw),
            Input::Terminated => self.terminated(now),
            Input::Closed => self.shutdown(),
        }
    }

    /// The control was terminated: the restart notice if the control
    /// carries one, else the end, with nothing more sent.
    fn terminated(&mut self, now: Instant) {
        if self.termination_seen {
            return;
        }
        self.termination_seen = true;
        if self.control.take_restart_notice() {
            self.restarting(now, restart_time2wait(self.transport));
        } else {
            self.end_session();
            self.timers = TimerTable::default();
            self.actions.clear();
        }
    }

    /// A planned restart: a normal session's initiator learns that every
    /// connection is about to drop and when the new program will take its
    /// login. Without it open-iscsi waits the negotiated DefaultTime2Wait
    /// (2 s) before reconnecting. Nothing is answered after this.
    ///
    /// Over TCP the close follows at once: the host's stack hands it the
    /// notice before the end of the stream. Over iSER the drop is the
    /// connection manager's disconnect, which travels apart from the
    /// receive that holds the notice, and a Linux host that processes the
    /// disconnect first ignores the notice (iscsid takes no PDU of a failed
    /// connection). So a ping follows the notice and the connection waits
    /// for the host's receipt: any PDU whose ExpStatSN is past the notice
    /// (the answer to the ping at the latest), since a host takes PDUs in
    /// order. It waits no longer than the restart drain, after which the
    /// daemon closes every connection anyway.
    fn restarting(&mut self, now: Instant, time2wait: u16) {
        let mut awaiting = None;
        if let Phase::FullFeature(s) = &mut self.phase {
            if s.kind() == SessionKind::Normal {
                let mut out = Out {
                    q: &mut self.actions,
                    statsn: &mut self.statsn,
                };
                let notice = s.announce_drop(&mut out, time2wait, RESTART_RECONNECT_WINDOW);
                if self.transport == Transport::Iser {
                    s.send_ping(&mut out);
                    awaiting = Some(notice);
                }
            }
        }
        let Some(notice) = awaiting else {
            self.fail_close();
            return;
        };
        self.end_session();
        self.timers = TimerTable::default();
        self.timers.set(
            Timer::NoticeReceipt,
            now + self.portal.core.limits.restart_drain,
        );
        self.phase = Phase::Notified(notice);
    }

    /// A PDU's header after a restart's notice: close once it shows the
    /// host took the notice.
    fn notice_receipt(&mut self, bhs: &Bhs) {
        if let Phase::Notified(notice) = self.phase {
            if serial::gt(bhs.exp_statsn(), notice) {
                tracing::debug!(peer = %self.info.peer, "the host took the restart notice; closing");
                self.fail_close();
            }
        }
    }

    fn rdma_read_done(&mut self, now: Instant, tag: u32, data: &[u8]) {
        self.touch(now);
        if let Phase::FullFeature(s) = &mut self.phase {
            let mut out = Out {
                q: &mut self.actions,
                statsn: &mut self.statsn,
            };
            s.rdma_read_done(now, tag, data, &mut out);
        }
        self.poll_deferred(now);
    }

    /// Send the abort answers whose transfers settled; keep looking for
    /// the rest.
    fn poll_deferred(&mut self, now: Instant) {
        if let Phase::FullFeature(s) = &mut self.phase {
            let mut out = Out {
                q: &mut self.actions,
                statsn: &mut self.statsn,
            };
            match s.release_deferred(now, &mut out) {
                Some(at) => self.timers.set(Timer::Deferred, at),
                None => self.timers.clear(Timer::Deferred),
            }
        }
    }

    /// iSER: whether the RDMA READ `tag` may still be posted (its task
    /// stands, not aborted). The driver raises [`Self::transfers`] first.
    pub fn may_post_rdma_read(&self, tag: u32) -> bool {
        match &self.phase {
            Phase::FullFeature(s) => s.may_post_rdma_read(tag),
            _ => false,
        }
    }

    /// The logged-in session's transfers into LUN memory, which the driver
    /// counts its RDMA READs in (they outlive the session: the driver
    /// lowers them after its queue pair is destroyed).
    pub fn transfers(&self) -> Option<Arc<Transfers>> {
        match &self.phase {
            Phase::FullFeature(s) => Some(s.transfers().clone()),
            _ => None,
        }
    }

    /// Whether incoming PDUs carry header and data digests.
    pub fn rx_digests(&self) -> Digests {
        Digests {
            header: self.rx_header_digest,
            data: self.rx_data_digest,
        }
    }

    /// Largest data segment the driver should accept before handing a PDU over.
    /// Larger ones are a protocol error the engine reports itself.
    pub fn max_rx_data_segment(&self) -> u32 {
        match &self.phase {
            // Login and text PDUs carry at most 8 KiB until negotiated otherwise.
            Phase::Login(_) | Phase::Reinstating(_) => 8192,
            Phase::FullFeature(s) => s.params.target_mrdsl,
            // Only the header matters now: a PDU with data comes as
            // `Input::Oversized`, which carries it.
            Phase::Notified(_) | Phase::Closed => 0,
        }
    }

    /// The login finished: the connection is in full feature phase.
    #[cfg(test)]
    pub(crate) fn is_logged_in(&self) -> bool {
        matches!(self.phase, Phase::FullFeature(_))
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.phase, Phase::Closed)
    }

    /// Closed with nothing left to send: the driver ends the connection.
    pub fn has_ended(&self) -> bool {
        self.is_closed() && self.actions.is_empty()
    }

    /// Whether [`Input::Terminated`] was handled: the driver hands it over
    /// once.
    pub fn termination_seen(&self) -> bool {
        self.termination_seen
    }

    /// The next action. Data-In is produced here, one PDU per call, as the
    /// driver takes it: a queued READ costs one entry, not its PDUs.
    pub fn poll_action(&mut self) -> Option<Action> {
        match self.actions.front_mut()? {
            Queued::DataIn(stream) => {
                let (pdu, done) = stream.next_pdu();
                if done {
                    self.actions.pop_front();
                }
                Some(Action::Send(pdu))
            }
            Queued::Action(_) => match self.actions.pop_front() {
                Some(Queued::Action(a)) => Some(a),
                _ => None,
            },
        }
    }

    /// Whether actions are waiting to be polled.
    pub fn has_output(&self) -> bool {
        !self.actions.is_empty()
    }

    /// Entries waiting in the action queue (a Data-In stream counts once).
    pub fn queued_actions(&self) -> usize {
        self.actions.len()
    }

    /// What the driver must learn once (see [`Event`]): handle these before
    /// draining [`Self::poll_action`].
    #[inline]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// A response carrying `s` was posted or written at `now_raw`
    /// (`metrics::clock().raw()`): record the command's service time.
    #[inline]
    fn served(&self, s: Served, now_raw: u64) {
        if let Phase::FullFeature(session) = &self.phase {
            session.served(s, now_raw);
        }
    }

    fn data_digest_error(&mut self, now: Instant, bhs: &Bhs) {
        match self.phase {
            // The header is sound (its own digest passed).
            Phase::Notified(_) => return self.notice_receipt(bhs),
            Phase::Closed => return,
            _ => {}
        }
        tracing::warn!(peer = %self.info.peer, "data digest error on {:?}", bhs.opcode());
        self.touch(now);
        let keep = match &mut self.phase {
            Phase::FullFeature(s) => !s.data_digest_error(
                bhs,
                &mut Out {
                    q: &mut self.actions,
                    statsn: &mut self.statsn,
                },
            ),
            _ => false,
        };
        if !keep {
            self.fail_close();
        }
    }

    fn oversized(&mut self, now: Instant, bhs: &Bhs) {
        match self.phase {
            // Nothing is processed any more: no error to report.
            Phase::Notified(_) => return self.notice_receipt(bhs),
            Phase::Closed => return,
            _ => {}
        }
        self.touch(now);
        tracing::warn!(peer = %self.info.peer, len = bhs.data_segment_len(), "data segment longer than MaxRecvDataSegmentLength");
        if let Phase::FullFeature(s) = &mut self.phase {
            let mut out = Out {
                q: &mut self.actions,
                statsn: &mut self.statsn,
            };
            s.reject(&mut out, bhs, RejectReason::ProtocolError);
        }
        self.fail_close();
    }

    fn pdu(&mut self, now: Instant, bhs: &Bhs, ahs: &[u8], data: &[u8], buffers: &RemoteBuffers) {
        self.touch(now);
        if !std::mem::replace(&mut self.heard_from, true) {
            self.portal.core.gate.heard_from(&self.control);
            if self.timers.is_set(Timer::Login) {
                // The first PDU came in time: the whole login now has its own timeout.
                self.timers.set(
                    Timer::Login,
                    self.started + self.portal.limits.login_timeout,
                );
            }
        }
        match &mut self.phase {
            Phase::Closed => {}
            Phase::Notified(_) => self.notice_receipt(bhs),
            Phase::Login(_) => self.login_pdu(now, bhs, data),
            Phase::Reinstating(_) => {
                // Nothing may come before the login response.
                tracing::info!(peer = %self.info.peer, "PDU {:#04x} before the login response; closing", bhs.raw_opcode());
                self.fail_close();
            }
            Phase::FullFeature(s) => {
                let mut out = Out {
                    q: &mut self.actions,
                    statsn: &mut self.statsn,
                };
                if s.kind() == SessionKind::Discovery
                    && bhs.opcode() == Some(Opcode::TextRequest)
                    && !self.logout_asked
                {
                    self.timers.set(
                        Timer::DiscoveryIdle,
                        now + self.portal.limits.discovery_lifetime,
                    );
                }
                match s.handle_pdu(now, bhs, ahs, data, buffers, &mut out) {
                    session::Flow::Continue => {}
                    // touch() above re-armed the idle interval.
                    session::Flow::PingAnswered => self.timers.clear(Timer::NopResponse),
                    session::Flow::Close => self.fail_close(),
                }
                self.poll_deferred(now);
            }
        }
    }

    fn timeout(&mut self, now: Instant) {
        if self.timers.expired(Timer::Reinstatement, now) {
            self.timers.clear(Timer::Reinstatement);
            self.reinstatement_check(now);
        }
        if self.timers.expired(Timer::Login, now) {
            if self.heard_from {
                tracing::info!(peer = %self.info.peer, "login timed out");
            } else {
                tracing::debug!(peer = %self.info.peer, "no PDU within the first-PDU timeout; closing");
            }
            self.portal.core.counters.limit_hit(LimitHit::IdleLogins);
            self.timers.clear(Timer::Login);
            self.fail_close();
        }
        if self.timers.expired(Timer::Deferred, now) {
            self.poll_deferred(now);
        }
        if self.timers.expired(Timer::DiscoveryIdle, now) {
            self.timers.clear(Timer::DiscoveryIdle);
            self.discovery_idle(now);
        }
        if self.timers.expired(Timer::NoticeReceipt, now) {
            tracing::info!(peer = %self.info.peer, "the host did not confirm the restart notice within the restart drain; closing");
            self.fail_close();
        }
        if self.timers.expired(Timer::NopResponse, now) {
            tracing::warn!(peer = %self.info.peer, "initiator did not answer the NOP-In ping; closing the connection");
            self.timers.clear(Timer::NopResponse);
            self.fail_close();
        }
        if self.timers.expired(Timer::NopInterval, now) {
            // One ping at a time: while one is outstanding its response
            // deadline stands. Re-arming it on every interval would push the
            // deadline forward forever and a dead peer would never be dropped.
            self.timers.clear(Timer::NopInterval);
            let ping_outstanding = self.timers.is_set(Timer::NopResponse);
            if let (Phase::FullFeature(s), false) = (&mut self.phase, ping_outstanding) {
                let mut out = Out {
                    q: &mut self.actions,
                    statsn: &mut self.statsn,
                };
                s.send_ping(&mut out);
                self.timers
                    .set(Timer::NopResponse, now + self.portal.limits.nop_timeout);
            }
        }
    }

    /// The transport is gone: release the session's resources. Idempotent.
    fn shutdown(&mut self) {
        self.end_session();
        self.timers = TimerTable::default();
    }

    fn end_session(&mut self) {
        match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::FullFeature(s) => s.end(),
            Phase::Reinstating(r) => Box::new(r.session).end(),
            Phase::Login(_) | Phase::Notified(_) | Phase::Closed => {}
        }
    }

    /// A discovery session's lifetime ran out: ask for a logout, then,
    /// when the initiator does not heed it, close.
    fn discovery_idle(&mut self, now: Instant) {
        let Phase::FullFeature(s) = &mut self.phase else {
            return;
        };
        if self.logout_asked {
            tracing::info!(peer = %self.info.peer, "discovery session outlived its lifetime; closing");
            self.portal.core.counters.limit_hit(LimitHit::IdleLogins);
            self.fail_close();
            return;
        }
        self.logout_asked = true;
        let mut out = Out {
            q: &mut self.actions,
            statsn: &mut self.statsn,
        };
        s.ask_logout(&mut out, DISCOVERY_LOGOUT_GRACE.as_secs() as u16);
        self.timers
            .set(Timer::DiscoveryIdle, now + DISCOVERY_LOGOUT_GRACE);
    }

    fn touch(&mut self, now: Instant) {
        if matches!(self.phase, Phase::FullFeature(_)) {
            self.timers
                .set(Timer::NopInterval, now + self.portal.limits.nop_interval);
        }
    }

    fn fail_close(&mut self) {
        self.end_session();
        self.timers = TimerTable::default();
        self.actions.push_back(Queued::Action(Action::Close));
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shutdown();
    }
}
