//! PDU framing on a byte stream (RFC 7143 11.2): the one encoder and the one
//! deframer that the target's TCP driver and the initiator's reader share.
//!
//! A PDU on the wire is the BHS, the AHS (TotalAHSLength words), the header
//! digest, the data segment padded to 4 bytes, and the data digest. Both
//! digests cover what is on the wire: the data digest includes the padding
//! as sent (RFC 7143 11.1), so a peer that pads with non-zero bytes and
//! digests them is not taken for a corrupted one.

use super::{digest, padded, Bhs, PduLayout, WireError, BHS_LEN, MAX_DATA_SEGMENT_LEN};

/// Which digests are in force (both off during login).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Append one PDU to `out`. TotalAHSLength and DataSegmentLength are set
/// from `ahs` (zero-padded to 4 bytes) and `data`.
#[inline]
pub fn encode(
    bhs: &Bhs,
    ahs: &[u8],
    data: &[u8],
    digests: Digests,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    encode_filled(bhs, ahs, data.len(), digests, out, |dst| {
        dst.copy_from_slice(data);
        true
    })
    .map(|_| ())
}

/// Append one PDU whose `data_len` data bytes `fill` writes in place, so a
/// target can read a LUN extent straight into its send buffer. `Ok(false)`,
/// with `out` as it was, when `fill` could not produce the data.
#[inline]
pub fn encode_filled(
    bhs: &Bhs,
    ahs: &[u8],
    data_len: usize,
    digests: Digests,
    out: &mut Vec<u8>,
    fill: impl FnOnce(&mut [u8]) -> bool,
) -> Result<bool, WireError> {
    if data_len > MAX_DATA_SEGMENT_LEN as usize {
        return Err(WireError::DataSegmentTooLong {
            len: data_len.min(u32::MAX as usize) as u32,
            limit: MAX_DATA_SEGMENT_LEN,
        });
    }
    let ahs_padded = padded(ahs.len());
    let Ok(ahs_words) = u8::try_from(ahs_padded / 4) else {
        return Err(WireError::AhsLength {
            declared: ahs_padded,
            available: u8::MAX as usize * 4,
        });
    };
    let mut b = *bhs;
    b.set_lengths(ahs_words, data_len as u32);
    let start = out.len();
    out.extend_from_slice(b.as_bytes());
    if !ahs.is_empty() {
        out.extend_from_slice(ahs);
        out.resize(start + BHS_LEN + ahs_padded, 0);
    }
    if digests.header {
        let d = digest::header(&out[start..start + BHS_LEN], &out[start + BHS_LEN..]);
        out.extend_from_slice(&digest::to_wire(d));
    }
    if data_len == 0 {
        return Ok(true);
    }
    let data_start = out.len();
    out.resize(data_start + padded(data_len), 0);
    if !fill(&mut out[data_start..data_start + data_len]) {
        out.truncate(start);
        return Ok(false);
    }
    if digests.data {
        let d = digest::data(&out[data_start..]);
        out.extend_from_slice(&digest::to_wire(d));
    }
    Ok(true)
}

/// What the receiver insists on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxRules {
    pub digests: Digests,
    /// Largest data segment accepted: this side's MaxRecvDataSegmentLength.
    pub max_data_len: u32,
}

/// One PDU found at the start of a buffer. The header is taken as it came,
/// opcode unchecked: whether an unknown opcode is an error is the caller's
/// protocol decision, not framing's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    pub bhs: Bhs,
    /// The AHS area, without the header digest.
    pub ahs: &'a [u8],
    /// The data segment, without padding or digest.
    pub data: &'a [u8],
    /// False when the data digest did not match: the header is sound, so the
    /// stream goes on (RFC 7143 7.8) and only this PDU's data is lost.
    pub data_digest_ok: bool,
    /// Bytes the PDU takes in the buffer.
    pub wire_len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deframed<'a> {
    Pdu(Frame<'a>),
    /// Not a whole PDU yet: the buffer must hold at least `need` bytes.
    Incomplete {
        need: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeframeError {
    /// The lengths can no longer be trusted, so the stream is lost.
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data segment of {len} bytes exceeds MaxRecvDataSegmentLength {limit}")]
    Oversized { bhs: Bhs, len: u32, limit: u32 },
}

/// Find the PDU at the start of `buf`.
#[inline]
pub fn deframe(buf: &[u8], rules: RxRules) -> Result<Deframed<'_>, DeframeError> {
    let Some(header) = buf.get(..BHS_LEN) else {
        return Ok(Deframed::Incomplete { need: BHS_LEN });
    };
    let mut raw = [0; BHS_LEN];
    raw.copy_from_slice(header);
    let bhs = Bhs::from_raw(raw);
    let len = bhs.data_segment_len();
    if len > rules.max_data_len {
        return Err(DeframeError::Oversized {
            bhs,
            len,
            limit: rules.max_data_len,
        });
    }
    let layout = PduLayout::of(&bhs, rules.digests.header, rules.digests.data);
    let header_len = BHS_LEN + layout.header_rest();
    let total = header_len + layout.data_wire_len();
    let Some(pdu) = buf.get(..total) else {
        return Ok(Deframed::Incomplete { need: total });
    };
    let ahs_end = BHS_LEN + layout.ahs_len;
    let ahs = &pdu[BHS_LEN..ahs_end];
    if layout.header_digest
        && wire_digest(&pdu[ahs_end..header_len]) != digest::header(&pdu[..BHS_LEN], ahs)
    {
        return Err(DeframeError::HeaderDigest);
    }
    let padded_end = header_len + padded(layout.data_len);
    let data_digest_ok = !layout.data_digest
        || layout.data_len == 0
        || wire_digest(&pdu[padded_end..total]) == digest::data(&pdu[header_len..padded_end]);
    Ok(Deframed::Pdu(Frame {
        bhs,
        ahs,
        data: &pdu[header_len..header_len + layout.data_len],
        data_digest_ok,
        wire_len: total,
    }))
}

fn wire_digest(four: &[u8]) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(four);
    digest::from_wire(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iscsi::Opcode;
    use proptest::prelude::*;

    const BOTH: Digests = Digests {
        header: true,
        data: true,
    };

    fn rules(digests: Digests) -> RxRules {
        RxRules {
            digests,
            max_data_len: 1 << 20,
        }
    }

    fn pdu(data: &[u8], digests: Digests) -> Vec<u8> {
        let mut b = Bhs::new(Opcode::NopOut);
        b.set_itt(5);
        let mut out = Vec::new();
        encode(&b, &[1, 2, 3, 4, 5], data, digests, &mut out).unwrap();
        out
    }

    #[test]
    fn a_pdu_is_incomplete_until_its_last_digest_byte() {
        let wire = pdu(b"hello", BOTH);
        assert_eq!(wire.len(), 48 + 8 + 4 + 8 + 4);
        for cut in 0..wire.len() {
            let need = match deframe(&wire[..cut], rules(BOTH)) {
                Ok(Deframed::Incomplete { need }) => need,
                other => panic!("{cut} bytes: {other:?}"),
            };
            assert!(need > cut);
        }
        let Ok(Deframed::Pdu(f)) = deframe(&wire, rules(BOTH)) else {
            panic!("whole PDU not found");
        };
        assert_eq!(
            (f.ahs, f.data, f.wire_len),
            (&[1, 2, 3, 4, 5, 0, 0, 0][..], &b"hello"[..], wire.len())
        );
        assert!(f.data_digest_ok);
    }

    #[test]
    fn the_data_digest_covers_the_padding_as_sent() {
        let mut wire = pdu(b"hello", BOTH);
        // Non-zero padding with a digest over it, as a peer may send.
        let pad = 48 + 8 + 4 + 5;
        wire[pad..pad + 3].copy_from_slice(&[7, 7, 7]);
        let d = digest::to_wire(digest::data(&wire[60..68]));
        wire[68..72].copy_from_slice(&d);
        let Ok(Deframed::Pdu(f)) = deframe(&wire, rules(BOTH)) else {
            panic!("not found");
        };
        assert!(f.data_digest_ok);
        assert_eq!(f.data, b"hello");
        // The same padding under the zero-padding digest is a mismatch.
        let zero = pdu(b"hello", BOTH);
        wire[68..72].copy_from_slice(&zero[68..72]);
        let Ok(Deframed::Pdu(f)) = deframe(&wire, rules(BOTH)) else {
            panic!("not found");
        };
        assert!(!f.data_digest_ok);
    }

    #[test]
    fn a_bad_header_digest_loses_the_stream_and_a_long_segment_is_refused() {
        let mut wire = pdu(b"x", BOTH);
        wire[16] ^= 1;
        assert_eq!(deframe(&wire, rules(BOTH)), Err(DeframeError::HeaderDigest));
        let wire = pdu(&[0; 600], Digests::default());
        let tight = RxRules {
            digests: Digests::default(),
            max_data_len: 512,
        };
        assert!(matches!(
            deframe(&wire, tight),
            Err(DeframeError::Oversized {
                len: 600,
                limit: 512,
                ..
            })
        ));
    }

    #[test]
    fn a_failed_fill_leaves_the_buffer_as_it_was() {
        let mut out = vec![9; 10];
        let b = Bhs::new(Opcode::DataIn);
        assert_eq!(
            encode_filled(&b, &[], 4096, BOTH, &mut out, |_| false),
            Ok(false)
        );
        assert_eq!(out, vec![9; 10]);
    }

    proptest! {
        #[test]
        fn what_is_encoded_deframes_to_itself(
            ahs in proptest::collection::vec(any::<u8>(), 0..40),
            data in proptest::collection::vec(any::<u8>(), 0..300),
            header: bool,
            data_digest: bool,
        ) {
            let digests = Digests { header, data: data_digest };
            let mut b = Bhs::new(Opcode::ScsiCommand);
            b.set_itt(3);
            let mut wire = Vec::new();
            encode(&b, &ahs, &data, digests, &mut wire).unwrap();
            wire.extend_from_slice(&[0xee; 7]);
            let Ok(Deframed::Pdu(f)) = deframe(&wire, rules(digests)) else {
                panic!("not found");
            };
            prop_assert_eq!(f.wire_len, wire.len() - 7);
            prop_assert_eq!(f.data, &data[..]);
            prop_assert_eq!(&f.ahs[..ahs.len()], &ahs[..]);
            prop_assert!(f.data_digest_ok);
            prop_assert_eq!(f.bhs.itt(), 3);
        }

        #[test]
        fn deframing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), header: bool, data: bool) {
            let _ = deframe(&bytes, rules(Digests { header, data }));
        }
    }
}
