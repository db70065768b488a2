//! iSCSI's portal: the control-plane view every iSCSI connection's engine
//! consults at login: which targets exist, who may log in (ACL and CHAP by
//! IQN), negotiation limits, and the ISID/TSIH session table used for
//! session reinstatement and `status`. What every front end shares (the
//! volumes, the connection gate, the staging budget, the counters) is the
//! [`Core`]'s; the portal holds it for its engines.
//!
//! The engine copies what it needs at login. Per I/O only the core is
//! touched: its volumes (drivers resolve the volume ids the engine emits)
//! and its staging budget (parameter lists and compare data SCSI must see
//! whole).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::admission::Transfers;
use crate::admission::{FrontEnd, SessionControl};
use crate::core::{Core, Export, Exports, FrontEndView, SessionFacts, VolumeHooks};
use crate::scsi::{NexusId, ScsiTarget};
use crate::volume::{VolumeId, Volumes};

/// Values the target offers in iSCSI login negotiation, its command window
/// and its iSCSI timers. What every front end obeys is [`CoreLimits`](crate::core::CoreLimits).
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
    /// How long a new connection may take to send its first PDU.
    pub first_pdu_timeout: Duration,
    /// A discovery session is asked to log out this long after its last
    /// Text exchange (SendTargets), and closed soon after.
    pub discovery_lifetime: Duration,
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
            first_pdu_timeout: Duration::from_secs(5),
            discovery_lifetime: Duration::from_secs(30),
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
            Some(n) => Some(crate::admission::parse_network(n).ok_or_else(|| {
                format!(
                    "ACL entry '{}': '{}' is not a network (write IQN@192.0.2.0/24 or IQN@2001:db8::/64)",
                    s.escape_debug(),
                    n.escape_debug()
                )
            })?),
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
    /// Reached only inside the iSCSI front end: everything else asks the
    /// core for volumes, so no field chain reaches a LU from outside.
    pub(in crate::iscsi) scsi: Arc<ScsiTarget>,
    pub acl: Acl,
    /// Initiator must authenticate with this (one-way CHAP).
    pub chap: Option<ChapSecret>,
    /// Target answers the initiator's challenge with this (mutual CHAP).
    pub mutual_chap: Option<ChapSecret>,
}

impl TargetDef {
    /// `name` serving `scsi`'s LUs, open to every initiator, without CHAP.
    pub fn new(name: String, scsi: Arc<ScsiTarget>) -> TargetDef {
        TargetDef {
            name,
            alias: None,
            scsi,
            acl: Acl::Any,
            chap: None,
            mutual_chap: None,
        }
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
    /// What every front end shares: volumes, gate, staging, counters.
    pub core: Arc<Core>,
    /// Only the front end walks its targets; the faces and the lifecycle go
    /// through the core and [`FrontEndView`].
    pub(in crate::iscsi) targets: Vec<TargetDef>,
    pub limits: Limits,
    pub discovery_chap: Option<ChapSecret>,
    /// Target portal group tag reported at login and in SendTargets.
    pub tpgt: u16,
    /// Listen addresses, for SendTargets' TargetAddress (wildcards are replaced
    /// by the address the initiator connected to).
    pub listen: Vec<SocketAddr>,
    sessions: Mutex<Sessions>,
}

impl Portal {
    pub fn new(
        core: Arc<Core>,
        targets: Vec<TargetDef>,
        limits: Limits,
        listen: Vec<SocketAddr>,
    ) -> Portal {
        Portal {
            core,
            targets,
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
}

/// A volume operation reaches every target's LU on the volume.
impl VolumeHooks for Portal {
    fn abort_volume(&self, volume: VolumeId) -> Vec<Arc<Transfers>> {
        self.targets
            .iter()
            .flat_map(|t| t.scsi.abort_volume(volume))
            .collect()
    }

    fn announce_new_identity(&self, volume: VolumeId) {
        for t in &self.targets {
            t.scsi.announce_new_identity(volume);
        }
    }
}

impl FrontEndView for Portal {
    fn front_end(&self) -> FrontEnd {
        FrontEnd::Iscsi
    }

    fn owners(&self) -> Vec<String> {
        self.targets.iter().map(|t| t.name.clone()).collect()
    }

    fn sessions(&self) -> Vec<SessionFacts> {
        self.sessions_info()
            .into_iter()
            .map(|s| SessionFacts {
                host: s.key.initiator,
                instance: s.key.isid.iter().map(|b| format!("{b:02x}")).collect(),
                owner: s.key.target,
                handle: s.tsih,
                peer: s.peer,
            })
            .collect()
    }
}

/// What the configuration makes of every volume today: an LU of the target
/// its name gives, at the LUN its name gives.
pub fn lun_exports(volumes: &Volumes) -> Exports {
    let mut exports = Exports::default();
    for v in volumes.iter() {
        exports.add(
            v.id(),
            Export {
                front_end: FrontEnd::Iscsi,
                owner: v.target().to_string(),
                unit: v.lun(),
            },
        );
    }
    exports
}
