//! The login phase (RFC 7143 section 6): stages, key negotiation, CHAP.
//!
//! `Login` consumes one Login Request at a time and produces the response
//! text and what happens next. The `Connection` owns framing, sequence numbers
//! and the switch to full feature phase.

use std::collections::HashSet;
use std::net::IpAddr;

use ramslog_common::iscsi::chap::{self, decode_binary, encode_hex};
use ramslog_common::iscsi::keys::{self, parse_bool, yes_no};
use ramslog_common::iscsi::{login, login_status, text, Bhs};
use ramslog_common::iser::CmPeer;
use rand::RngCore;

use super::params::{IserPeer, Params};
use super::Transport;
use crate::iscsi::portal::{ChapSecret, Portal};

mod negotiate;
use negotiate::negotiate;

/// RFC 7143 6.1: values are at most 255 bytes, except binary CHAP values.
const MAX_VALUE_LEN: usize = 255;
const MAX_CHAP_VALUE_LEN: usize = 2 + 2 * 1024;
/// RFC 7143 4.2.7.1: iSCSI names are at most 223 bytes.
const MAX_NAME_LEN: usize = 223;
const CHAP_CHALLENGE_LEN: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    Normal,
    Discovery,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// Nothing negotiated yet.
    Pending,
    /// AuthMethod=CHAP agreed, waiting for CHAP_A.
    ChapAgreed,
    /// Challenge sent, waiting for CHAP_N/CHAP_R.
    ChallengeSent { id: u8, challenge: Vec<u8> },
    /// No CHAP secret applies to this login: security ended without one.
    NotRequired,
    /// The initiator proved the CHAP secret.
    ChapVerified,
}

/// What the connection does after a login response.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Stay in the login phase.
    Continue,
    /// The response carries this failure's status; close after sending it.
    Fail(LoginFailure),
    /// Transit to full feature phase once the response is sent.
    FullFeature,
}

/// Why a login is refused. Each has one status (RFC 7143 11.13.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginFailure {
    /// A malformed, inconsistent or out-of-order request.
    InitiatorError,
    AuthFailed,
    /// Not in the target's ACL.
    Forbidden,
    /// No such target.
    NotFound,
    UnsupportedVersion,
    /// The login names an existing session: it has its one connection.
    TooManyConnections,
    /// InitiatorName, or TargetName for a normal session, is missing.
    MissingParameter,
    SessionTypeNotSupported,
    /// The login names a session that does not exist.
    SessionDoesNotExist,
    /// A session limit or the staging budget is exhausted.
    OutOfResources,
}

impl LoginFailure {
    pub fn status(self) -> u16 {
        match self {
            LoginFailure::InitiatorError => login_status::INITIATOR_ERROR,
            LoginFailure::AuthFailed => login_status::AUTH_FAILED,
            LoginFailure::Forbidden => login_status::FORBIDDEN,
            LoginFailure::NotFound => login_status::NOT_FOUND,
            LoginFailure::UnsupportedVersion => login_status::UNSUPPORTED_VERSION,
            LoginFailure::TooManyConnections => login_status::TOO_MANY_CONNECTIONS,
            LoginFailure::MissingParameter => login_status::MISSING_PARAMETER,
            LoginFailure::SessionTypeNotSupported => login_status::SESSION_TYPE_NOT_SUPPORTED,
            LoginFailure::SessionDoesNotExist => login_status::SESSION_DOES_NOT_EXIST,
            LoginFailure::OutOfResources => login_status::OUT_OF_RESOURCES,
        }
    }
}

/// A login stage (RFC 7143 6.3); the wire's value 2 is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Security,
    Operational,
    FullFeature,
}

impl Stage {
    fn from_wire(bits: u8) -> Option<Stage> {
        match bits {
            login::STAGE_SECURITY => Some(Stage::Security),
            login::STAGE_OPERATIONAL => Some(Stage::Operational),
            login::STAGE_FULL_FEATURE => Some(Stage::FullFeature),
            _ => None,
        }
    }

    fn wire(self) -> u8 {
        match self {
            Stage::Security => login::STAGE_SECURITY,
            Stage::Operational => login::STAGE_OPERATIONAL,
            Stage::FullFeature => login::STAGE_FULL_FEATURE,
        }
    }
}

/// How far the login got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// No request yet: the first one fixes the login's identity and stage.
    Start,
    /// In `stage`, every request carrying `first`'s identity.
    In {
        first: First,
        stage: Stage,
        /// The checks that need the first request's names (InitiatorName,
        /// TargetName, the ACL) have run.
        names_checked: bool,
    },
}

/// Identity of the login, fixed by its first PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct First {
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
}

pub struct Login {
    progress: Progress,
    pub initiator_name: Option<String>,
    pub target: Option<usize>,
    pub kind: SessionKind,
    auth: Auth,
    seen: HashSet<String>,
    rx_text: Vec<u8>,
    pub params: Params,
    declared_mrdsl: bool,
    sent_tpgt: bool,
    /// Where the login comes from, for ACL entries bound to networks.
    peer: IpAddr,
}

/// A login response in the making: status and the key=value text.
pub struct Reply {
    pub flags: u8,
    pub status: u16,
    pub text: Vec<u8>,
    pub next: Next,
}

impl Reply {
    fn fail(failure: LoginFailure, flags: u8) -> Reply {
        Reply {
            flags: flags & 0x0c,
            status: failure.status(),
            text: Vec::new(),
            next: Next::Fail(failure),
        }
    }
}

impl Login {
    pub fn new(target_mrdsl: u32, transport: Transport, peer: IpAddr, proposed: CmPeer) -> Login {
        let mut params = Params::defaults(target_mrdsl);
        params.iser = transport == Transport::Iser;
        params.cm_peer = proposed;
        Login {
            progress: Progress::Start,
            initiator_name: None,
            target: None,
            kind: SessionKind::Normal,
            auth: Auth::Pending,
            seen: HashSet::new(),
            rx_text: Vec::new(),
            params,
            declared_mrdsl: false,
            sent_tpgt: false,
            peer,
        }
    }

    pub fn isid(&self) -> [u8; 6] {
        self.first().map(|f| f.isid).unwrap_or_default()
    }

    pub fn cid(&self) -> u16 {
        self.first().map(|f| f.cid).unwrap_or_default()
    }

    fn first(&self) -> Option<First> {
        match self.progress {
            Progress::Start => None,
            Progress::In { first, .. } => Some(first),
        }
    }

    fn stage(&self) -> Option<Stage> {
        match self.progress {
            Progress::Start => None,
            Progress::In { stage, .. } => Some(stage),
        }
    }

    fn chap_required<'p>(&self, portal: &'p Portal) -> Option<&'p ChapSecret> {
        match self.kind {
            SessionKind::Discovery => portal.discovery_chap.as_ref(),
            SessionKind::Normal => self
                .target
                .and_then(|t| portal.targets.get(t)?.chap.as_ref()),
        }
    }

    fn mutual_secret<'p>(&self, portal: &'p Portal) -> Option<&'p ChapSecret> {
        match self.kind {
            SessionKind::Discovery => None,
            SessionKind::Normal => self
                .target
                .and_then(|t| portal.targets.get(t)?.mutual_chap.as_ref()),
        }
    }

    /// Process one Login Request.
    pub fn handle(&mut self, portal: &Portal, req: &Bhs, data: &[u8]) -> Reply {
        let flags = req.flags();
        let (transit, cont) = (flags & login::TRANSIT != 0, flags & login::CONTINUE != 0);
        let stage_bits = flags & 0x0f;
        let Some(csg) = Stage::from_wire(login::csg(flags)) else {
            return Reply::fail(LoginFailure::InitiatorError, stage_bits);
        };
        // NSG means something only with T set (RFC 7143 11.12.3).
        let nsg = match (transit, Stage::from_wire(login::nsg(flags))) {
            (false, _) => None,
            (true, Some(nsg)) => Some(nsg),
            (true, None) => return Reply::fail(LoginFailure::InitiatorError, stage_bits),
        };

        // Only version 0 exists: a Version-min above it cannot be met.
        if req.version_min() != 0 {
            return Reply::fail(LoginFailure::UnsupportedVersion, stage_bits);
        }
        let this = First {
            isid: req.isid(),
            tsih: req.tsih(),
            cid: req.cid(),
        };
        match self.progress {
            Progress::Start => {
                if this.tsih != 0 {
                    // One connection per session: nothing can be added to a session.
                    let exists = portal.sessions_info().iter().any(|s| s.tsih == this.tsih);
                    let failure = if exists {
                        LoginFailure::TooManyConnections
                    } else {
                        LoginFailure::SessionDoesNotExist
                    };
                    return Reply::fail(failure, stage_bits);
                }
                self.progress = Progress::In {
                    first: this,
                    stage: csg,
                    names_checked: false,
                };
            }
            Progress::In { first, .. } if first != this => {
                return Reply::fail(LoginFailure::InitiatorError, stage_bits)
            }
            Progress::In { .. } => {}
        }
        if (transit && cont)
            || Some(csg) != self.stage()
            || csg == Stage::FullFeature
            || nsg.is_some_and(|nsg| nsg <= csg)
        {
            return Reply::fail(LoginFailure::InitiatorError, stage_bits);
        }

        self.rx_text.extend_from_slice(data);
        if self.rx_text.len() > 64 * 1024 {
            return Reply::fail(LoginFailure::InitiatorError, stage_bits);
        }
        if cont {
            // More text follows: acknowledge with an empty response.
            return Reply {
                flags: stage_bits & 0x0c,
                status: 0,
                text: Vec::new(),
                next: Next::Continue,
            };
        }
        let rx = std::mem::take(&mut self.rx_text);
        let pairs = match text::decode(&rx) {
            Ok(p) => p,
            Err(e) => {
                tracing::info!("login refused: malformed text: {e}");
                return Reply::fail(LoginFailure::InitiatorError, stage_bits);
            }
        };
        if self.params.iser
            && pairs
                .iter()
                .any(|p| p.key == "RDMAExtensions" && p.value == "Yes")
        {
            // Decided before any other key: it changes how ImmediateData and
            // the segment lengths are answered in this same PDU.
            self.params.rdma_extensions = true;
            if self.params.cm_peer == CmPeer::Illumos {
                tracing::warn!(
                    peer = %self.peer,
                    "the connect request looks like the illumos initiator, the login negotiates \
                     RDMAExtensions=Yes: applying the illumos limits (no immediate data, InitialR2T)"
                );
            }
        }
        // Identity keys first, whatever their order in the PDU: whether CHAP
        // is required depends on the target and the session type, so no
        // other key (AuthMethod above all) may be judged before they are known.
        for p in &pairs {
            let limit = if p.key.starts_with("CHAP_") {
                MAX_CHAP_VALUE_LEN
            } else {
                MAX_VALUE_LEN
            };
            if p.value.len() > limit {
                tracing::info!(
                    key = %p.key.escape_debug(),
                    "login refused: value longer than {limit} bytes"
                );
                return Reply::fail(LoginFailure::InitiatorError, stage_bits);
            }
            if !self.seen.insert(p.key.to_string()) {
                tracing::info!(key = %p.key.escape_debug(), "login refused: key sent twice");
                return Reply::fail(LoginFailure::InitiatorError, stage_bits);
            }
            match p.key {
                "InitiatorName" => {
                    if !is_plausible_name(p.value) {
                        tracing::info!(
                            initiator = %p.value.escape_debug(),
                            "login refused: not an iSCSI name"
                        );
                        return Reply::fail(LoginFailure::InitiatorError, stage_bits);
                    }
                    self.initiator_name = Some(p.value.to_string());
                }
                "TargetName" => match portal
                    .targets
                    .iter()
                    .position(|t| t.name.eq_ignore_ascii_case(p.value))
                {
                    Some(i) => self.target = Some(i),
                    None => {
                        tracing::info!(
                            target = %p.value.escape_debug(),
                            "login refused: no such target"
                        );
                        return Reply::fail(LoginFailure::NotFound, stage_bits);
                    }
                },
                "SessionType" => match p.value {
                    "Normal" => self.kind = SessionKind::Normal,
                    "Discovery" => self.kind = SessionKind::Discovery,
                    _ => return Reply::fail(LoginFailure::SessionTypeNotSupported, stage_bits),
                },
                _ => {}
            }
        }
        let mut out = Vec::new();
        let mut chap_n = None;
        let mut chap_r = None;
        let mut chap_i = None;
        let mut chap_c = None;
        for p in &pairs {
            match p.key {
                "InitiatorName" | "TargetName" | "SessionType" => {}
                "InitiatorAlias" => {}
                "AuthMethod" => {
                    let v = self.negotiate_auth(portal, p.value);
                    let failed = v == "Reject";
                    text::encode_pair(&mut out, "AuthMethod", v);
                    if failed {
                        return Reply {
                            text: out,
                            ..Reply::fail(LoginFailure::AuthFailed, stage_bits)
                        };
                    }
                }
                "CHAP_A" => {
                    if self.auth != Auth::ChapAgreed {
                        return Reply::fail(LoginFailure::InitiatorError, stage_bits);
                    }
                    if !p.value.split(',').any(|a| a == chap::ALGORITHM_MD5) {
                        text::encode_pair(&mut out, "CHAP_A", "Reject");
                        return Reply {
                            text: out,
                            ..Reply::fail(LoginFailure::AuthFailed, stage_bits)
                        };
                    }
                    let mut challenge = vec![0u8; CHAP_CHALLENGE_LEN];
                    let mut rng = rand::thread_rng();
                    rng.fill_bytes(&mut challenge);
                    let id = (rng.next_u32() & 0xff) as u8;
                    text::encode_pair(&mut out, "CHAP_A", chap::ALGORITHM_MD5);
                    text::encode_pair(&mut out, "CHAP_I", &id.to_string());
                    text::encode_pair(&mut out, "CHAP_C", &encode_hex(&challenge));
                    self.auth = Auth::ChallengeSent { id, challenge };
                }
                "CHAP_N" => chap_n = Some(p.value),
                "CHAP_R" => chap_r = Some(p.value),
                "CHAP_I" => chap_i = Some(p.value),
                "CHAP_C" => chap_c = Some(p.value),
                key => {
                    if let Some(v) =
                        negotiate(key, p.value, &mut self.params, &portal.limits, self.kind)
                    {
                        text::encode_pair(&mut out, key, &v);
                    }
                }
            }
        }

        if self.names_unchecked() {
            let Some(name) = &self.initiator_name else {
                return Reply::fail(LoginFailure::MissingParameter, stage_bits);
            };
            if self.kind == SessionKind::Normal {
                let Some(t) = self.target.and_then(|t| portal.targets.get(t)) else {
                    return Reply::fail(LoginFailure::MissingParameter, stage_bits);
                };
                if !t.acl.allows(name, self.peer) {
                    tracing::warn!(initiator = %name, target = %t.name, "login refused: initiator not in the target's ACL");
                    return Reply::fail(LoginFailure::Forbidden, stage_bits);
                }
            }
        }

        if chap_n.is_some() || chap_r.is_some() {
            match self.verify_chap(portal, chap_n, chap_r, chap_i, chap_c, &mut out) {
                Ok(()) => {}
                Err(status) => return Reply::fail(status, stage_bits),
            }
        } else if chap_i.is_some() || chap_c.is_some() {
            return Reply::fail(LoginFailure::InitiatorError, stage_bits);
        }

        if self.kind == SessionKind::Normal && !self.sent_tpgt {
            self.sent_tpgt = true;
            text::encode_pair(&mut out, "TargetPortalGroupTag", &portal.tpgt.to_string());
            if let Some(alias) = self
                .target
                .and_then(|t| portal.targets.get(t)?.alias.as_deref())
            {
                text::encode_pair(&mut out, "TargetAlias", alias);
            }
        }
        if csg == Stage::Operational && !self.declared_mrdsl {
            self.declared_mrdsl = true;
            let key = if self.params.rdma_extensions {
                "TargetRecvDataSegmentLength"
            } else {
                "MaxRecvDataSegmentLength"
            };
            text::encode_pair(&mut out, key, &self.params.target_mrdsl.to_string());
        }

        let mut next = Next::Continue;
        let mut resp_flags = csg.wire() << 2;
        if let Some(nsg) = nsg {
            let may_leave = csg != Stage::Security || self.security_done(portal);
            if csg == Stage::Security && self.chap_required(portal).is_some() && !may_leave {
                // The initiator wants to skip authentication the target requires.
                if self.auth == Auth::Pending {
                    return Reply::fail(LoginFailure::AuthFailed, stage_bits);
                }
            }
            if may_leave {
                resp_flags |= login::TRANSIT | nsg.wire();
                if let Progress::In { stage, .. } = &mut self.progress {
                    *stage = nsg;
                }
                if nsg == Stage::FullFeature {
                    if self.params.first_burst_len > self.params.max_burst_len {
                        self.params.first_burst_len = self.params.max_burst_len;
                    }
                    next = Next::FullFeature;
                    if self.params.iser
                        && self.params.cm_peer == CmPeer::Linux
                        && !self.params.rdma_extensions
                    {
                        tracing::warn!(
                            peer = %self.peer,
                            "the connect request looks like Linux ib_iser, the login has no \
                             RDMAExtensions=Yes: applied the illumos limits"
                        );
                    }
                }
            }
        } else if csg == Stage::Operational
            && self.stage() == Some(Stage::Operational)
            && self.chap_required(portal).is_some()
            && self.auth != Auth::ChapVerified
        {
            return Reply::fail(LoginFailure::AuthFailed, stage_bits);
        }
        if csg == Stage::Operational
            && self.chap_required(portal).is_some()
            && self.auth != Auth::ChapVerified
        {
            // Skipped the security stage on a target that requires CHAP.
            return Reply::fail(LoginFailure::AuthFailed, stage_bits);
        }
        if self.stage() != Some(Stage::Security)
            && self.chap_required(portal).is_some()
            && self.auth != Auth::ChapVerified
        {
            // Whatever path led here: a protected target is never past the
            // security stage without a verified CHAP response.
            tracing::warn!("login refused: leaving security without a verified CHAP response");
            return Reply::fail(LoginFailure::AuthFailed, stage_bits);
        }
        Reply {
            flags: resp_flags,
            status: login_status::SUCCESS,
            text: out,
            next,
        }
    }

    /// True once, on the first request: the checks that need its names run
    /// then. Later requests cannot change the names (a key sent twice fails
    /// the login).
    fn names_unchecked(&mut self) -> bool {
        match &mut self.progress {
            Progress::In { names_checked, .. } if !*names_checked => {
                *names_checked = true;
                true
            }
            _ => false,
        }
    }

    fn security_done(&mut self, portal: &Portal) -> bool {
        match self.auth {
            Auth::ChapVerified => true,
            Auth::NotRequired | Auth::Pending if self.chap_required(portal).is_none() => {
                self.auth = Auth::NotRequired;
                true
            }
            _ => false,
        }
    }

    fn negotiate_auth(&mut self, portal: &Portal, offered: &str) -> &'static str {
        let methods: Vec<&str> = offered.split(',').collect();
        if self.chap_required(portal).is_some() {
            if methods.contains(&"CHAP") {
                self.auth = Auth::ChapAgreed;
                return "CHAP";
            }
            tracing::warn!(
                "login refused: target requires CHAP, initiator offered {}",
                offered.escape_debug()
            );
            return "Reject";
        }
        if methods.contains(&"None") {
            self.auth = Auth::NotRequired;
            "None"
        } else {
            tracing::warn!(
                "login refused: no CHAP secret is configured, initiator offered only {}",
                offered.escape_debug()
            );
            "Reject"
        }
    }

    fn verify_chap(
        &mut self,
        portal: &Portal,
        n: Option<&str>,
        r: Option<&str>,
        i: Option<&str>,
        c: Option<&str>,
        out: &mut Vec<u8>,
    ) -> Result<(), LoginFailure> {
        let Auth::ChallengeSent { id, challenge } =
            std::mem::replace(&mut self.auth, Auth::Pending)
        else {
            return Err(LoginFailure::InitiatorError);
        };
        let (Some(n), Some(r)) = (n, r) else {
            return Err(LoginFailure::InitiatorError);
        };
        let secret = self
            .chap_required(portal)
            .ok_or(LoginFailure::InitiatorError)?;
        let response = decode_binary(r).ok_or(LoginFailure::InitiatorError)?;
        let expected = chap::response(id, secret.secret.as_bytes(), &challenge);
        if n != secret.user || response[..] != expected[..] {
            tracing::warn!(
                user = %n.escape_debug(),
                "login refused: CHAP authentication failed"
            );
            return Err(LoginFailure::AuthFailed);
        }
        match (i, c) {
            (None, None) => {}
            (Some(i), Some(c)) => {
                let mutual = self.mutual_secret(portal).ok_or_else(|| {
                    tracing::warn!(
                        "login refused: initiator asked for mutual CHAP, none configured"
                    );
                    LoginFailure::AuthFailed
                })?;
                let id = chap::parse_identifier(i).ok_or(LoginFailure::InitiatorError)?;
                let their = decode_binary(c).ok_or(LoginFailure::InitiatorError)?;
                if their == challenge {
                    tracing::warn!(
                        "login refused: initiator reflected the target's CHAP challenge"
                    );
                    return Err(LoginFailure::AuthFailed);
                }
                text::encode_pair(out, "CHAP_N", &mutual.user);
                text::encode_pair(
                    out,
                    "CHAP_R",
                    &encode_hex(&chap::response(id, mutual.secret.as_bytes(), &their)),
                );
            }
            _ => return Err(LoginFailure::InitiatorError),
        }
        self.auth = Auth::ChapVerified;
        Ok(())
    }
}

/// An iSCSI name (RFC 3722 profile) has no spaces or control characters:
/// it is printed in logs and `status`, so nothing that can steer a terminal
/// is let in.
fn is_plausible_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.chars().any(|c| c.is_control() || c.is_whitespace())
}
