//! Login parameters, the keys the initiator proposes, and what it records
//! from the target's answers (RFC 7143 section 13).

use ramslog_common::iscsi::keys::{self, yes_no};

use crate::chap;
use crate::Error;

pub const DEFAULT_INITIATOR_NAME: &str = "iqn.2026-11.org.ramslog:initiator";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    Normal,
    Discovery,
}

/// What to propose for HeaderDigest / DataDigest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Digest {
    None,
    Crc32c,
    /// `CRC32C,None`: let the target choose.
    PreferCrc32c,
}

impl Digest {
    fn offer(self) -> &'static str {
        match self {
            Digest::None => "None",
            Digest::Crc32c => "CRC32C",
            Digest::PreferCrc32c => "CRC32C,None",
        }
    }
}

/// Which operational key set the initiator offers: the transport's dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoginDialect {
    /// RFC 7143 keys (iSCSI/TCP).
    #[default]
    Rfc7143,
    /// iSER as Linux open-iscsi/ib_iser speaks it (RFC 7145): `RDMAExtensions=Yes`,
    /// and `InitiatorRecvDataSegmentLength` / `TargetRecvDataSegmentLength`
    /// instead of MaxRecvDataSegmentLength.
    IserRdmaExtensions,
    /// The illumos initiator (`iscsi_make_login_pdu`), over iSER or TCP: no
    /// iSER keys, its key set in its order, markers declined, and
    /// DefaultTime2Retain 20.
    Illumos,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub name: String,
    pub secret: Vec<u8>,
}

/// CHAP: `initiator` is what we answer the target's challenge with; with
/// `mutual`, we challenge the target too and expect it to answer as
/// `mutual.name` with `mutual.secret`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapParams {
    pub initiator: Credentials,
    pub mutual: Option<Credentials>,
}

#[derive(Debug, Clone)]
pub struct LoginParams {
    pub initiator_name: String,
    pub initiator_alias: Option<String>,
    pub session_type: SessionType,
    /// Required for a Normal session.
    pub target_name: Option<String>,
    /// None: random, format 10b ("Random", RFC 7143 11.12.5).
    pub isid: Option<[u8; 6]>,
    /// 0 for a new session.
    pub tsih: u16,
    pub cid: u16,
    pub chap: Option<ChapParams>,
    pub header_digest: Digest,
    pub data_digest: Digest,
    /// Our MaxRecvDataSegmentLength (declared).
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// Extra operational keys, sent after the standard ones (tests).
    pub extra_keys: Vec<(String, String)>,
    /// The operational key set offered.
    pub dialect: LoginDialect,
}

impl LoginParams {
    pub fn normal(initiator_name: impl Into<String>, target_name: impl Into<String>) -> Self {
        LoginParams {
            target_name: Some(target_name.into()),
            ..LoginParams::discovery(initiator_name)
        }
        .with_session_type(SessionType::Normal)
    }

    pub fn discovery(initiator_name: impl Into<String>) -> Self {
        LoginParams {
            initiator_name: initiator_name.into(),
            initiator_alias: None,
            session_type: SessionType::Discovery,
            target_name: None,
            isid: None,
            tsih: 0,
            cid: 0,
            chap: None,
            header_digest: Digest::None,
            data_digest: Digest::None,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            first_burst_length: 262_144,
            initial_r2t: false,
            immediate_data: true,
            extra_keys: Vec::new(),
            dialect: LoginDialect::Rfc7143,
        }
    }

    fn with_session_type(mut self, t: SessionType) -> Self {
        self.session_type = t;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::InvalidArgument(m.into()));
        if self.initiator_name.is_empty() {
            return bad("empty InitiatorName");
        }
        if self.session_type == SessionType::Normal
            && self.target_name.as_deref().is_none_or(str::is_empty)
        {
            return bad("a Normal session needs a TargetName");
        }
        if !(512..=16_777_215).contains(&self.max_recv_data_segment_length)
            || !(512..=16_777_215).contains(&self.max_burst_length)
            || !(512..=16_777_215).contains(&self.first_burst_length)
        {
            return bad("lengths must be in 512..=2^24-1");
        }
        if self.first_burst_length > self.max_burst_length {
            return bad("FirstBurstLength > MaxBurstLength");
        }
        Ok(())
    }

    pub(crate) fn security_keys(&self) -> Vec<(String, String)> {
        let mut k = vec![
            ("InitiatorName".to_string(), self.initiator_name.clone()),
            (
                "SessionType".to_string(),
                match self.session_type {
                    SessionType::Normal => "Normal",
                    SessionType::Discovery => "Discovery",
                }
                .to_string(),
            ),
        ];
        if let (SessionType::Normal, Some(t)) = (self.session_type, &self.target_name) {
            k.push(("TargetName".into(), t.clone()));
        }
        if let Some(a) = &self.initiator_alias {
            k.push(("InitiatorAlias".into(), a.clone()));
        }
        k.push((
            "AuthMethod".into(),
            if self.chap.is_some() { "CHAP" } else { "None" }.into(),
        ));
        k
    }

    pub(crate) fn operational_keys(&self) -> Vec<(String, String)> {
        match self.dialect {
            LoginDialect::Rfc7143 | LoginDialect::IserRdmaExtensions => self.rfc7143_keys(),
            LoginDialect::Illumos => self.illumos_keys(),
        }
    }

    /// What illumos `iscsi_make_login_pdu` offers, in its order.
    fn illumos_keys(&self) -> Vec<(String, String)> {
        let mut k: Vec<(String, String)> = vec![
            ("HeaderDigest".into(), self.header_digest.offer().into()),
            ("DataDigest".into(), self.data_digest.offer().into()),
            (
                "MaxRecvDataSegmentLength".into(),
                self.max_recv_data_segment_length.to_string(),
            ),
            ("DefaultTime2Wait".into(), "2".into()),
            ("DefaultTime2Retain".into(), "20".into()),
            ("ErrorRecoveryLevel".into(), "0".into()),
            ("IFMarker".into(), "No".into()),
            ("OFMarker".into(), "No".into()),
        ];
        if self.session_type == SessionType::Normal {
            k.extend([
                ("InitialR2T".into(), yes_no(self.initial_r2t).into()),
                ("ImmediateData".into(), yes_no(self.immediate_data).into()),
                ("MaxBurstLength".into(), self.max_burst_length.to_string()),
                (
                    "FirstBurstLength".into(),
                    self.first_burst_length.to_string(),
                ),
                ("MaxOutstandingR2T".into(), "1".into()),
                ("MaxConnections".into(), "1".into()),
                ("DataPDUInOrder".into(), "Yes".into()),
                ("DataSequenceInOrder".into(), "Yes".into()),
            ]);
        }
        k.extend(self.extra_keys.iter().cloned());
        k
    }

    fn rfc7143_keys(&self) -> Vec<(String, String)> {
        let mut k: Vec<(String, String)> = vec![
            ("HeaderDigest".into(), self.header_digest.offer().into()),
            ("DataDigest".into(), self.data_digest.offer().into()),
        ];
        if self.session_type == SessionType::Normal {
            k.extend([
                ("MaxConnections".into(), "1".into()),
                ("InitialR2T".into(), yes_no(self.initial_r2t).into()),
                ("ImmediateData".into(), yes_no(self.immediate_data).into()),
            ]);
        }
        if self.dialect == LoginDialect::IserRdmaExtensions {
            // RFC 7145 7.2: the RDMA-assisted lengths replace MaxRecvDataSegmentLength.
            let ours = self.max_recv_data_segment_length.to_string();
            k.extend([
                ("RDMAExtensions".into(), "Yes".into()),
                ("InitiatorRecvDataSegmentLength".into(), ours.clone()),
                ("TargetRecvDataSegmentLength".into(), ours),
            ]);
        } else {
            k.push((
                "MaxRecvDataSegmentLength".into(),
                self.max_recv_data_segment_length.to_string(),
            ));
        }
        if self.session_type == SessionType::Normal {
            k.extend([
                ("MaxBurstLength".into(), self.max_burst_length.to_string()),
                (
                    "FirstBurstLength".into(),
                    self.first_burst_length.to_string(),
                ),
            ]);
        }
        k.extend([
            ("DefaultTime2Wait".into(), "2".into()),
            ("DefaultTime2Retain".into(), "0".into()),
        ]);
        if self.session_type == SessionType::Normal {
            k.extend([
                ("MaxOutstandingR2T".into(), "1".into()),
                ("DataPDUInOrder".into(), "Yes".into()),
                ("DataSequenceInOrder".into(), "Yes".into()),
            ]);
        }
        k.push(("ErrorRecoveryLevel".into(), "0".into()));
        k.extend(self.extra_keys.iter().cloned());
        k
    }
}

/// The session's operational values, as the target answered them (RFC 7143
/// defaults where it did not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_connections: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// Ours: the most the target may put in one data segment to us.
    pub max_recv_data_segment_length: u32,
    /// The target's declared MaxRecvDataSegmentLength: the most we may send.
    pub target_max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    pub max_outstanding_r2t: u32,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u32,
    pub target_portal_group_tag: Option<u16>,
    pub target_alias: Option<String>,
    /// iSER-assisted with RFC 7145 keys (`RDMAExtensions=Yes` agreed).
    pub rdma_extensions: bool,
    /// Every key=value the target sent during login, in order.
    pub target_keys: Vec<(String, String)>,
}

impl Negotiated {
    /// RFC 7143 defaults.
    pub(crate) fn defaults(ours: u32) -> Self {
        Negotiated {
            header_digest: false,
            data_digest: false,
            max_connections: keys::MAX_CONNECTIONS.default_number() as u32,
            initial_r2t: keys::INITIAL_R2T.default_bool(),
            immediate_data: keys::IMMEDIATE_DATA.default_bool(),
            max_recv_data_segment_length: ours,
            target_max_recv_data_segment_length: keys::MAX_RECV_DATA_SEGMENT_LENGTH.default_number()
                as u32,
            max_burst_length: keys::MAX_BURST_LENGTH.default_number() as u32,
            first_burst_length: keys::FIRST_BURST_LENGTH.default_number() as u32,
            default_time2wait: keys::DEFAULT_TIME2WAIT.default_number() as u32,
            default_time2retain: keys::DEFAULT_TIME2RETAIN.default_number() as u32,
            max_outstanding_r2t: keys::MAX_OUTSTANDING_R2T.default_number() as u32,
            data_pdu_in_order: keys::DATA_PDU_IN_ORDER.default_bool(),
            data_sequence_in_order: keys::DATA_SEQUENCE_IN_ORDER.default_bool(),
            error_recovery_level: keys::ERROR_RECOVERY_LEVEL.default_number() as u32,
            target_portal_group_tag: None,
            target_alias: None,
            rdma_extensions: false,
            target_keys: Vec::new(),
        }
    }

    /// Record one answer from the target, checking it against what we offered.
    pub(crate) fn apply(&mut self, p: &LoginParams, key: &str, value: &str) -> Result<(), Error> {
        self.target_keys.push((key.to_string(), value.to_string()));
        if matches!(value, "Irrelevant" | "NotUnderstood" | "Reject") {
            tracing::debug!(key, value, "target did not accept the key; default kept");
            return Ok(());
        }
        let bad = || Error::proto(format!("login key {key}={value:?} is not a valid answer"));
        let spec = keys::lookup(key);
        // Range-checked, decimal or hex, as RFC 7143 6.1 allows.
        let num = || {
            spec.and_then(|k| k.number(value))
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(bad)
        };
        let boolean = || keys::parse_bool(value).ok_or_else(bad);
        // What we offered bounds the outcome: a minimum cannot exceed it,
        // an AND of our No is No, an OR of our Yes is Yes.
        if let Some(k) = spec {
            let offered = p.operational_keys().into_iter().find(|(o, _)| o == key);
            if offered.is_some_and(|(_, ours)| !k.answer_fits(&ours, value)) {
                return Err(bad());
            }
        }
        let digest = |offer: Digest| -> Result<bool, Error> {
            match (value, offer) {
                ("None", Digest::None | Digest::PreferCrc32c) => Ok(false),
                ("CRC32C", Digest::Crc32c | Digest::PreferCrc32c) => Ok(true),
                _ => Err(bad()),
            }
        };
        match key {
            "HeaderDigest" => self.header_digest = digest(p.header_digest)?,
            "DataDigest" => self.data_digest = digest(p.data_digest)?,
            "MaxConnections" => self.max_connections = num()?,
            "InitialR2T" => self.initial_r2t = boolean()?,
            "ImmediateData" => self.immediate_data = boolean()?,
            "MaxRecvDataSegmentLength" | "TargetRecvDataSegmentLength" => {
                self.target_max_recv_data_segment_length = num()?
            }
            "RDMAExtensions" => {
                let v = boolean()?;
                if v && p.dialect != LoginDialect::IserRdmaExtensions {
                    return Err(bad()); // AND function: we did not offer Yes
                }
                self.rdma_extensions = v;
            }
            "MaxBurstLength" => self.max_burst_length = num()?,
            "FirstBurstLength" => self.first_burst_length = num()?,
            "DefaultTime2Wait" => self.default_time2wait = num()?,
            "DefaultTime2Retain" => self.default_time2retain = num()?,
            "MaxOutstandingR2T" => self.max_outstanding_r2t = num()?,
            "DataPDUInOrder" => self.data_pdu_in_order = boolean()?,
            "DataSequenceInOrder" => self.data_sequence_in_order = boolean()?,
            "ErrorRecoveryLevel" => self.error_recovery_level = num()?,
            "TargetPortalGroupTag" => {
                self.target_portal_group_tag = Some(value.parse().map_err(|_| bad())?)
            }
            "TargetAlias" => self.target_alias = Some(value.to_string()),
            _ => {}
        }
        Ok(())
    }

    /// Final sanity checks after login.
    pub(crate) fn finish(&mut self) -> Result<(), Error> {
        if self.first_burst_length > self.max_burst_length {
            // RFC 7143 13.14: FirstBurstLength must not exceed MaxBurstLength.
            return Err(Error::proto(format!(
                "FirstBurstLength {} > MaxBurstLength {}",
                self.first_burst_length, self.max_burst_length
            )));
        }
        if self.error_recovery_level != 0 || self.max_connections != 1 {
            return Err(Error::proto(format!(
                "negotiated ErrorRecoveryLevel={} MaxConnections={}, offered 0 and 1",
                self.error_recovery_level, self.max_connections
            )));
        }
        Ok(())
    }
}

/// A key the target offered on its own: the value we answer with, or None if
/// it is declarative (nothing to answer).
pub(crate) fn answer_target_offer(key: &str, value: &str) -> Option<String> {
    match key {
        "TargetAlias"
        | "TargetAddress"
        | "TargetPortalGroupTag"
        | "MaxRecvDataSegmentLength"
        | "TargetRecvDataSegmentLength"
        | "InitiatorRecvDataSegmentLength"
        | "TargetName" => None,
        "HeaderDigest"
        | "DataDigest"
        | "MaxConnections"
        | "InitialR2T"
        | "ImmediateData"
        | "MaxBurstLength"
        | "FirstBurstLength"
        | "DefaultTime2Wait"
        | "DefaultTime2Retain"
        | "MaxOutstandingR2T"
        | "DataPDUInOrder"
        | "DataSequenceInOrder"
        | "ErrorRecoveryLevel"
        | "IFMarker"
        | "OFMarker" => {
            // Accept the target's (first) choice.
            Some(value.split(',').next().unwrap_or(value).to_string())
        }
        _ if matches!(value, "Irrelevant" | "NotUnderstood" | "Reject") => None,
        _ => Some("NotUnderstood".into()),
    }
}

/// Outcome of a successful login.
#[derive(Debug, Clone)]
pub struct LoginOutcome {
    pub tsih: u16,
    pub isid: [u8; 6],
    pub negotiated: Negotiated,
}

/// Random-format ISID (T=10b): 0x80, 3 random bytes (B, C), 2-byte qualifier.
pub(crate) fn random_isid() -> [u8; 6] {
    let r: [u8; 5] = rand::random();
    [0x80, r[0], r[1], r[2], r[3], r[4]]
}

/// Our CHAP answer keys for a target challenge.
pub(crate) fn chap_answer(
    creds: &Credentials,
    id: &str,
    challenge: &str,
) -> Result<(Vec<u8>, [u8; 16]), Error> {
    let id = chap::parse_identifier(id)?;
    let c = chap::decode_binary(challenge)?;
    if c.is_empty() {
        return Err(Error::Auth("empty CHAP_C from the target".into()));
    }
    Ok((c.clone(), chap::response(id, &creds.secret, &c)))
}

pub(crate) fn encode_keys(keys: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in keys {
        ramslog_common::iscsi::text::encode_pair(&mut out, k, v);
    }
    out
}

pub(crate) fn decode_keys(data: &[u8]) -> Result<Vec<(String, String)>, Error> {
    Ok(ramslog_common::iscsi::text::decode(data)
        .map_err(|e| Error::proto(format!("bad text data: {e}")))?
        .into_iter()
        .map(|p| (p.key.to_string(), p.value.to_string()))
        .collect())
}

pub(crate) fn get<'a>(keys: &'a [(String, String)], key: &str) -> Option<&'a str> {
    keys.iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operational_keys_normal_and_discovery() {
        let p = LoginParams::normal("iqn.i", "iqn.t");
        let k = p.operational_keys();
        let names: Vec<&str> = k.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "HeaderDigest",
                "DataDigest",
                "MaxConnections",
                "InitialR2T",
                "ImmediateData",
                "MaxRecvDataSegmentLength",
                "MaxBurstLength",
                "FirstBurstLength",
                "DefaultTime2Wait",
                "DefaultTime2Retain",
                "MaxOutstandingR2T",
                "DataPDUInOrder",
                "DataSequenceInOrder",
                "ErrorRecoveryLevel"
            ]
        );
        let text = encode_keys(&k);
        assert!(text.starts_with(b"HeaderDigest=None\0DataDigest=None\0MaxConnections=1\0"));
        assert_eq!(decode_keys(&text).unwrap(), k);

        // The other dialects: iSER keys instead of MaxRecvDataSegmentLength;
        // illumos' own set and order, without iSER keys.
        let mut p = LoginParams::normal("iqn.i", "iqn.t");
        p.dialect = LoginDialect::IserRdmaExtensions;
        let k = p.operational_keys();
        assert_eq!(get(&k, "MaxRecvDataSegmentLength"), None);
        for key in [
            "RDMAExtensions",
            "InitiatorRecvDataSegmentLength",
            "TargetRecvDataSegmentLength",
        ] {
            assert!(get(&k, key).is_some(), "{key}");
        }
        p.dialect = LoginDialect::Illumos;
        let k = p.operational_keys();
        let names: Vec<&str> = k.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names.len(), 16);
        assert_eq!(
            names[..8],
            [
                "HeaderDigest",
                "DataDigest",
                "MaxRecvDataSegmentLength",
                "DefaultTime2Wait",
                "DefaultTime2Retain",
                "ErrorRecoveryLevel",
                "IFMarker",
                "OFMarker"
            ]
        );
        assert_eq!(names[12..14], ["MaxOutstandingR2T", "MaxConnections"]);
        p.session_type = SessionType::Discovery;
        assert_eq!(p.operational_keys().len(), 8);

        let d = LoginParams::discovery("iqn.i");
        let names: Vec<String> = d.operational_keys().into_iter().map(|(k, _)| k).collect();
        assert!(!names
            .iter()
            .any(|k| k == "MaxBurstLength" || k == "InitialR2T"));
        let s = d.security_keys();
        assert_eq!(get(&s, "SessionType"), Some("Discovery"));
        assert_eq!(get(&s, "TargetName"), None);
        assert_eq!(get(&s, "AuthMethod"), Some("None"));
        assert!(LoginParams::discovery("").validate().is_err());
        let mut n = LoginParams::normal("iqn.i", "");
        assert!(n.validate().is_err());
        n.target_name = Some("iqn.t".into());
        assert!(n.validate().is_ok());
    }

    #[test]
    fn records_and_checks_answers() {
        let mut p = LoginParams::normal("iqn.i", "iqn.t");
        p.header_digest = Digest::PreferCrc32c;
        let mut n = Negotiated::defaults(p.max_recv_data_segment_length);
        for (k, v) in [
            ("HeaderDigest", "CRC32C"),
            ("DataDigest", "None"),
            ("InitialR2T", "Yes"),
            ("ImmediateData", "No"),
            ("MaxRecvDataSegmentLength", "8192"),
            ("MaxBurstLength", "262144"),
            ("FirstBurstLength", "65536"),
            ("MaxConnections", "1"),
            ("TargetPortalGroupTag", "1"),
            ("X-foo", "bar"),
        ] {
            n.apply(&p, k, v).unwrap();
        }
        n.finish().unwrap();
        assert!(n.header_digest && !n.data_digest);
        assert!(n.initial_r2t && !n.immediate_data);
        assert_eq!(n.target_max_recv_data_segment_length, 8192);
        assert_eq!(n.first_burst_length, 65536);
        assert_eq!(n.target_portal_group_tag, Some(1));
        assert_eq!(n.target_keys.len(), 10);

        // Answers outside what we offered are the target's fault.
        assert!(n.apply(&p, "DataDigest", "CRC32C").is_err());
        assert!(n.apply(&p, "MaxBurstLength", "99999999").is_err());
        assert!(n.apply(&p, "ImmediateData", "Maybe").is_err());
        p.initial_r2t = true;
        assert!(n.apply(&p, "InitialR2T", "No").is_err());
        assert!(n.apply(&p, "MaxConnections", "2").is_err());
        // Not understood keeps the default.
        n.apply(&p, "MaxOutstandingR2T", "NotUnderstood").unwrap();
        assert_eq!(n.max_outstanding_r2t, 1);

        assert_eq!(answer_target_offer("TargetAlias", "x"), None);
        assert_eq!(
            answer_target_offer("HeaderDigest", "CRC32C,None").as_deref(),
            Some("CRC32C")
        );
        assert_eq!(
            answer_target_offer("X-vendor", "1").as_deref(),
            Some("NotUnderstood")
        );
    }

    #[test]
    fn chap_answer_matches_independent_md5() {
        // python3: hashlib.md5(bytes([7]) + b"secret" + bytes.fromhex("0102...10")).hexdigest()
        let creds = Credentials {
            name: "user".into(),
            secret: b"secret".to_vec(),
        };
        let (_, r) = chap_answer(&creds, "7", "0x0102030405060708090a0b0c0d0e0f10").unwrap();
        assert_eq!(chap::encode_hex(&r), "0x9202454b727fb7e4d68ee20d80d9a59b");
        let isid = random_isid();
        assert_eq!(isid[0], 0x80);
    }
}
