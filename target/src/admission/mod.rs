//! Admission: which connections the daemon keeps, whatever front end they
//! speak (iSCSI today) over whichever transport (TCP, RDMA), and the
//! staging budget they share. The gate is touched at connect, login and
//! close only, never per I/O.
//!
//! Three pools, so that nobody who has not authenticated can take the
//! places of those who have:
//! - **pending**: connected, not yet logged in. A global cap per transport
//!   and a cap per source; when the global cap is full one is evicted
//!   (silent ones before logins under way, then from the source that
//!   reconnects the most, then the one holding the most, then the oldest),
//!   so a flood ages out instead of locking the door.
//! - **discovery**: logged in to a discovery session (no ACL, no CHAP by
//!   default). Its own small caps; the engine ends such a session a while
//!   after its last Text exchange. Over RDMA a discovery session stays in
//!   the pending pool: it pins what a pending connection pins.
//! - **admitted**: passed the target's ACL and CHAP. The full caps, which
//!   pending and discovery connections never count against.
//!
//! Sources are IPv4 /32 and IPv6 /64 (one host's addresses).

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::metrics::{LimitHit, PortalCounters};

mod networks;
mod staging;
mod transfers;
pub use networks::{in_networks, parse_network};
pub use staging::StagingBudget;
pub use transfers::{CopyGuard, Transfers};

/// How a connection is ended from outside (session reinstatement, shutdown,
/// eviction) and how others learn that it is gone. The driver makes one per
/// connection and hands it to its [`Permit`], which marks it released when
/// dropped: after the engine ended and, on RDMA, after the queue pair was
/// destroyed, so no byte of that connection can land in LUN memory any more.
pub struct SessionControl {
    terminated: AtomicBool,
    /// The termination is a planned restart's: the driver tells the
    /// initiator when to reconnect before it closes (taken once).
    restart_notice: AtomicBool,
    released: AtomicBool,
    /// The permit watching it (0: none, e.g. an engine without a transport).
    permit: AtomicU64,
    /// Wakes a driver that waits for termination (TCP's select).
    wake: Notify,
    /// Nothing moves bytes for it (tests, benchmarks): it is released as
    /// soon as it is terminated.
    transportless: bool,
    /// An eventfd written at termination, for a driver that sleeps in
    /// poll(2) (iSER) rather than on `wake`.
    wake_fd: Option<OwnedFd>,
}

impl SessionControl {
    /// The control of a connection with a transport behind it.
    pub fn new() -> Arc<SessionControl> {
        Arc::new(SessionControl::with_transport(true))
    }

    /// The control of an engine driven without a transport.
    pub fn without_transport() -> Arc<SessionControl> {
        Arc::new(SessionControl::with_transport(false))
    }

    /// The control of a connection whose driver sleeps in poll(2): its
    /// termination also makes [`Self::wake_fd`] readable, so the driver
    /// acts on it at once (a planned restart waits for it only briefly).
    /// Without an eventfd it still ends, at its next wake-up.
    pub fn with_wake_fd() -> Arc<SessionControl> {
        let mut control = SessionControl::with_transport(true);
        control.wake_fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| tracing::warn!("no eventfd to wake the connection's driver: {e}"))
        .ok();
        Arc::new(control)
    }

    /// What the driver sleeps on besides its queues: readable once
    /// terminated.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.wake_fd.as_ref().map(AsFd::as_fd)
    }

    /// Read the wake-up (the driver saw it), so the next sleep sleeps.
    pub fn take_wake(&self) {
        if let Some(fd) = &self.wake_fd {
            let mut count = [0u8; 8];
            let _ = rustix::io::read(fd, &mut count);
        }
    }

    fn with_transport(transport: bool) -> SessionControl {
        SessionControl {
            wake_fd: None,
            terminated: AtomicBool::new(false),
            restart_notice: AtomicBool::new(false),
            released: AtomicBool::new(false),
            permit: AtomicU64::new(0),
            wake: Notify::new(),
            transportless: !transport,
        }
    }

    /// Ask the connection to end.
    pub fn terminate(&self) {
        self.terminated.store(true, Ordering::Release);
        if self.transportless {
            self.release();
        }
        self.wake.notify_one();
        if let Some(fd) = &self.wake_fd {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }

    /// Ask the connection to end for a planned restart: it first tells
    /// the initiator when the new program takes its login.
    pub fn terminate_for_restart(&self) {
        self.restart_notice.store(true, Ordering::Release);
        self.terminate();
    }

    /// For the engine: whether to tell the initiator of a restart before
    /// closing; true once.
    pub fn take_restart_notice(&self) -> bool {
        self.restart_notice.swap(false, Ordering::AcqRel)
    }

    pub fn is_terminated(&self) -> bool {
        self.terminated.load(Ordering::Acquire)
    }

    /// Resolves once [`Self::terminate`] was called (or at once if it was).
    pub async fn terminated(&self) {
        if !self.is_terminated() {
            self.wake.notified().await;
        }
    }

    /// Everything the connection held is released.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Its permit is gone (or, without a transport, it was terminated).
    fn release(&self) {
        self.released.store(true, Ordering::Release);
    }

    /// For tests that stand in for a driver: the connection is gone.
    #[cfg(test)]
    pub fn release_for_test(&self) {
        self.release();
    }
}

/// How many connections the daemon keeps in each pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Admitted (logged in past ACL and CHAP) connections, every front end
    /// and transport.
    pub total: u32,
    /// Admitted connections from one source.
    pub per_source: u32,
    /// Admitted RDMA connections, every front end (today iSER): each pins
    /// registered buffers. Users know it as `max_iser_connections`.
    pub rdma: u32,
    /// Admitted iSCSI connections (iSCSI/TCP and iSER), so that a second
    /// front end beside it can be given places of its own.
    pub iscsi: u32,
    /// TCP connections not yet logged in, in total.
    pub pending: u32,
    /// RDMA connections not yet logged in, in total.
    pub pending_rdma: u32,
    /// Connections from one source not yet logged in.
    pub pending_per_source: u32,
    /// Discovery sessions in total.
    pub discovery: u32,
    /// Discovery sessions from one source.
    pub discovery_per_source: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            total: 256,
            per_source: 16,
            rdma: 32,
            iscsi: 256,
            pending: 64,
            pending_rdma: 8,
            pending_per_source: 4,
            discovery: 16,
            discovery_per_source: 2,
        }
    }
}

/// Which transport a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Tcp,
    Rdma,
}

/// How a connection came in: the protocol it speaks over which transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Door {
    pub front_end: FrontEnd,
    pub link: Link,
}

impl Door {
    pub fn iscsi(link: Link) -> Door {
        Door {
            front_end: FrontEnd::Iscsi,
            link,
        }
    }
}

/// Which protocol a connection speaks: each front end has a cap of its own
/// beside the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontEnd {
    /// iSCSI over TCP or iSER.
    Iscsi,
}

impl FrontEnd {
    pub const ALL: [FrontEnd; 1] = [FrontEnd::Iscsi];

    pub fn label(self) -> &'static str {
        match self {
            FrontEnd::Iscsi => "iscsi",
        }
    }

    /// Its cap on admitted connections.
    fn cap(self, limits: &ConnectionLimits) -> u32 {
        match self {
            FrontEnd::Iscsi => limits.iscsi,
        }
    }

    fn limit_hit(self) -> LimitHit {
        match self {
            FrontEnd::Iscsi => LimitHit::IscsiConnections,
        }
    }
}

impl std::fmt::Display for FrontEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FrontEnd::Iscsi => "iSCSI",
        })
    }
}

/// The pool a logged-in connection moves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoggedIn {
    Discovery,
    /// Passed the target's ACL and CHAP.
    Admitted,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0} logged-in connections in total (the limit)")]
    Total(u32),
    #[error("{0} logged-in connections from this address (the limit)")]
    PerSource(u32),
    #[error("{0} connections from this address still logging in (the limit)")]
    PendingPerSource(u32),
    #[error("{0} logged-in RDMA connections (the limit)")]
    Rdma(u32),
    #[error("{1} logged-in {0} connections (the limit)")]
    FrontEnd(FrontEnd, u32),
    #[error("{0} discovery sessions from this address (the limit)")]
    DiscoveryPerSource(u32),
    #[error("evicted: the oldest of too many connections still logging in, or discovery sessions")]
    Evicted,
    #[error("{0} RDMA connections still logging in or closing hold every login slot (the limit)")]
    RdmaLoginSlots(u32),
    #[error("the target is shutting down")]
    ShuttingDown,
}

impl Refusal {
    fn limit_hit(self) -> Option<LimitHit> {
        match self {
            Refusal::Total(_) => Some(LimitHit::Connections),
            Refusal::PerSource(_) => Some(LimitHit::ConnectionsPerSource),
            Refusal::PendingPerSource(_) => Some(LimitHit::PendingLoginsPerSource),
            Refusal::Rdma(_) => Some(LimitHit::RdmaConnections),
            Refusal::FrontEnd(front_end, _) => Some(front_end.limit_hit()),
            Refusal::DiscoveryPerSource(_) => Some(LimitHit::DiscoverySessionsPerSource),
            Refusal::RdmaLoginSlots(_) => Some(LimitHit::RdmaLoginSlots),
            Refusal::Evicted | Refusal::ShuttingDown => None,
        }
    }
}

/// One host: IPv4 /32, IPv6 /64 (an IPv4-mapped IPv6 address is IPv4).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(prefix.into())
        }
        v4 => v4,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    Pending = 0,
    Discovery = 1,
    Admitted = 2,
}

#[derive(Default)]
struct PoolCount {
    total: u32,
    rdma: u32,
    by_front_end: [u32; FrontEnd::ALL.len()],
    /// Entries go when their count reaches zero: bounded by `total`.
    by_source: HashMap<IpAddr, u32>,
}

impl PoolCount {
    fn of(&self, link: Link) -> u32 {
        match link {
            Link::Tcp => self.total - self.rdma,
            Link::Rdma => self.rdma,
        }
    }
    fn of_source(&self, source: IpAddr) -> u32 {
        self.by_source.get(&source).copied().unwrap_or(0)
    }
    fn of_front_end(&self, front_end: FrontEnd) -> u32 {
        self.by_front_end[front_end as usize]
    }
    fn add(&mut self, source: IpAddr, door: Door) {
        self.total += 1;
        if door.link == Link::Rdma {
            self.rdma += 1;
        }
        self.by_front_end[door.front_end as usize] += 1;
        *self.by_source.entry(source).or_default() += 1;
    }
    fn remove(&mut self, source: IpAddr, door: Door) {
        self.total = self.total.saturating_sub(1);
        if door.link == Link::Rdma {
            self.rdma = self.rdma.saturating_sub(1);
        }
        let of_front_end = &mut self.by_front_end[door.front_end as usize];
        *of_front_end = of_front_end.saturating_sub(1);
        if let Some(n) = self.by_source.get_mut(&source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_source.remove(&source);
            }
        }
    }
}

struct Member {
    source: IpAddr,
    door: Door,
    /// None once evicted: it no longer counts in any pool, and ends.
    pool: Option<Pool>,
    /// It sent a first PDU: a login under way goes after the silent ones.
    heard_from: bool,
    /// When it was admitted, then when its driver took it up (`watch`): a
    /// connection gets `SILENCE_GRACE` from then to send its first PDU
    /// before its silence counts against it.
    since: Instant,
    control: Option<Arc<SessionControl>>,
    /// An RDMA connection allowed to register its login slots
    /// (`Permit::reserve_login_slots`); it holds them until its permit drops,
    /// evicted or not.
    holds_login_slots: bool,
}

/// How long a connection may be silent, once its driver took it up, before
/// eviction prefers it: an RDMA connection is admitted at its connect
/// request and can send nothing before its queue pair is created, its
/// buffers registered and the connection accepted (seconds under emulation
/// and a flood), and a TCP one may wait for a busy worker.
const SILENCE_GRACE: Duration = Duration::from_secs(2);

/// How often each source connected lately: its connects in this second
/// and the one before. A flood reconnects many times a second; a host that
/// logs in once scores one, for a second or two.
struct Churn {
    epoch: Instant,
    /// (second, connects in it, connects in the second before).
    by_source: HashMap<IpAddr, (u64, u32, u32)>,
}

impl Default for Churn {
    fn default() -> Churn {
        Churn {
            epoch: Instant::now(),
            by_source: HashMap::new(),
        }
    }
}

impl Churn {
    /// Sources remembered at most; beyond it the quiet ones are forgotten.
    const MAX_SOURCES: usize = 4096;

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    /// The entry as of `second`.
    fn aged((at, this, last): (u64, u32, u32), second: u64) -> (u64, u32, u32) {
        match second.saturating_sub(at) {
            0 => (at, this, last),
            1 => (second, 0, this),
            _ => (second, 0, 0),
        }
    }

    fn connected(&mut self, source: IpAddr, now: Instant) {
        let second = self.second(now);
        if self.by_source.len() >= Self::MAX_SOURCES && !self.by_source.contains_key(&source) {
            self.by_source.retain(|_, e| {
                let (_, this, last) = Churn::aged(*e, second);
                this + last > 0
            });
            if self.by_source.len() >= Self::MAX_SOURCES {
                self.by_source.clear();
            }
        }
        let entry = self.by_source.entry(source).or_insert((second, 0, 0));
        let (at, this, last) = Churn::aged(*entry, second);
        *entry = (at, this.saturating_add(1), last);
    }

    fn score(&self, source: IpAddr, now: Instant) -> u32 {
        self.by_source.get(&source).map_or(0, |e| {
            let (_, this, last) = Churn::aged(*e, self.second(now));
            this + last
        })
    }
}

#[derive(Default)]
struct GateState {
    /// Every live connection by permit number; numbers only grow, so a
    /// smaller number is an older connection.
    members: HashMap<u64, Member>,
    pools: [PoolCount; 3],
    churn: Churn,
    next_permit: u64,
    /// Shutdown began: nothing is admitted any more.
    closed: bool,
    /// Connections waiting in `reserve_login_slots` for slots to be freed.
    slot_waiters: usize,
}

impl GateState {
    /// RDMA connections that registered login slots and are not (yet)
    /// admitted: logging in, in a discovery session, or evicted and still
    /// tearing down. What no one authenticated can make the daemon pin.
    fn login_slot_holders(&self) -> u32 {
        self.members
            .values()
            .filter(|m| {
                m.door.link == Link::Rdma && m.holds_login_slots && m.pool != Some(Pool::Admitted)
            })
            .count() as u32
    }

    /// Take a member of `pool` (and `link`, when given) out of the pool and
    /// end it: one silent past its grace before one whose login is under
    /// way, then from the source that reconnects the most, then from the
    /// one that holds the most, then the oldest.
    fn evict_oldest(&mut self, pool: Pool, link: Option<Link>) -> bool {
        let counts = &self.pools[pool as usize];
        let now = Instant::now();
        let churn = &self.churn;
        let victim = self
            .members
            .iter()
            .filter(|(_, m)| m.pool == Some(pool) && link.is_none_or(|l| m.door.link == l))
            .max_by_key(|(n, m)| {
                (
                    // Silent: taken up by its driver, given its grace, and
                    // still nothing said.
                    !m.heard_from
                        && m.control.is_some()
                        && now.saturating_duration_since(m.since) >= SILENCE_GRACE,
                    churn.score(m.source, now),
                    counts.of_source(m.source),
                    std::cmp::Reverse(**n),
                )
            })
            .map(|(n, _)| *n);
        let Some(number) = victim else {
            return false;
        };
        let churn_of_victim = self
            .members
            .get(&number)
            .map_or(0, |m| self.churn.score(m.source, now));
        let Some(m) = self.members.get_mut(&number) else {
            return false;
        };
        m.pool = None;
        tracing::debug!(
            source = %m.source,
            heard_from = m.heard_from,
            age_ms = now.saturating_duration_since(m.since).as_millis() as u64,
            churn = churn_of_victim,
            "evicted"
        );
        let (source, door) = (m.source, m.door);
        let control = m.control.clone();
        self.pools[pool as usize].remove(source, door);
        if let Some(c) = control {
            c.terminate();
        }
        true
    }
}

/// At most one log line per reason a second: a flood must not drown the
/// daemon's own messages. The lines say how many were left out.
struct LogLimiter {
    slots: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl LogLimiter {
    const EVERY: Duration = Duration::from_secs(1);

    /// Whether to log now, and how many lines of this reason were left out
    /// since the last one.
    fn allow(&self, reason: &'static str) -> Option<u64> {
        let now = Instant::now();
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.get_mut(reason) {
            Some((last, skipped)) if now.duration_since(*last) < Self::EVERY => {
                *skipped += 1;
                None
            }
            Some((last, skipped)) => {
                *last = now;
                Some(std::mem::take(skipped))
            }
            None => {
                slots.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

/// Counts connections against [`ConnectionLimits`], pool by pool.
pub struct ConnectionGate {
    limits: ConnectionLimits,
    state: Mutex<GateState>,
    /// Signalled when login slots may have come free, or a waiter was
    /// evicted (see `Permit::reserve_login_slots`).
    slots_freed: Condvar,
    /// Refusals and evictions are counted here.
    counters: Arc<PortalCounters>,
    log: LogLimiter,
}

impl ConnectionGate {
    pub fn new(limits: ConnectionLimits) -> ConnectionGate {
        ConnectionGate {
            limits,
            state: Mutex::new(GateState::default()),
            slots_freed: Condvar::new(),
            counters: Arc::new(PortalCounters::default()),
            log: LogLimiter {
                slots: Mutex::new(HashMap::new()),
            },
        }
    }

    pub fn counters(&self) -> &Arc<PortalCounters> {
        &self.counters
    }

    /// Connections waiting for login slots now (what the tests synchronise
    /// on instead of sleeping).
    #[cfg(test)]
    pub(crate) fn slot_waiters(&self) -> usize {
        self.state().slot_waiters
    }

    fn state(&self) -> MutexGuard<'_, GateState> {
        // A panic elsewhere must not take admission down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Log a refusal or eviction, at most once a second per reason.
    pub fn log_refusal(&self, peer: impl std::fmt::Display, why: Refusal) {
        let reason = match why {
            Refusal::Total(_) => "total",
            Refusal::PerSource(_) => "per_source",
            Refusal::PendingPerSource(_) => "pending_per_source",
            Refusal::Rdma(_) => "rdma",
            Refusal::FrontEnd(..) => "front_end",
            Refusal::DiscoveryPerSource(_) => "discovery_per_source",
            Refusal::RdmaLoginSlots(_) => "rdma_login_slots",
            Refusal::Evicted => "evicted",
            Refusal::ShuttingDown => return,
        };
        if let Some(skipped) = self.log.allow(reason) {
            if skipped > 0 {
                tracing::warn!(%peer, "connection refused: {why} ({skipped} more like it in the last second, not logged)");
            } else {
                tracing::warn!(%peer, "connection refused: {why}");
            }
        }
    }

    fn evicted(&self, pool: Pool, link: Link) {
        self.counters.limit_hit(match pool {
            Pool::Discovery => LimitHit::DiscoverySessions,
            _ => LimitHit::PendingLogins,
        });
        let what = match (pool, link) {
            (Pool::Discovery, _) => "discovery_sessions",
            (_, Link::Tcp) => "pending_tcp",
            (_, Link::Rdma) => "pending_rdma",
        };
        if let Some(skipped) = self.log.allow(what) {
            let cap = match (pool, link) {
                (Pool::Discovery, _) => self.limits.discovery,
                (_, Link::Tcp) => self.limits.pending,
                (_, Link::Rdma) => self.limits.pending_rdma,
            };
            tracing::warn!(
                "{cap} {} (the limit): evicted the oldest of the busiest source ({skipped} more in the last second, not logged)",
                match pool {
                    Pool::Discovery => "discovery sessions",
                    _ => "connections still logging in",
                }
            );
        }
    }

    /// Admit a new connection from `source` to the pending pool, or say
    /// which limit it hits.
    pub fn admit(self: &Arc<Self>, source: IpAddr, door: Door) -> Result<Permit, Refusal> {
        let source = source_key(source);
        let link = door.link;
        let l = self.limits;
        let mut st = self.state();
        if st.closed {
            return Err(Refusal::ShuttingDown);
        }
        let pending = &st.pools[Pool::Pending as usize];
        if pending.of_source(source) >= l.pending_per_source {
            drop(st);
            return Err(self.refused(Refusal::PendingPerSource(l.pending_per_source)));
        }
        let cap = match link {
            Link::Tcp => l.pending,
            Link::Rdma => l.pending_rdma,
        };
        let mut evicted = false;
        st.churn.connected(source, Instant::now());
        if st.pools[Pool::Pending as usize].of(link) >= cap {
            evicted = st.evict_oldest(Pool::Pending, Some(link));
        }
        st.next_permit += 1;
        let number = st.next_permit;
        st.pools[Pool::Pending as usize].add(source, door);
        st.members.insert(
            number,
            Member {
                source,
                door,
                pool: Some(Pool::Pending),
                heard_from: false,
                since: Instant::now(),
                control: None,
                holds_login_slots: false,
            },
        );
        drop(st);
        if evicted {
            // The victim may be waiting for login slots: it ends now.
            self.slots_freed.notify_all();
            self.evicted(Pool::Pending, link);
        }
        Ok(Permit {
            gate: self.clone(),
            number,
        })
    }

    fn refused(&self, why: Refusal) -> Refusal {
        if let Some(hit) = why.limit_hit() {
            self.counters.limit_hit(hit);
        }
        why
    }

    /// The connection of `control` sent its first PDU: when the pending pool
    /// must make room, connections that sent nothing go first.
    pub fn heard_from(&self, control: &SessionControl) {
        let number = control.permit.load(Ordering::Acquire);
        if number != 0 {
            if let Some(m) = self.state().members.get_mut(&number) {
                m.heard_from = true;
            }
        }
    }

    /// The connection of `control` finished its login into `to`: move it out
    /// of the pending pool, or say why it cannot stay. A control no permit
    /// watches (an engine without a transport) is not counted.
    pub fn logged_in(&self, control: &SessionControl, to: LoggedIn) -> Result<(), Refusal> {
        let number = control.permit.load(Ordering::Acquire);
        if number == 0 {
            return Ok(());
        }
        let l = self.limits;
        let mut st = self.state();
        let Some(m) = st.members.get(&number) else {
            return Ok(());
        };
        let (source, door, pool) = (m.source, m.door, m.pool);
        let link = door.link;
        let target = match (to, link) {
            // Over RDMA a discovery session pins the same receive and send
            // slots as a connection still logging in, so it stays in that
            // pool: what no one authenticated can pin stays bounded by the
            // RDMA pending cap.
            (LoggedIn::Discovery, Link::Rdma) => Pool::Pending,
            (LoggedIn::Discovery, Link::Tcp) => Pool::Discovery,
            (LoggedIn::Admitted, _) => Pool::Admitted,
        };
        match pool {
            None => return Err(Refusal::Evicted),
            Some(p) if p == target => return Ok(()),
            Some(_) => {}
        }
        if st.closed {
            return Err(Refusal::ShuttingDown);
        }
        let counts = &st.pools[target as usize];
        let mut evicted = false;
        let check = match target {
            Pool::Admitted if counts.total >= l.total => Err(Refusal::Total(l.total)),
            Pool::Admitted if link == Link::Rdma && counts.rdma >= l.rdma => {
                Err(Refusal::Rdma(l.rdma))
            }
            Pool::Admitted if counts.of_front_end(door.front_end) >= door.front_end.cap(&l) => {
                Err(Refusal::FrontEnd(door.front_end, door.front_end.cap(&l)))
            }
            Pool::Admitted if counts.of_source(source) >= l.per_source => {
                Err(Refusal::PerSource(l.per_source))
            }
            Pool::Discovery if counts.of_source(source) >= l.discovery_per_source => {
                Err(Refusal::DiscoveryPerSource(l.discovery_per_source))
            }
            Pool::Discovery if counts.total >= l.discovery => {
                evicted = st.evict_oldest(Pool::Discovery, None);
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(why) = check {
            drop(st);
            return Err(self.refused(why));
        }
        if let Some(p) = pool {
            st.pools[p as usize].remove(source, door);
        }
        st.pools[target as usize].add(source, door);
        if let Some(m) = st.members.get_mut(&number) {
            m.pool = Some(target);
        }
        drop(st);
        if target == Pool::Admitted && link == Link::Rdma {
            // Its login slots now count as an admitted connection's.
            self.slots_freed.notify_all();
        }
        if evicted {
            self.evicted(Pool::Discovery, link);
        }
        Ok(())
    }

    /// Shutdown: admit nothing more and end every connection, logged in or
    /// not (for a planned restart, after telling each initiator when to
    /// come back). Returns how many were told to end.
    pub fn close(&self, restart: bool) -> usize {
        let controls: Vec<_> = {
            let mut st = self.state();
            st.closed = true;
            st.members
                .values()
                .filter_map(|m| m.control.clone())
                .collect()
        };
        self.slots_freed.notify_all();
        for control in &controls {
            if restart {
                control.terminate_for_restart();
            } else {
                control.terminate();
            }
        }
        controls.len()
    }

    /// Admit connections again after [`Self::close`] (a planned restart
    /// whose exec failed).
    pub fn reopen(&self) {
        self.state().closed = false;
    }

    /// Connections now open, every pool and the evicted that have not
    /// ended yet.
    pub fn counts_now(&self) -> OpenConnections {
        let st = self.state();
        let mut open = OpenConnections::default();
        for m in st.members.values() {
            open.total += 1;
            if m.door.link == Link::Rdma {
                open.rdma += 1;
            }
            open.by_front_end[m.door.front_end as usize] += 1;
        }
        open
    }
}

/// What [`ConnectionGate::counts_now`] counts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OpenConnections {
    pub total: u32,
    pub rdma: u32,
    /// Indexed by [`FrontEnd`] (`FrontEnd::ALL` order).
    pub by_front_end: [u32; FrontEnd::ALL.len()],
}

impl OpenConnections {
    pub fn tcp(&self) -> u32 {
        self.total.saturating_sub(self.rdma)
    }

    pub fn of(&self, front_end: FrontEnd) -> u32 {
        self.by_front_end[front_end as usize]
    }
}

/// One admitted connection; gives its place back when dropped.
pub struct Permit {
    gate: Arc<ConnectionGate>,
    number: u64,
}

impl Permit {
    /// The connection's first bytes are there (seen before the engine ran).
    pub fn heard_from(&self) {
        if let Some(m) = self.gate.state().members.get_mut(&self.number) {
            m.heard_from = true;
        }
    }

    /// The connection can be ended through `control` (shutdown, eviction,
    /// reinstatement), and its login moves it between pools. A connection
    /// that registers after the gate closed, or after it was evicted, is
    /// ended at once.
    pub fn watch(&self, control: Arc<SessionControl>) {
        control.permit.store(self.number, Ordering::Release);
        let end_now = {
            let mut st = self.gate.state();
            let closed = st.closed;
            match st.members.get_mut(&self.number) {
                Some(m) => {
                    m.control = Some(control.clone());
                    // The peer can speak from now on (an RDMA connection only
                    // once accepted): its silence is counted from here.
                    m.since = Instant::now();
                    closed || m.pool.is_none()
                }
                None => true,
            }
        };
        if end_now {
            control.terminate();
        }
    }
}

impl Permit {
    /// Before an RDMA connection registers its login slots: wait until
    /// fewer than the RDMA pending cap of connections that nobody admitted
    /// hold theirs. An evicted connection keeps its slots pinned until its
    /// queue pair is torn down, so eviction alone would let a flood that
    /// reconnects faster than that pin without bound. Waits at most `patience`
    /// (then refuses), and ends early when this connection is evicted or
    /// the gate closes. A TCP connection pins nothing and passes at once.
    pub fn reserve_login_slots(&self, patience: Duration) -> Result<(), Refusal> {
        let cap = self.gate.limits.pending_rdma;
        let deadline = Instant::now() + patience;
        let mut st = self.gate.state();
        loop {
            if st.closed {
                return Err(Refusal::ShuttingDown);
            }
            let Some(m) = st.members.get(&self.number) else {
                return Err(Refusal::Evicted);
            };
            if m.pool.is_none() {
                return Err(Refusal::Evicted);
            }
            if m.door.link != Link::Rdma || m.holds_login_slots {
                return Ok(());
            }
            if st.login_slot_holders() < cap {
                if let Some(m) = st.members.get_mut(&self.number) {
                    m.holds_login_slots = true;
                }
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(st);
                return Err(self.gate.refused(Refusal::RdmaLoginSlots(cap)));
            }
            st.slot_waiters += 1;
            st = self
                .gate
                .slots_freed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            st.slot_waiters -= 1;
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.gate.state();
        if let Some(m) = st.members.remove(&self.number) {
            if let Some(pool) = m.pool {
                st.pools[pool as usize].remove(m.source, m.door);
            }
            if let Some(control) = m.control {
                control.release();
            }
            if m.holds_login_slots {
                self.gate.slots_freed.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests;
