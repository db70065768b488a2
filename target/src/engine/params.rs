//! Operational parameters and the negotiation rules of RFC 7143 section 13.

/// The values in force for a connection/session after login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment the initiator accepts: the limit for what we send.
    pub initiator_mrdsl: u32,
    /// Largest data segment we accept.
    pub target_mrdsl: u32,
    pub max_burst_len: u32,
    pub first_burst_len: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_outstanding_r2t: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    /// iSER-assisted: data moves by RDMA, digests and R2Ts are off.
    pub iser: bool,
    /// The initiator negotiated RDMAExtensions=Yes (RFC 7145, Linux); an
    /// iSER login without it follows the illumos initiator's rules.
    pub rdma_extensions: bool,
}

impl Params {
    /// RFC 7143 defaults, with our own receive limit declared.
    pub fn defaults(target_mrdsl: u32) -> Params {
        Params {
            header_digest: false,
            data_digest: false,
            initiator_mrdsl: 8192,
            target_mrdsl,
            max_burst_len: 262_144,
            first_burst_len: 65_536,
            initial_r2t: true,
            immediate_data: true,
            max_outstanding_r2t: 1,
            default_time2wait: 2,
            default_time2retain: 20,
            iser: false,
            rdma_extensions: false,
        }
    }
}

/// Parse an iSCSI numerical value: decimal, or hex with a 0x prefix.
pub fn parse_number(v: &str) -> Option<u64> {
    if let Some(hex) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
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
    fn numbers() {
        assert_eq!(parse_number("8192"), Some(8192));
        assert_eq!(parse_number("0x10"), Some(16));
        assert_eq!(parse_number("-1"), None);
        assert_eq!(parse_number(""), None);
    }
}
