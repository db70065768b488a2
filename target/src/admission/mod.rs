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
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::metrics::{LimitHit, PortalCounters};

mod session_control;
pub use session_control::SessionControl;
mod doors;
pub use doors::{source_key, ConnectionLimits, Door, FrontEnd, Link, LoggedIn, Refusal};
mod networks;
mod staging;
mod transfers;
pub use networks::{in_networks, parse_network};
pub use staging::StagingBudget;
pub use transfers::{CopyGuard, Transfers};

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
