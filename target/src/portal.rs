//! The shared control-plane view every connection's engine consults at login:
//! which targets exist, who may log in, CHAP secrets, negotiation limits, and
//! the session table used for session reinstatement and `status`.
//!
//! Nothing here is touched per I/O; the engine copies what it needs at login.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::metrics::{LimitHit, PortalCounters};
use crate::scsi::{NexusId, ScsiTarget};

/// Values the target offers in login negotiation, and its queueing limits.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_recv_data_segment_len: u32,
    pub max_burst_len: u32,
    pub first_burst_len: u32,
    pub max_outstanding_r2t: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    /// Commands the initiator may have outstanding (MaxCmdSN - ExpCmdSN + 1).
    pub cmd_window: u32,
    /// Idle time after which the target pings the initiator with a NOP-In.
    pub nop_interval: Duration,
    /// How long a NOP-In ping may go unanswered before the connection is dropped.
    pub nop_timeout: Duration,
    /// How long a login may take from the first PDU to full feature phase.
    pub login_timeout: Duration,
    /// Bytes of write data all sessions together may hold in staging
    /// buffers (parameter lists and compare data the SCSI device must see
    /// whole). Beyond it such commands get TASK SET FULL.
    pub staging_budget: u64,
    /// A connection whose output (responses, Data-In) makes no progress this
    /// long is closed: its peer stopped reading.
    pub output_stall_timeout: Duration,
    pub connections: ConnectionLimits,
}

/// How many connections the portal keeps; beyond them a new one is closed
/// at once (TCP) or rejected (iSER), with the reason in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// All connections, both transports.
    pub total: u32,
    /// Connections from one source address.
    pub per_source: u32,
    /// Connections from one source address that have not finished login.
    pub pending_per_source: u32,
    /// iSER connections: each pins registered buffers.
    pub iser: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            total: 256,
            per_source: 16,
            pending_per_source: 4,
            iser: 32,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_recv_data_segment_len: 256 * 1024,
            max_burst_len: 16 * 1024 * 1024 - 1024,
            first_burst_len: 256 * 1024,
            max_outstanding_r2t: 16,
            immediate_data: true,
            initial_r2t: false,
            cmd_window: 128,
            nop_interval: Duration::from_secs(15),
            nop_timeout: Duration::from_secs(30),
            login_timeout: Duration::from_secs(30),
            staging_budget: 128 << 20,
            output_stall_timeout: Duration::from_secs(30),
            connections: ConnectionLimits::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapSecret {
    pub user: String,
    pub secret: String,
}

/// Who may log in to a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acl {
    Any,
    Only(Vec<AclEntry>),
}

impl Acl {
    /// Whether `initiator`, connecting from `peer`, may log in.
    pub fn allows(&self, initiator: &str, peer: IpAddr) -> bool {
        match self {
            Acl::Any => true,
            Acl::Only(list) => list.iter().any(|a| a.matches(initiator, peer)),
        }
    }
}

/// One ACL entry: an initiator name, optionally bound to a source network
/// (`IQN@192.0.2.0/24`). Without CHAP the name is only a claim, so binding
/// it to the host's network narrows who can use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AclEntry {
    pub initiator: String,
    pub network: Option<IpNet>,
}

impl AclEntry {
    /// An entry that accepts the initiator from any address.
    pub fn any_address(initiator: &str) -> AclEntry {
        AclEntry {
            initiator: initiator.to_string(),
            network: None,
        }
    }

    fn matches(&self, initiator: &str, peer: IpAddr) -> bool {
        self.initiator.eq_ignore_ascii_case(initiator)
            && self
                .network
                .is_none_or(|net| net.contains(&peer.to_canonical()))
    }
}

impl std::str::FromStr for AclEntry {
    type Err = String;

    /// `IQN` or `IQN@NETWORK/PREFIX` (a bare address means that one host).
    fn from_str(s: &str) -> Result<AclEntry, String> {
        let (name, net) = match s.rsplit_once('@') {
            Some((name, net)) => (name, Some(net)),
            None => (s, None),
        };
        if name.is_empty()
            || name.len() > 223
            || name.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "ACL entry '{}': not an initiator name (write IQN or IQN@192.0.2.0/24)",
                s.escape_debug()
            ));
        }
        let network = match net {
            None => None,
            Some(n) => Some(
                n.parse::<IpNet>()
                    .or_else(|_| n.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| {
                        format!(
                            "ACL entry '{}': '{}' is not a network (write IQN@192.0.2.0/24 or IQN@2001:db8::/64)",
                            s.escape_debug(),
                            n.escape_debug()
                        )
                    })?
                    .trunc(),
            ),
        };
        Ok(AclEntry {
            initiator: name.to_string(),
            network,
        })
    }
}

impl std::fmt::Display for AclEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.network {
            Some(n) => write!(f, "{}@{n}", self.initiator),
            None => f.write_str(&self.initiator),
        }
    }
}

pub struct TargetDef {
    pub name: String,
    pub alias: Option<String>,
    pub scsi: Arc<ScsiTarget>,
    pub acl: Acl,
    /// Initiator must authenticate with this (one-way CHAP).
    pub chap: Option<ChapSecret>,
    /// Target answers the initiator's challenge with this (mutual CHAP).
    pub mutual_chap: Option<ChapSecret>,
}

/// How a connection is ended from outside (session reinstatement, shutdown)
/// and how others learn that it is gone. The driver makes one per
/// connection and hands it to its [`Permit`], which marks it released when
/// dropped: after the engine ended and, on iSER, after the queue pair was
/// destroyed, so no byte of that connection can land in LUN memory any more.
pub struct SessionControl {
    terminated: AtomicBool,
    released: AtomicBool,
    /// Wakes a driver that waits for termination (TCP's select).
    wake: Notify,
    /// Nothing moves bytes for it (tests, benchmarks): it is released as
    /// soon as it is terminated.
    transportless: bool,
}

impl SessionControl {
    /// The control of a connection with a transport behind it.
    pub fn new() -> Arc<SessionControl> {
        Arc::new(SessionControl {
            terminated: AtomicBool::new(false),
            released: AtomicBool::new(false),
            wake: Notify::new(),
            transportless: false,
        })
    }

    /// The control of an engine driven without a transport.
    pub fn without_transport() -> Arc<SessionControl> {
        Arc::new(SessionControl {
            transportless: true,
            ..Arc::into_inner(SessionControl::new()).expect("just made")
        })
    }

    /// Ask the connection to end.
    pub fn terminate(&self) {
        self.terminated.store(true, Ordering::Release);
        if self.transportless {
            self.release();
        }
        self.wake.notify_one();
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

/// What identifies a session for reinstatement (RFC 7143 6.3.5): the
/// initiator, its ISID and the target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub initiator: String,
    pub isid: [u8; 6],
    /// Empty for a discovery session.
    pub target: String,
}

/// What `status` shows about a session.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub key: SessionKey,
    pub discovery: bool,
    pub tsih: u16,
    pub nexus: NexusId,
    pub peer: SocketAddr,
}

struct SessionEntry {
    info: SessionInfo,
    control: Arc<SessionControl>,
}

#[derive(Default)]
struct Sessions {
    /// Keyed by TSIH, which is unique among live sessions.
    by_tsih: HashMap<u16, SessionEntry>,
    next_tsih: u16,
    next_nexus: u32,
}

/// A session the portal registered.
pub struct OpenedSession {
    pub tsih: u16,
    pub nexus: NexusId,
    /// The sessions it reinstated, told to terminate.
    pub replaced: Vec<Arc<SessionControl>>,
}

/// Why a session could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpenSessionError {
    #[error("no free session handle (TSIH)")]
    NoFreeTsih,
}

pub struct Portal {
    pub targets: Vec<TargetDef>,
    pub limits: Limits,
    pub discovery_chap: Option<ChapSecret>,
    /// Target portal group tag reported at login and in SendTargets.
    pub tpgt: u16,
    /// Listen addresses, for SendTargets' TargetAddress (wildcards are replaced
    /// by the address the initiator connected to).
    pub listen: Vec<SocketAddr>,
    /// Daemon-wide staging memory, shared by every session.
    pub staging: StagingBudget,
    /// Connection counts, shared by both transports.
    pub gate: Arc<ConnectionGate>,
    /// Refused logins and limits hit.
    pub counters: Arc<PortalCounters>,
    /// Measure each command's service time: two TSC reads per command, so
    /// only when someone asked for metrics (`--metrics`).
    pub service_times: bool,
    sessions: Mutex<Sessions>,
}

/// A byte budget shared by all connections: reservations never exceed it.
#[derive(Debug)]
pub struct StagingBudget {
    used: AtomicU64,
    limit: u64,
}

impl StagingBudget {
    pub fn new(limit: u64) -> StagingBudget {
        StagingBudget {
            used: AtomicU64::new(0),
            limit,
        }
    }

    /// Take `bytes` from the budget; false (and nothing taken) if they do not fit.
    pub fn reserve(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|n| *n <= self.limit)
            })
            .is_ok()
    }

    pub fn release(&self, bytes: u64) {
        if bytes > 0 {
            let _ = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    Some(used.saturating_sub(bytes))
                });
        }
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Portal {
    pub fn new(targets: Vec<TargetDef>, limits: Limits, listen: Vec<SocketAddr>) -> Portal {
        let gate = Arc::new(ConnectionGate::new(limits.connections));
        Portal {
            targets,
            staging: StagingBudget::new(limits.staging_budget),
            gate: gate.clone(),
            counters: gate.counters.clone(),
            service_times: false,
            limits,
            discovery_chap: None,
            tpgt: 1,
            listen,
            sessions: Mutex::new(Sessions {
                next_tsih: 1,
                next_nexus: 1,
                ..Default::default()
            }),
        }
    }

    pub fn target(&self, name: &str) -> Option<&TargetDef> {
        self.targets
            .iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }

    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        // A panic elsewhere must not take the whole target down with it.
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register a new session. A normal session reinstates (terminates) the
    /// normal session with the same initiator, ISID and target: the caller
    /// has already passed that target's ACL and CHAP checks, the same ones the
    /// old session passed. A discovery session never touches another session.
    /// Returns the new TSIH and nexus id, and the controls of the sessions
    /// it reinstated: the new login must not be answered before each of
    /// them [is released](SessionControl::is_released).
    pub fn open_session(
        &self,
        key: SessionKey,
        discovery: bool,
        peer: SocketAddr,
        control: Arc<SessionControl>,
    ) -> Result<OpenedSession, OpenSessionError> {
        let mut s = self.sessions();
        // Both searches are bounded: at most one full turn of each space.
        let mut tsih = None;
        for _ in 0..u16::MAX {
            let t = s.next_tsih;
            s.next_tsih = s.next_tsih.wrapping_add(1).max(1);
            if !s.by_tsih.contains_key(&t) {
                tsih = Some(t);
                break;
            }
        }
        let tsih = tsih.ok_or(OpenSessionError::NoFreeTsih)?;
        // A nexus id names an I_T nexus in the SCSI layer (reservations, unit
        // attentions): after a wrap it must not collide with a live one.
        let nexus = loop {
            let n = NexusId(s.next_nexus);
            s.next_nexus = s.next_nexus.wrapping_add(1).max(1);
            if !s.by_tsih.values().any(|e| e.info.nexus == n) {
                break n;
            }
        };
        let mut replaced = Vec::new();
        if !discovery {
            let old: Vec<u16> = s
                .by_tsih
                .iter()
                .filter(|(_, e)| !e.info.discovery && e.info.key == key)
                .map(|(t, _)| *t)
                .collect();
            for t in old {
                if let Some(old) = s.by_tsih.remove(&t) {
                    tracing::info!(
                        initiator = %old.info.key.initiator.escape_debug(),
                        tsih = old.info.tsih,
                        "session reinstated: closing the old session with the same ISID"
                    );
                    old.control.terminate();
                    replaced.push(old.control);
                }
            }
        }
        let info = SessionInfo {
            key,
            discovery,
            tsih,
            nexus,
            peer,
        };
        s.by_tsih.insert(tsih, SessionEntry { info, control });
        Ok(OpenedSession {
            tsih,
            nexus,
            replaced,
        })
    }

    /// Forget a session (a no-op if a reinstatement already replaced it and
    /// its TSIH went to a newer session).
    pub fn close_session(&self, tsih: u16, nexus: NexusId) {
        let mut s = self.sessions();
        if s.by_tsih.get(&tsih).is_some_and(|e| e.info.nexus == nexus) {
            s.by_tsih.remove(&tsih);
        }
    }

    pub fn sessions_info(&self) -> Vec<SessionInfo> {
        self.sessions()
            .by_tsih
            .values()
            .map(|e| e.info.clone())
            .collect()
    }

    /// End every session (shutdown).
    pub fn terminate_all(&self) {
        for e in self.sessions().by_tsih.values() {
            e.control.terminate();
        }
    }
}

/// Which transport a connection uses, for the connection limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Tcp,
    Iser,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0} connections in total (the limit)")]
    Total(u32),
    #[error("{0} connections from this address (the limit)")]
    PerSource(u32),
    #[error("{0} connections from this address still logging in (the limit)")]
    PendingPerSource(u32),
    #[error("{0} iSER connections (the limit)")]
    Iser(u32),
    #[error("the target is shutting down")]
    ShuttingDown,
}

#[derive(Default)]
struct GateCounts {
    total: u32,
    iser: u32,
    /// (connections, of which not yet logged in) per source; entries go
    /// when their count reaches zero, so the map is bounded by `total`.
    by_source: HashMap<IpAddr, (u32, u32)>,
    /// Each live connection's way to be ended, by permit number.
    controls: HashMap<u64, Arc<SessionControl>>,
    next_permit: u64,
    /// Shutdown began: nothing is admitted any more.
    closed: bool,
}

/// Counts connections against [`ConnectionLimits`]. Touched at connect,
/// login and close only.
pub struct ConnectionGate {
    limits: ConnectionLimits,
    counts: Mutex<GateCounts>,
    /// The portal's counters; refusals are counted here.
    counters: Arc<PortalCounters>,
}

impl ConnectionGate {
    pub fn new(limits: ConnectionLimits) -> ConnectionGate {
        ConnectionGate {
            limits,
            counts: Mutex::new(GateCounts::default()),
            counters: Arc::new(PortalCounters::default()),
        }
    }

    fn counts(&self) -> MutexGuard<'_, GateCounts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admit a new connection from `source`, or say which limit it hits.
    pub fn admit(self: &Arc<Self>, source: IpAddr, link: Link) -> Result<Permit, Refusal> {
        let result = self.admit_counted(source, link);
        let hit = match &result {
            Err(Refusal::Total(_)) => Some(LimitHit::Connections),
            Err(Refusal::PerSource(_)) => Some(LimitHit::ConnectionsPerSource),
            Err(Refusal::PendingPerSource(_)) => Some(LimitHit::PendingLoginsPerSource),
            Err(Refusal::Iser(_)) => Some(LimitHit::IserConnections),
            Err(Refusal::ShuttingDown) | Ok(_) => None,
        };
        if let Some(hit) = hit {
            self.counters.limit_hit(hit);
        }
        result
    }

    fn admit_counted(self: &Arc<Self>, source: IpAddr, link: Link) -> Result<Permit, Refusal> {
        let source = source.to_canonical();
        let l = self.limits;
        let mut c = self.counts();
        let (from_source, pending) = c.by_source.get(&source).copied().unwrap_or((0, 0));
        if c.closed {
            return Err(Refusal::ShuttingDown);
        }
        if c.total >= l.total {
            return Err(Refusal::Total(l.total));
        }
        if link == Link::Iser && c.iser >= l.iser {
            return Err(Refusal::Iser(l.iser));
        }
        if from_source >= l.per_source {
            return Err(Refusal::PerSource(l.per_source));
        }
        if pending >= l.pending_per_source {
            return Err(Refusal::PendingPerSource(l.pending_per_source));
        }
        c.total += 1;
        if link == Link::Iser {
            c.iser += 1;
        }
        c.by_source.insert(source, (from_source + 1, pending + 1));
        c.next_permit += 1;
        Ok(Permit {
            gate: self.clone(),
            number: c.next_permit,
            source,
            link,
            pending: true,
        })
    }

    /// Shutdown: admit nothing more and end every connection, logged in or
    /// not. Returns how many were told to end.
    pub fn close(&self) -> usize {
        let controls: Vec<_> = {
            let mut c = self.counts();
            c.closed = true;
            c.controls.values().cloned().collect()
        };
        for control in &controls {
            control.terminate();
        }
        controls.len()
    }

    /// Connections now counted: (total, iSER).
    pub fn counts_now(&self) -> (u32, u32) {
        let c = self.counts();
        (c.total, c.iser)
    }
}

/// One admitted connection; gives its place back when dropped.
pub struct Permit {
    gate: Arc<ConnectionGate>,
    number: u64,
    source: IpAddr,
    link: Link,
    pending: bool,
}

impl Permit {
    /// The connection can be ended through `control` (at shutdown). A
    /// connection that registers after the gate closed is ended at once.
    pub fn watch(&self, control: Arc<SessionControl>) {
        let closed = {
            let mut c = self.gate.counts();
            c.controls.insert(self.number, control.clone());
            c.closed
        };
        if closed {
            control.terminate();
        }
    }

    /// The connection finished login: it no longer counts as pending.
    pub fn logged_in(&mut self) {
        if std::mem::replace(&mut self.pending, false) {
            let mut c = self.gate.counts();
            if let Some(e) = c.by_source.get_mut(&self.source) {
                e.1 = e.1.saturating_sub(1);
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut c = self.gate.counts();
        if let Some(control) = c.controls.remove(&self.number) {
            control.release();
        }
        c.total = c.total.saturating_sub(1);
        if self.link == Link::Iser {
            c.iser = c.iser.saturating_sub(1);
        }
        let gone = match c.by_source.get_mut(&self.source) {
            Some(e) => {
                e.0 = e.0.saturating_sub(1);
                if self.pending {
                    e.1 = e.1.saturating_sub(1);
                }
                e.0 == 0
            }
            None => false,
        };
        if gone {
            c.by_source.remove(&self.source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_gate_counts_and_gives_back() {
        let gate = Arc::new(ConnectionGate::new(ConnectionLimits {
            total: 5,
            per_source: 3,
            pending_per_source: 2,
            iser: 1,
        }));
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let mut p1 = gate.admit(a, Link::Tcp).unwrap();
        let _p2 = gate.admit(a, Link::Tcp).unwrap();
        assert_eq!(
            gate.admit(a, Link::Tcp).err(),
            Some(Refusal::PendingPerSource(2))
        );
        p1.logged_in();
        let _p3 = gate.admit(a, Link::Tcp).unwrap();
        assert_eq!(gate.admit(a, Link::Tcp).err(), Some(Refusal::PerSource(3)));
        let _p4 = gate.admit(b, Link::Iser).unwrap();
        assert_eq!(gate.admit(b, Link::Iser).err(), Some(Refusal::Iser(1)));
        let _p5 = gate.admit(b, Link::Tcp).unwrap();
        assert_eq!(gate.admit(b, Link::Tcp).err(), Some(Refusal::Total(5)));
        drop(p1);
        assert_eq!(gate.counts_now(), (4, 1));
        // An IPv4-mapped IPv6 source is the same host: its two pending
        // connections are still there.
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(
            gate.admit(mapped, Link::Tcp).err(),
            Some(Refusal::PendingPerSource(2))
        );
    }
}
