//! The login and text keys both negotiating sides know (RFC 7143 chapter 13,
//! RFC 7145 chapter 6 for iSER): how each is negotiated, its range and its
//! default. The target's and the initiator's negotiations read them here;
//! what each side *wants* stays with that side.

/// How the outcome of a numerical key follows from the two values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumberResult {
    Minimum,
    Maximum,
}

/// How the outcome of a boolean key follows from the two values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolResult {
    And,
    Or,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Negotiation {
    /// Both sides send a number in `lo..=hi`; the outcome is their minimum
    /// or maximum.
    Number {
        lo: u64,
        hi: u64,
        default: u64,
        result: NumberResult,
    },
    Boolean {
        default: bool,
        result: BoolResult,
    },
    /// The proposer lists values in order of preference; the responder
    /// picks the first it supports.
    List {
        default: &'static str,
    },
    /// A number in `lo..=hi` that one side declares about itself; nothing is
    /// answered.
    DeclaredNumber {
        lo: u64,
        hi: u64,
        default: u64,
    },
    /// Text one side declares (names, aliases, addresses).
    Declared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub name: &'static str,
    pub negotiation: Negotiation,
    /// Only a normal session uses it: in a discovery session the answer is
    /// Irrelevant (RFC 7143 13).
    pub normal_only: bool,
}

/// The largest data segment length the 24-bit field can carry.
const MAX_SEGMENT: u64 = (1 << 24) - 1;

const fn number(name: &'static str, lo: u64, hi: u64, default: u64, result: NumberResult) -> Key {
    Key {
        name,
        negotiation: Negotiation::Number {
            lo,
            hi,
            default,
            result,
        },
        normal_only: true,
    }
}

const fn boolean(name: &'static str, default: bool, result: BoolResult) -> Key {
    Key {
        name,
        negotiation: Negotiation::Boolean { default, result },
        normal_only: true,
    }
}

const fn list(name: &'static str, default: &'static str) -> Key {
    Key {
        name,
        negotiation: Negotiation::List { default },
        normal_only: false,
    }
}

const fn declared_length(name: &'static str) -> Key {
    Key {
        name,
        negotiation: Negotiation::DeclaredNumber {
            lo: 512,
            hi: MAX_SEGMENT,
            default: 8192,
        },
        normal_only: false,
    }
}

const fn declared(name: &'static str) -> Key {
    Key {
        name,
        negotiation: Negotiation::Declared,
        normal_only: false,
    }
}

use BoolResult::{And, Or};
use NumberResult::{Maximum, Minimum};

pub const HEADER_DIGEST: Key = list("HeaderDigest", "None");
pub const DATA_DIGEST: Key = list("DataDigest", "None");
pub const AUTH_METHOD: Key = list("AuthMethod", "None");
pub const MAX_CONNECTIONS: Key = number("MaxConnections", 1, 65535, 1, Minimum);
pub const INITIAL_R2T: Key = boolean("InitialR2T", true, Or);
pub const IMMEDIATE_DATA: Key = boolean("ImmediateData", true, And);
pub const MAX_RECV_DATA_SEGMENT_LENGTH: Key = declared_length("MaxRecvDataSegmentLength");
pub const MAX_BURST_LENGTH: Key = number("MaxBurstLength", 512, MAX_SEGMENT, 262_144, Minimum);
pub const FIRST_BURST_LENGTH: Key = number("FirstBurstLength", 512, MAX_SEGMENT, 65_536, Minimum);
pub const DEFAULT_TIME2WAIT: Key = number("DefaultTime2Wait", 0, 3600, 2, Maximum);
pub const DEFAULT_TIME2RETAIN: Key = number("DefaultTime2Retain", 0, 3600, 20, Minimum);
pub const MAX_OUTSTANDING_R2T: Key = number("MaxOutstandingR2T", 1, 65535, 1, Minimum);
pub const DATA_PDU_IN_ORDER: Key = boolean("DataPDUInOrder", true, Or);
pub const DATA_SEQUENCE_IN_ORDER: Key = boolean("DataSequenceInOrder", true, Or);
pub const ERROR_RECOVERY_LEVEL: Key = Key {
    normal_only: false,
    ..number("ErrorRecoveryLevel", 0, 2, 0, Minimum)
};
pub const IF_MARKER: Key = Key {
    normal_only: false,
    ..boolean("IFMarker", false, And)
};
pub const OF_MARKER: Key = Key {
    normal_only: false,
    ..boolean("OFMarker", false, And)
};
pub const SESSION_TYPE: Key = list("SessionType", "Normal");
pub const TASK_REPORTING: Key = list("TaskReporting", "RFC3720");
/// RFC 7144 13.1.
pub const ISCSI_PROTOCOL_LEVEL: Key = Key {
    normal_only: false,
    ..number("iSCSIProtocolLevel", 0, 31, 1, Minimum)
};
/// RFC 7145 6.3.
pub const RDMA_EXTENSIONS: Key = Key {
    normal_only: false,
    ..boolean("RDMAExtensions", false, And)
};
/// RFC 7145 6.4, 6.5: the iSER replacements for MaxRecvDataSegmentLength.
pub const INITIATOR_RECV_DATA_SEGMENT_LENGTH: Key =
    declared_length("InitiatorRecvDataSegmentLength");
pub const TARGET_RECV_DATA_SEGMENT_LENGTH: Key = declared_length("TargetRecvDataSegmentLength");
/// RFC 7145 6.6: 0 means no limit, otherwise at least 2.
pub const MAX_OUTSTANDING_UNEXPECTED_PDUS: Key = Key {
    normal_only: false,
    ..number(
        "MaxOutstandingUnexpectedPDUs",
        0,
        u32::MAX as u64,
        0,
        Minimum,
    )
};

/// Every key in the table, for lookups by name.
pub const ALL: &[Key] = &[
    HEADER_DIGEST,
    DATA_DIGEST,
    AUTH_METHOD,
    MAX_CONNECTIONS,
    INITIAL_R2T,
    IMMEDIATE_DATA,
    MAX_RECV_DATA_SEGMENT_LENGTH,
    MAX_BURST_LENGTH,
    FIRST_BURST_LENGTH,
    DEFAULT_TIME2WAIT,
    DEFAULT_TIME2RETAIN,
    MAX_OUTSTANDING_R2T,
    DATA_PDU_IN_ORDER,
    DATA_SEQUENCE_IN_ORDER,
    ERROR_RECOVERY_LEVEL,
    IF_MARKER,
    OF_MARKER,
    SESSION_TYPE,
    TASK_REPORTING,
    ISCSI_PROTOCOL_LEVEL,
    RDMA_EXTENSIONS,
    INITIATOR_RECV_DATA_SEGMENT_LENGTH,
    TARGET_RECV_DATA_SEGMENT_LENGTH,
    MAX_OUTSTANDING_UNEXPECTED_PDUS,
    declared("TargetName"),
    declared("InitiatorName"),
    declared("TargetAlias"),
    declared("InitiatorAlias"),
    declared("TargetAddress"),
    declared("TargetPortalGroupTag"),
    declared("SendTargets"),
];

pub fn lookup(name: &str) -> Option<&'static Key> {
    ALL.iter().find(|k| k.name == name)
}

impl Key {
    /// `value` as this key's number, if it is one and within the key's range.
    pub fn number(&self, value: &str) -> Option<u64> {
        let (lo, hi) = match self.negotiation {
            Negotiation::Number { lo, hi, .. } | Negotiation::DeclaredNumber { lo, hi, .. } => {
                (lo, hi)
            }
            _ => return None,
        };
        parse_number(value).filter(|v| (lo..=hi).contains(v))
    }

    /// The RFC default of a numerical key (0 for other kinds).
    pub const fn default_number(&self) -> u64 {
        match self.negotiation {
            Negotiation::Number { default, .. } | Negotiation::DeclaredNumber { default, .. } => {
                default
            }
            _ => 0,
        }
    }

    /// The RFC default of a boolean key (false for other kinds).
    pub const fn default_bool(&self) -> bool {
        match self.negotiation {
            Negotiation::Boolean { default, .. } => default,
            _ => false,
        }
    }

    /// Whether `answer` can be the outcome when this side offered `offered`:
    /// a minimum cannot exceed the offer, a maximum cannot be below it, an
    /// AND of No is No and an OR of Yes is Yes. Declared and listed keys
    /// have no result function to check.
    pub fn answer_fits(&self, offered: &str, answer: &str) -> bool {
        match self.negotiation {
            Negotiation::Number { result, .. } => {
                match (self.number(offered), self.number(answer)) {
                    (Some(o), Some(a)) => match result {
                        NumberResult::Minimum => a <= o,
                        NumberResult::Maximum => a >= o,
                    },
                    _ => false,
                }
            }
            Negotiation::Boolean { result, .. } => {
                match (parse_bool(offered), parse_bool(answer)) {
                    (Some(o), Some(a)) => match result {
                        BoolResult::And => o || !a,
                        BoolResult::Or => !o || a,
                    },
                    _ => false,
                }
            }
            _ => true,
        }
    }
}

/// An iSCSI numerical value (RFC 7143 6.1): decimal, or hexadecimal with a
/// 0x prefix. (Base64 numbers are for binary values, which no key here is.)
pub fn parse_number(v: &str) -> Option<u64> {
    if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    } else if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        v.parse().ok()
    } else {
        None
    }
}

pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

pub fn yes_no(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_decimal_or_hex_and_nothing_else() {
        assert_eq!(parse_number("8192"), Some(8192));
        assert_eq!(parse_number("0x10"), Some(16));
        assert_eq!(parse_number("0X1f"), Some(31));
        for bad in ["-1", "", "+5", "0x", "0x+5", "1e3", " 1"] {
            assert_eq!(parse_number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ranges_come_from_the_table() {
        assert_eq!(MAX_BURST_LENGTH.number("511"), None);
        assert_eq!(MAX_BURST_LENGTH.number("0x200"), Some(512));
        assert_eq!(MAX_BURST_LENGTH.number("16777216"), None);
        assert_eq!(DEFAULT_TIME2WAIT.number("3601"), None);
        assert_eq!(MAX_RECV_DATA_SEGMENT_LENGTH.number("262144"), Some(262_144));
        assert_eq!(HEADER_DIGEST.number("1"), None);
    }

    #[test]
    fn result_functions_bound_the_answer() {
        assert!(MAX_BURST_LENGTH.answer_fits("262144", "65536"));
        assert!(!MAX_BURST_LENGTH.answer_fits("65536", "262144"));
        assert!(DEFAULT_TIME2WAIT.answer_fits("2", "5"));
        assert!(!DEFAULT_TIME2WAIT.answer_fits("2", "1"));
        assert!(!IMMEDIATE_DATA.answer_fits("No", "Yes"));
        assert!(IMMEDIATE_DATA.answer_fits("Yes", "No"));
        assert!(!INITIAL_R2T.answer_fits("Yes", "No"));
        assert!(INITIAL_R2T.answer_fits("No", "Yes"));
        assert!(!MAX_CONNECTIONS.answer_fits("1", "x"));
    }

    #[test]
    fn every_name_is_listed_once_and_found() {
        for (i, k) in ALL.iter().enumerate() {
            assert_eq!(lookup(k.name), Some(k));
            assert!(ALL[i + 1..].iter().all(|o| o.name != k.name), "{}", k.name);
        }
        assert_eq!(lookup("X-vendor"), None);
    }

    #[test]
    fn rfc_defaults() {
        assert_eq!(MAX_BURST_LENGTH.default_number(), 262_144);
        assert_eq!(FIRST_BURST_LENGTH.default_number(), 65_536);
        assert_eq!(MAX_RECV_DATA_SEGMENT_LENGTH.default_number(), 8192);
        assert!(INITIAL_R2T.default_bool() && IMMEDIATE_DATA.default_bool());
        assert!(!RDMA_EXTENSIONS.default_bool());
    }
}
