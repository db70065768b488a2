//! CHAP for the initiator: the shared codec in ramslog-common, with this
//! crate's errors.

pub use ramslog_common::iscsi::chap::{encode_hex, response};

use crate::Error;

/// Decode a `0x` hex or `0b` base64 binary value from the target.
pub fn decode_binary(s: &str) -> Result<Vec<u8>, Error> {
    ramslog_common::iscsi::chap::decode_binary(s)
        .ok_or_else(|| Error::proto(format!("bad CHAP binary value {s:?}")))
}

/// Parse a CHAP_I value, which must fit in one byte.
pub fn parse_identifier(s: &str) -> Result<u8, Error> {
    ramslog_common::iscsi::chap::parse_identifier(s)
        .ok_or_else(|| Error::proto(format!("bad CHAP_I {s:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_vector() {
        // python3: hashlib.md5(bytes([0x2a]) + b"s3cr3t-secret" + bytes(range(16))).hexdigest()
        let r = response(0x2a, b"s3cr3t-secret", &(0u8..16).collect::<Vec<_>>());
        assert_eq!(encode_hex(&r), "0xc1359807704b0165426668a7334319a6");
    }

    #[test]
    fn binary_forms() {
        assert_eq!(decode_binary("0x0a0B").unwrap(), vec![0x0a, 0x0b]);
        assert_eq!(decode_binary("0xabc").unwrap(), vec![0x0a, 0xbc]);
        assert_eq!(decode_binary("0bAQID").unwrap(), vec![1, 2, 3]);
        assert_eq!(decode_binary("0bAQI=").unwrap(), vec![1, 2]);
        assert!(decode_binary("0x").is_err());
        assert!(decode_binary("0xzz").is_err());
        assert!(decode_binary("abcd").is_err());
        assert!(decode_binary("0b!!").is_err());
        assert_eq!(parse_identifier("42").unwrap(), 42);
        assert_eq!(parse_identifier("0xff").unwrap(), 255);
        assert!(parse_identifier("256").is_err());
    }
}
