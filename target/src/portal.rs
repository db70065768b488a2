//! The shared control-plane view every connection's engine consults at login:
//! which targets exist, who may log in, CHAP secrets, negotiation limits, and
//! the session table used for session reinstatement and `status`.
//!
//! Nothing here is touched per I/O; the engine copies what it needs at login.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

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
    Only(Vec<String>),
}

impl Acl {
    pub fn allows(&self, initiator: &str) -> bool {
        match self {
            Acl::Any => true,
            Acl::Only(list) => list.iter().any(|a| a.eq_ignore_ascii_case(initiator)),
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

/// Terminates a session from outside its connection (reinstatement, shutdown).
pub trait SessionControl: Send + Sync {
    fn terminate(&self);
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub initiator: String,
    pub isid: [u8; 6],
    pub target: String,
}

/// What `status` shows about a session.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub key: SessionKey,
    pub tsih: u16,
    pub nexus: NexusId,
    pub peer: SocketAddr,
}

struct SessionEntry {
    info: SessionInfo,
    control: Arc<dyn SessionControl>,
}

#[derive(Default)]
struct Sessions {
    by_key: HashMap<SessionKey, SessionEntry>,
    next_tsih: u16,
    next_nexus: u32,
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
    sessions: Mutex<Sessions>,
}

impl Portal {
    pub fn new(targets: Vec<TargetDef>, limits: Limits, listen: Vec<SocketAddr>) -> Portal {
        Portal {
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

    /// Register a new session, reinstating (terminating) any session with the
    /// same initiator, ISID and target. Returns the new TSIH and nexus id.
    pub fn open_session(
        &self,
        key: SessionKey,
        peer: SocketAddr,
        control: Arc<dyn SessionControl>,
    ) -> (u16, NexusId) {
        let mut s = self.sessions();
        let tsih = loop {
            let t = s.next_tsih;
            s.next_tsih = s.next_tsih.wrapping_add(1).max(1);
            if !s.by_key.values().any(|e| e.info.tsih == t) {
                break t;
            }
        };
        let nexus = NexusId(s.next_nexus);
        s.next_nexus = s.next_nexus.wrapping_add(1).max(1);
        let info = SessionInfo {
            key: key.clone(),
            tsih,
            nexus,
            peer,
        };
        if let Some(old) = s.by_key.insert(key, SessionEntry { info, control }) {
            tracing::info!(
                initiator = %old.info.key.initiator,
                tsih = old.info.tsih,
                "session reinstated: closing the old session with the same ISID"
            );
            old.control.terminate();
        }
        (tsih, nexus)
    }

    /// Forget a session, unless it was already replaced by a reinstatement.
    pub fn close_session(&self, key: &SessionKey, tsih: u16) {
        let mut s = self.sessions();
        if s.by_key.get(key).is_some_and(|e| e.info.tsih == tsih) {
            s.by_key.remove(key);
        }
    }

    pub fn sessions_info(&self) -> Vec<SessionInfo> {
        self.sessions()
            .by_key
            .values()
            .map(|e| e.info.clone())
            .collect()
    }

    /// End every session (shutdown).
    pub fn terminate_all(&self) {
        for e in self.sessions().by_key.values() {
            e.control.terminate();
        }
    }
}
