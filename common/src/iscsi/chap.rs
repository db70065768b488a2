//! CHAP (RFC 1994) as iSCSI uses it (RFC 7143 12.1.3): MD5 only (CHAP_A=5),
//! binary values as `0x` hex or `0b` base64. Shared by target and initiator.

use md5::{Digest as _, Md5};

/// The only algorithm iSCSI requires: CHAP_A=5 (MD5).
pub const ALGORITHM_MD5: &str = "5";

/// CHAP response: MD5(identifier || secret || challenge).
pub fn response(id: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut h = Md5::new();
    h.update([id]);
    h.update(secret);
    h.update(challenge);
    h.finalize().into()
}

/// Encode binary as `0x` followed by lower-case hex.
pub fn encode_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Decode a binary value: `0x`/`0X` hex (an odd digit count is allowed,
/// RFC 7143 6.1) or `0b`/`0B` base64. `None` when malformed or empty.
pub fn decode_binary(s: &str) -> Option<Vec<u8>> {
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        let digits: Vec<u8> = hex
            .chars()
            .map(|c| c.to_digit(16).map(|d| d as u8))
            .collect::<Option<_>>()?;
        let mut out = Vec::with_capacity(digits.len().div_ceil(2));
        let (head, rest) = digits.split_at(digits.len() % 2);
        out.extend_from_slice(head);
        out.extend(rest.chunks_exact(2).map(|p| (p[0] << 4) | p[1]));
        (!out.is_empty()).then_some(out)
    } else if let Some(b64) = s.strip_prefix("0b").or_else(|| s.strip_prefix("0B")) {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .ok()
            .filter(|b| !b.is_empty())
    } else {
        None
    }
}

/// Parse a CHAP_I value (decimal, or 0x hex), which must fit in one byte.
pub fn parse_identifier(s: &str) -> Option<u8> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16).ok(),
        None => s.parse::<u32>().ok(),
    };
    v.and_then(|v| u8::try_from(v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_answer_and_forms() {
        // md5(b"\x01" b"secret" b"\x01\x02\x03"), computed independently.
        assert_eq!(
            encode_hex(&response(1, b"secret", &[1, 2, 3])),
            "0x9067fecf94f4c5654f2d992d9b7ce3fd"
        );
        assert_eq!(decode_binary("0x0aFF"), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(decode_binary("0x"), None);
        assert_eq!(decode_binary("abc"), None);
        assert_eq!(parse_identifier("255"), Some(255));
        assert_eq!(parse_identifier("0x1f"), Some(31));
        assert_eq!(parse_identifier("256"), None);
    }

    proptest! {
        #[test]
        fn hex_round_trip(bytes in proptest::collection::vec(any::<u8>(), 1..64)) {
            prop_assert_eq!(decode_binary(&encode_hex(&bytes)), Some(bytes));
        }
    }
}
