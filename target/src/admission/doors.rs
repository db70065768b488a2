//! Which door a connection comes through (front end and link), the caps on
//! each, and why one is refused.

use std::net::IpAddr;

use crate::metrics::LimitHit;

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
    pub(super) fn cap(self, limits: &ConnectionLimits) -> u32 {
        match self {
            FrontEnd::Iscsi => limits.iscsi,
        }
    }

    pub(super) fn limit_hit(self) -> LimitHit {
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
    pub(super) fn limit_hit(self) -> Option<LimitHit> {
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
