//! iSER (RFC 7145, IB layout) wire format: the 28-byte header that precedes
//! every SEND, Hello/HelloReply, and the rdma_cm private data of a connect
//! request.
//!
//! The header layout is the IB "expanded" one that both the Linux (`struct
//! iser_ctrl`) and illumos (`iser_ctrl_hdr_t`) initiators use; it is not RFC
//! 5046's 12-byte iWARP header.

use thiserror::Error;

use crate::iscsi::{padded, Bhs, BHS_LEN, MAX_DATA_SEGMENT_LEN};

/// Bytes of the iSER header in front of every iSCSI control PDU.
pub const HEADER_LEN: usize = 28;

/// Opcodes in the high nibble of byte 0.
pub mod opcode {
    pub const CONTROL: u8 = 0x1;
    pub const HELLO: u8 = 0x2;
    pub const HELLO_REPLY: u8 = 0x3;
}

/// Byte 0 flag: the write STag/VA fields are valid.
pub const WSV: u8 = 0x08;
/// Byte 0 flag: the read STag/VA fields are valid.
pub const RSV: u8 = 0x04;

/// The iSER protocol version we speak (RFC 7145: 1).
pub const VERSION: u8 = 1;

/// What the two iSER initiators ramslog serves can take, from their sources
/// (docs/iser-compat.md). Target, userspace initiator and tests size their
/// buffers and limits from these.
pub mod peer {
    use super::HEADER_LEN;
    use crate::iscsi::BHS_LEN;

    /// Data room of Linux ib_iser's full-feature receive buffers
    /// (`ISER_RECV_DATA_SEG_LEN`): nothing longer may be sent to it after login.
    pub const LINUX_FULL_FEATURE_RECV_DATA: u32 = 128;
    /// Data room of Linux ib_iser's login receive buffer.
    pub const LINUX_LOGIN_RECV_DATA: usize = 8192;
    /// illumos receives every message into a fixed 16 KiB buffer
    /// (`ISER_MAX_CTRLPDU_LEN`): iSER header, BHS and data together.
    pub const ILLUMOS_MSG_LEN: usize = 16 * 1024;
    /// The largest data segment an illumos initiator can receive.
    pub const ILLUMOS_MAX_RECV_DATA: u32 = (ILLUMOS_MSG_LEN - HEADER_LEN - BHS_LEN) as u32;
    /// RDMA READs illumos lets a target have in flight
    /// (`iser_ib_open_rc_channel`: responder resources and initiator depth 4).
    pub const ILLUMOS_RDMA_READ_CREDITS: u8 = 4;
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum IserError {
    #[error("iSER message of {0} bytes is shorter than the 28-byte header")]
    Short(usize),
    #[error("unknown iSER opcode {0:#x}")]
    UnknownOpcode(u8),
    #[error("output buffer of {0} bytes is too small")]
    BufTooSmall(usize),
    #[error("{0}-byte message holds no iSCSI header")]
    NoPdu(usize),
    #[error(
        "a {msg_len}-byte message carries a PDU of {pdu_len} bytes (opcode {opcode:#04x}; \
         iSER sends one PDU per message, its data at most padded to 4 bytes)"
    )]
    PduLength {
        msg_len: usize,
        pdu_len: usize,
        opcode: u8,
    },
    #[error("data segment of {len} bytes exceeds the {limit} this side receives")]
    Oversized { bhs: Bhs, len: u32, limit: u32 },
    #[error("a {len}-byte message exceeds the {room}-byte buffer it must fit")]
    MessageTooLong { len: usize, room: usize },
    #[error("the PDU's data could not be produced")]
    DataUnavailable,
}

/// A tagged buffer on the peer: the target RDMA-reads or -writes at `va + offset`.
///
/// For a write, `va` is the address of the first byte that was *not* sent
/// unsolicited (RFC 7145 9.2): Linux ib_iser sets it to buffer start +
/// immediate/unsolicited length (`iser_prepare_write_cmd`), and illumos, which
/// negotiates no unsolicited data with us, to the buffer start. For a read it
/// is the buffer start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuffer {
    pub stag: u32,
    pub va: u64,
}

impl RemoteBuffer {
    /// The address `offset` bytes into the buffer, or `None` on overflow.
    pub fn at(&self, offset: u64) -> Option<u64> {
        self.va.checked_add(offset)
    }
}

/// A decoded iSER header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// An iSCSI control PDU follows; the buffers are set on SCSI commands.
    Control {
        write: Option<RemoteBuffer>,
        read: Option<RemoteBuffer>,
    },
    Hello {
        max_ver: u8,
        min_ver: u8,
        ird: u16,
    },
    HelloReply {
        reject: bool,
        max_ver: u8,
        cur_ver: u8,
        ord: u16,
    },
}

#[inline]
fn be32(b: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
fn be64(b: &[u8; HEADER_LEN], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

impl Header {
    /// Decode the header at the start of a received message; the iSCSI PDU
    /// (for `Control`) starts at [`HEADER_LEN`].
    #[inline]
    pub fn decode(msg: &[u8]) -> Result<Header, IserError> {
        let Some(b) = msg.first_chunk::<HEADER_LEN>() else {
            return Err(IserError::Short(msg.len()));
        };
        match b[0] >> 4 {
            opcode::CONTROL => {
                let write = (b[0] & WSV != 0).then(|| RemoteBuffer {
                    stag: be32(b, 4),
                    va: be64(b, 8),
                });
                let read = (b[0] & RSV != 0).then(|| RemoteBuffer {
                    stag: be32(b, 16),
                    va: be64(b, 20),
                });
                Ok(Header::Control { write, read })
            }
            opcode::HELLO => Ok(Header::Hello {
                max_ver: b[1] >> 4,
                min_ver: b[1] & 0x0f,
                ird: u16::from_be_bytes([b[2], b[3]]),
            }),
            opcode::HELLO_REPLY => Ok(Header::HelloReply {
                reject: b[0] & 0x01 != 0,
                max_ver: b[1] >> 4,
                cur_ver: b[1] & 0x0f,
                ord: u16::from_be_bytes([b[2], b[3]]),
            }),
            op => Err(IserError::UnknownOpcode(op)),
        }
    }

    /// Encode into the first [`HEADER_LEN`] bytes of `out`; returns the length written.
    #[inline]
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, IserError> {
        let len = out.len();
        let Some(b) = out.get_mut(..HEADER_LEN) else {
            return Err(IserError::BufTooSmall(len));
        };
        b.fill(0);
        match *self {
            Header::Control { write, read } => {
                b[0] = opcode::CONTROL << 4;
                if let Some(w) = write {
                    b[0] |= WSV;
                    b[4..8].copy_from_slice(&w.stag.to_be_bytes());
                    b[8..16].copy_from_slice(&w.va.to_be_bytes());
                }
                if let Some(r) = read {
                    b[0] |= RSV;
                    b[16..20].copy_from_slice(&r.stag.to_be_bytes());
                    b[20..28].copy_from_slice(&r.va.to_be_bytes());
                }
            }
            Header::Hello {
                max_ver,
                min_ver,
                ird,
            } => {
                b[0] = opcode::HELLO << 4;
                b[1] = (max_ver << 4) | (min_ver & 0x0f);
                b[2..4].copy_from_slice(&ird.to_be_bytes());
            }
            Header::HelloReply {
                reject,
                max_ver,
                cur_ver,
                ord,
            } => {
                b[0] = (opcode::HELLO_REPLY << 4) | u8::from(reject);
                b[1] = (max_ver << 4) | (cur_ver & 0x0f);
                b[2..4].copy_from_slice(&ord.to_be_bytes());
            }
        }
        Ok(HEADER_LEN)
    }

    /// The header of a PDU without tagged buffers (everything the target sends).
    pub const PLAIN: Header = Header::Control {
        write: None,
        read: None,
    };
}

/// Bytes of the iSER header and the BHS that start every control message.
pub const HEADERS_LEN: usize = HEADER_LEN + BHS_LEN;

/// An iSCSI PDU behind a control header. The BHS is taken as it came,
/// opcode unchecked: a target answers an unknown opcode with a Reject, an
/// initiator refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlPdu<'a> {
    pub write: Option<RemoteBuffer>,
    pub read: Option<RemoteBuffer>,
    pub bhs: Bhs,
    pub ahs: &'a [u8],
    /// The data segment, without any padding.
    pub data: &'a [u8],
}

/// One received SEND.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    Pdu(ControlPdu<'a>),
    /// A Hello or a HelloReply: no PDU follows.
    Handshake(Header),
}

impl Message<'_> {
    /// Take a received SEND apart. The one rule for both sides: a message
    /// holds exactly one PDU, its data segment followed by nothing, or by
    /// its iSCSI padding to 4 bytes (LIO's isert sends that; Linux ib_iser
    /// and illumos send the data unpadded). A data segment longer than
    /// `max_data_len`, this side's MaxRecvDataSegmentLength, is reported
    /// with its header so a target can answer it.
    #[inline]
    pub fn parse(msg: &[u8], max_data_len: u32) -> Result<Message<'_>, IserError> {
        let (write, read) = match Header::decode(msg)? {
            Header::Control { write, read } => (write, read),
            handshake => return Ok(Message::Handshake(handshake)),
        };
        let Some(raw) = msg
            .get(HEADER_LEN..)
            .and_then(|pdu| pdu.first_chunk::<BHS_LEN>())
        else {
            return Err(IserError::NoPdu(msg.len()));
        };
        let bhs = Bhs::from_raw(*raw);
        let len = bhs.data_segment_len();
        if len > max_data_len {
            return Err(IserError::Oversized {
                bhs,
                len,
                limit: max_data_len,
            });
        }
        let data_start = HEADERS_LEN + bhs.total_ahs_len();
        let pdu_len = data_start + len as usize;
        if msg.len() < pdu_len || msg.len() > padded(pdu_len) {
            return Err(IserError::PduLength {
                msg_len: msg.len(),
                pdu_len,
                opcode: bhs.raw_opcode(),
            });
        }
        Ok(Message::Pdu(ControlPdu {
            write,
            read,
            bhs,
            ahs: &msg[HEADERS_LEN..data_start],
            data: &msg[data_start..pdu_len],
        }))
    }
}

/// Write one control message into `out`: the iSER header, the BHS with
/// TotalAHSLength 0 and DataSegmentLength `data_len`, and the data
/// unpadded, which `fill` writes in place (a target reads a LUN extent
/// straight into its send buffer). Returns the message length.
#[inline]
pub fn encode_message(
    header: &Header,
    bhs: &Bhs,
    data_len: usize,
    out: &mut [u8],
    fill: impl FnOnce(&mut [u8]) -> bool,
) -> Result<usize, IserError> {
    let len = HEADERS_LEN + data_len;
    let room = out.len();
    let Some(msg) = out
        .get_mut(..len)
        .filter(|_| data_len <= MAX_DATA_SEGMENT_LEN as usize)
    else {
        return Err(IserError::MessageTooLong { len, room });
    };
    header.encode_into(msg)?;
    let mut b = *bhs;
    // The message holds no AHS.
    b.set_lengths(0, data_len as u32);
    msg[HEADER_LEN..HEADERS_LEN].copy_from_slice(b.as_bytes());
    if !fill(&mut msg[HEADERS_LEN..]) {
        return Err(IserError::DataUnavailable);
    }
    Ok(len)
}

/// Which initiator family the connect request's private data looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmPeer {
    /// Linux ib_iser / RFC 7145: `iser_cm_hdr`, flags in byte 0.
    Linux,
    /// illumos: its `sie`/`zbvae` bit-field lands in byte 3 (0xC0) on x86;
    /// the bytes after it are uninitialised and mean nothing.
    Illumos,
    /// Nothing recognisable (no private data, or other bits).
    Unknown,
}

/// The iSER part of a connect request's private data, after rdma_cm stripped
/// its own IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmRequest {
    pub peer: CmPeer,
    /// The initiator cannot take zero-based virtual addresses (all do: we
    /// always use the absolute address it sends).
    pub zbva_not_supported: bool,
    /// The initiator cannot take Send-with-Invalidate (we never use it).
    pub send_inv_not_supported: bool,
}

/// Linux `ISER_ZBVA_NOT_SUP`.
pub const CM_ZBVA_NOT_SUPPORTED: u8 = 0x80;
/// Linux `ISER_SEND_W_INV_NOT_SUP`.
pub const CM_SEND_INV_NOT_SUPPORTED: u8 = 0x40;

impl CmRequest {
    /// Never fails: private data is advisory, and the target behaves the same
    /// for every peer (absolute VAs, plain SEND).
    pub fn parse(private: &[u8]) -> CmRequest {
        let byte = |i: usize| private.get(i).copied().unwrap_or(0);
        let (b0, b3) = (byte(0), byte(3));
        if b0 == 0 && b3 & 0xC0 != 0 && b3 & 0x3F == 0 {
            // illumos: {rsvd1:30, sie:1, zbvae:1} as a little-endian bit-field
            // puts sie in bit 6 and zbvae in bit 7 of byte 3.
            return CmRequest {
                peer: CmPeer::Illumos,
                zbva_not_supported: b3 & 0x80 != 0,
                send_inv_not_supported: b3 & 0x40 != 0,
            };
        }
        let peer = if private.len() >= 4
            && b0 & !(CM_ZBVA_NOT_SUPPORTED | CM_SEND_INV_NOT_SUPPORTED) == 0
            && b0 != 0
        {
            CmPeer::Linux
        } else {
            CmPeer::Unknown
        };
        CmRequest {
            peer,
            zbva_not_supported: b0 & CM_ZBVA_NOT_SUPPORTED != 0,
            send_inv_not_supported: b0 & CM_SEND_INV_NOT_SUPPORTED != 0,
        }
    }
}

/// The private data an initiator sends with its connect request, as Linux
/// ib_iser does: we never use zero-based VAs and never ask for Send-with-Invalidate.
pub const LINUX_CM_PRIVATE_DATA: [u8; 4] =
    [CM_ZBVA_NOT_SUPPORTED | CM_SEND_INV_NOT_SUPPORTED, 0, 0, 0];

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_header_layout_matches_linux_iser_ctrl() {
        let h = Header::Control {
            write: Some(RemoteBuffer {
                stag: 0x1122_3344,
                va: 0x0102_0304_0506_0708,
            }),
            read: None,
        };
        let mut b = [0xAAu8; 28];
        assert_eq!(h.encode_into(&mut b), Ok(28));
        assert_eq!(b[0], 0x18);
        assert_eq!(&b[1..4], &[0, 0, 0]);
        assert_eq!(&b[4..8], &[0x11, 0x22, 0x33, 0x44]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..28], &[0; 12]);
        assert_eq!(Header::decode(&b), Ok(h));
    }

    #[test]
    fn plain_control_header_is_0x10() {
        let mut b = [0u8; 28];
        Header::PLAIN.encode_into(&mut b).unwrap();
        assert_eq!(b[0], 0x10);
    }

    #[test]
    fn short_and_unknown_are_errors() {
        assert_eq!(Header::decode(&[0x10; 27]), Err(IserError::Short(27)));
        assert_eq!(
            Header::decode(&[0x40; 28]),
            Err(IserError::UnknownOpcode(4))
        );
        assert_eq!(
            Header::PLAIN.encode_into(&mut [0u8; 10]),
            Err(IserError::BufTooSmall(10))
        );
    }

    #[test]
    fn hello_reply() {
        let r = Header::HelloReply {
            reject: false,
            max_ver: 1,
            cur_ver: 1,
            ord: 4,
        };
        let mut b = [0u8; 28];
        r.encode_into(&mut b).unwrap();
        assert_eq!(&b[..4], &[0x30, 0x11, 0, 4]);
        assert_eq!(Header::decode(&b), Ok(r));
    }

    #[test]
    fn cm_private_data_linux_and_illumos() {
        let mut linux = [0u8; 56];
        linux[0] = 0x80;
        let l = CmRequest::parse(&linux);
        assert_eq!(l.peer, CmPeer::Linux);
        assert!(l.zbva_not_supported && !l.send_inv_not_supported);

        // illumos: byte 3 = 0xC0, bytes 4.. uninitialised garbage.
        let mut illumos = [0xEEu8; 56];
        illumos[..4].copy_from_slice(&[0, 0, 0, 0xC0]);
        let i = CmRequest::parse(&illumos);
        assert_eq!(i.peer, CmPeer::Illumos);
        assert!(i.zbva_not_supported && i.send_inv_not_supported);

        assert_eq!(CmRequest::parse(&[]).peer, CmPeer::Unknown);
        assert_eq!(CmRequest::parse(&[0xff; 56]).peer, CmPeer::Unknown);
    }

    fn message(data: &[u8], extra: &[u8]) -> Vec<u8> {
        let mut b = Bhs::new(crate::iscsi::Opcode::NopOut);
        b.set_itt(4);
        let mut out = vec![0; HEADERS_LEN + data.len()];
        let n = encode_message(&Header::PLAIN, &b, data.len(), &mut out, |dst| {
            dst.copy_from_slice(data);
            true
        })
        .unwrap();
        assert_eq!(n, out.len());
        out.extend_from_slice(extra);
        out
    }

    #[test]
    fn a_message_is_one_pdu_with_at_most_its_padding() {
        for extra in [&[][..], &[0], &[0, 0, 0]] {
            let msg = message(b"hello", extra);
            let Ok(Message::Pdu(p)) = Message::parse(&msg, 8192) else {
                panic!("{extra:?}: not a PDU");
            };
            assert_eq!((p.data, p.bhs.itt()), (&b"hello"[..], 4));
        }
        let long = message(b"hello", &[0; 4]);
        assert!(matches!(
            Message::parse(&long, 8192),
            Err(IserError::PduLength {
                msg_len: 85,
                pdu_len: 81,
                ..
            })
        ));
        let short = message(b"hello", &[]);
        assert!(matches!(
            Message::parse(&short[..short.len() - 1], 8192),
            Err(IserError::PduLength { .. })
        ));
        assert_eq!(
            Message::parse(&short[..40], 8192),
            Err(IserError::NoPdu(40))
        );
        assert!(matches!(
            Message::parse(&short, 4),
            Err(IserError::Oversized {
                len: 5,
                limit: 4,
                ..
            })
        ));
    }

    #[test]
    fn a_message_that_does_not_fit_or_cannot_be_filled_is_an_error() {
        let b = Bhs::new(crate::iscsi::Opcode::DataIn);
        let mut out = [0; 100];
        assert_eq!(
            encode_message(&Header::PLAIN, &b, 40, &mut out, |_| true),
            Err(IserError::MessageTooLong {
                len: 116,
                room: 100
            })
        );
        assert_eq!(
            encode_message(&Header::PLAIN, &b, 4, &mut out, |_| false),
            Err(IserError::DataUnavailable)
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(msg in proptest::collection::vec(any::<u8>(), 0..160), limit: u32) {
            let _ = Message::parse(&msg, limit);
        }

        #[test]
        fn decode_never_panics_and_round_trips(msg in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(h) = Header::decode(&msg) {
                let mut b = [0u8; HEADER_LEN];
                h.encode_into(&mut b).unwrap();
                prop_assert_eq!(Header::decode(&b), Ok(h));
            }
            let _ = CmRequest::parse(&msg);
        }
    }
}
