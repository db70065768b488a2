//! CHAP (RFC 1994) as iSCSI uses it (RFC 7143 12.1.3): MD5 only (CHAP_A=5),
//! binary values as `0x` hex or `0b` base64.

use md5::{Digest as _, Md5};

use crate::Error;

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
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Decode a binary value: `0x`/`0X` hex (odd length allowed, RFC 7143 6.1) or
/// `0b`/`0B` base64.
pub fn decode_binary(s: &str) -> Result<Vec<u8>, Error> {
    let bad = || Error::proto(format!("bad CHAP binary value {s:?}"));
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        if hex.is_empty() {
            return Err(bad());
        }
        let digits: Vec<u8> = hex
            .chars()
            .map(|c| c.to_digit(16).map(|d| d as u8))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        let mut out = Vec::with_capacity(digits.len().div_ceil(2));
        let mut iter = digits.iter();
        if digits.len() % 2 == 1 {
            out.push(*iter.next().ok_or_else(bad)?);
        }
        while let (Some(h), Some(l)) = (iter.next(), iter.next()) {
            out.push(h << 4 | l);
        }
        Ok(out)
    } else if let Some(b64) = s.strip_prefix("0b").or_else(|| s.strip_prefix("0B")) {
        decode_base64(b64).ok_or_else(bad)
    } else {
        Err(bad())
    }
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let body = s.trim_end_matches('=');
    if body.is_empty() || s.len() - body.len() > 2 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in body.bytes() {
        acc = (acc << 6) | val(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Parse a CHAP_I value (decimal, or 0x hex), which must fit in one byte.
pub fn parse_identifier(s: &str) -> Result<u8, Error> {
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u32::from_str_radix(h, 16).ok()
    } else {
        s.parse::<u32>().ok()
    };
    v.and_then(|v| u8::try_from(v).ok())
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
