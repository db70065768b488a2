//! Text key=value pairs carried by Login and Text PDUs (RFC 7143 6.1).

use thiserror::Error;

/// RFC 7143 6.1: key names are at most 63 bytes.
pub const MAX_KEY_LEN: usize = 63;
/// Longest value accepted at all; per-key limits are the engine's business.
/// (CHAP challenges and responses in hex are the longest legitimate values.)
pub const MAX_VALUE_LEN: usize = 8192;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TextError {
    #[error("text pair at byte {0} has no '='")]
    MissingEquals(usize),
    #[error("empty key at byte {0}")]
    EmptyKey(usize),
    #[error("key at byte {0} is longer than 63 bytes")]
    KeyTooLong(usize),
    #[error("value at byte {0} is longer than {MAX_VALUE_LEN} bytes")]
    ValueTooLong(usize),
    #[error("text at byte {0} is not UTF-8")]
    NotUtf8(usize),
}

/// One borrowed key=value pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair<'a> {
    pub key: &'a str,
    pub value: &'a str,
}

/// Decode every pair of a (reassembled) text data segment. A missing final NUL
/// is tolerated; NUL padding between pairs is skipped.
pub fn decode(data: &[u8]) -> Result<Vec<Pair<'_>>, TextError> {
    let mut pairs = Vec::new();
    let mut off = 0;
    for raw in data.split(|b| *b == 0) {
        let start = off;
        off += raw.len() + 1;
        if raw.is_empty() {
            continue;
        }
        let text = std::str::from_utf8(raw).map_err(|_| TextError::NotUtf8(start))?;
        let (key, value) = text
            .split_once('=')
            .ok_or(TextError::MissingEquals(start))?;
        if key.is_empty() {
            return Err(TextError::EmptyKey(start));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(TextError::KeyTooLong(start));
        }
        if value.len() > MAX_VALUE_LEN {
            return Err(TextError::ValueTooLong(start));
        }
        pairs.push(Pair { key, value });
    }
    Ok(pairs)
}

/// Append `key=value\0`.
pub fn encode_pair(out: &mut Vec<u8>, key: &str, value: &str) {
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value.as_bytes());
    out.push(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_pairs() {
        let p = decode(b"A=1\0B=x=y\0\0").unwrap();
        assert_eq!(
            p,
            vec![
                Pair {
                    key: "A",
                    value: "1"
                },
                Pair {
                    key: "B",
                    value: "x=y"
                }
            ]
        );
        assert_eq!(decode(b"A=1\0B\0"), Err(TextError::MissingEquals(4)));
        assert_eq!(decode(b"=1\0"), Err(TextError::EmptyKey(0)));
        let long = format!("{}=1", "k".repeat(64));
        assert_eq!(decode(long.as_bytes()), Err(TextError::KeyTooLong(0)));
    }

    proptest! {
        #[test]
        fn round_trip(pairs in proptest::collection::vec(("[A-Za-z0-9.:_-]{1,63}", "[ -~]{0,300}"), 0..8)) {
            let mut buf = Vec::new();
            for (k, v) in &pairs { encode_pair(&mut buf, k, v); }
            let d = decode(&buf).unwrap();
            prop_assert_eq!(d.len(), pairs.len());
            for (p, (k, v)) in d.iter().zip(&pairs) {
                prop_assert_eq!(p.key, k.as_str());
                prop_assert_eq!(p.value, v.as_str());
            }
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }
    }
}
