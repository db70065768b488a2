//! What the floor client and floor-server say to each other.
//!
//! Every message starts with a 48-byte [`Frame`] header, the size of an
//! iSCSI BHS. Over TCP a request is the header plus `data_len` bytes, the
//! answer a bare header: the shape of a SCSI WRITE with immediate data and
//! its response. Over RDMA each SEND carries [`ISER_LEN`] bytes standing in
//! for the iSER header in front of the frame header ([`RDMA_HDR_LEN`] = 76
//! bytes in all), as an iSER SEND does in front of its BHS.
//!
//! The RDMA connection carries a [`Hello`] in the CM connect private data
//! (the block size, so the server sizes its receive buffers) and an
//! [`Accept`] in the accept private data (the server buffers the client
//! RDMA-READs and RDMA-WRITEs). The CM pads private data with zeros to its
//! fixed size, so those two decoders ignore trailing bytes.

use std::fmt;

/// Bytes of the frame header: an iSCSI BHS.
pub const FRAME_LEN: usize = 48;
/// Bytes of the iSER header an RDMA SEND carries in front of the frame.
pub const ISER_LEN: usize = 28;
/// Bytes of every RDMA SEND's headers (and of an RDMA answer).
pub const RDMA_HDR_LEN: usize = ISER_LEN + FRAME_LEN;
/// Largest block the floor moves (the server allocates a few of these).
pub const MAX_BS: u32 = 16 << 20;

const MAGIC: [u8; 4] = *b"RSLF";
const VERSION: u8 = 1;

/// What a frame asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Request with `data_len` bytes of data behind the header (TCP, RDMA
    /// shape "send"); answered by a `Reply`.
    Data,
    /// RDMA READ `remote_len` bytes at `remote_addr` / `rkey` of the
    /// client, then answer with a `Reply` (RDMA shape "send/read").
    Read,
    /// Enter ib_write_lat mode: RDMA-WRITE the client's buffer at
    /// `remote_addr` / `rkey` (`remote_len` bytes) each time the last byte
    /// of the server's write buffer changes; answered by a `Reply`.
    WlatStart,
    /// Leave ib_write_lat mode; answered by a `Reply`.
    WlatStop,
    /// The server's answer to any of the above.
    Reply,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Data => 1,
            Op::Read => 2,
            Op::WlatStart => 3,
            Op::WlatStop => 4,
            Op::Reply => 0x81,
        }
    }

    fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            1 => Op::Data,
            2 => Op::Read,
            3 => Op::WlatStart,
            4 => Op::WlatStop,
            0x81 => Op::Reply,
            _ => return None,
        })
    }
}

/// A malformed message from the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    Short { what: &'static str, len: usize },
    Magic { what: &'static str },
    Version { what: &'static str, version: u8 },
    Opcode(u8),
    TooLong { len: u32 },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Short { what, len } => write!(f, "{what}: only {len} bytes"),
            WireError::Magic { what } => {
                write!(
                    f,
                    "{what}: not a floor message (bad magic; not a floor peer?)"
                )
            }
            WireError::Version { what, version } => write!(
                f,
                "{what}: protocol version {version}, this rdma-bench speaks {VERSION}"
            ),
            WireError::Opcode(c) => write!(f, "unknown floor opcode {c:#04x}"),
            WireError::TooLong { len } => {
                write!(f, "{len}-byte block exceeds the {MAX_BS}-byte limit")
            }
        }
    }
}

impl std::error::Error for WireError {}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_be_bytes(a)
}

fn check_head(b: &[u8], need: usize, what: &'static str) -> Result<(), WireError> {
    if b.len() < need {
        return Err(WireError::Short { what, len: b.len() });
    }
    if b[..4] != MAGIC {
        return Err(WireError::Magic { what });
    }
    if b[4] != VERSION {
        return Err(WireError::Version {
            what,
            version: b[4],
        });
    }
    Ok(())
}

/// The 48-byte frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub op: Op,
    pub seq: u32,
    /// Bytes of data behind the header (`Data`), else 0.
    pub data_len: u32,
    /// The client's buffer (`Read`, `WlatStart`), else 0.
    pub remote_addr: u64,
    pub rkey: u32,
    pub remote_len: u32,
}

impl Frame {
    pub fn new(op: Op, seq: u32) -> Frame {
        Frame {
            op,
            seq,
            data_len: 0,
            remote_addr: 0,
            rkey: 0,
            remote_len: 0,
        }
    }

    /// Write the header into `out[..FRAME_LEN]` (`out` must be that long).
    pub fn encode(&self, out: &mut [u8]) {
        let o = &mut out[..FRAME_LEN];
        o.fill(0);
        o[..4].copy_from_slice(&MAGIC);
        o[4] = VERSION;
        o[5] = self.op.code();
        o[8..12].copy_from_slice(&self.seq.to_be_bytes());
        o[12..16].copy_from_slice(&self.data_len.to_be_bytes());
        o[16..24].copy_from_slice(&self.remote_addr.to_be_bytes());
        o[24..28].copy_from_slice(&self.rkey.to_be_bytes());
        o[28..32].copy_from_slice(&self.remote_len.to_be_bytes());
    }

    /// Decode exactly one header; lengths above [`MAX_BS`] are refused
    /// here, before anything is read or allocated for them.
    pub fn decode(b: &[u8]) -> Result<Frame, WireError> {
        check_head(b, FRAME_LEN, "frame header")?;
        if b.len() != FRAME_LEN {
            return Err(WireError::Short {
                what: "frame header (wrong length)",
                len: b.len(),
            });
        }
        let op = Op::from_code(b[5]).ok_or(WireError::Opcode(b[5]))?;
        let f = Frame {
            op,
            seq: u32_at(b, 8),
            data_len: u32_at(b, 12),
            remote_addr: u64_at(b, 16),
            rkey: u32_at(b, 24),
            remote_len: u32_at(b, 28),
        };
        for len in [f.data_len, f.remote_len] {
            if len > MAX_BS {
                return Err(WireError::TooLong { len });
            }
        }
        Ok(f)
    }

    /// Write the RDMA headers into `out[..RDMA_HDR_LEN]`: a zeroed stand-in
    /// for the iSER header, then the frame.
    pub fn encode_rdma(&self, out: &mut [u8]) {
        out[..ISER_LEN].fill(0);
        self.encode(&mut out[ISER_LEN..RDMA_HDR_LEN]);
    }

    /// Decode the frame of an RDMA message of `b.len()` bytes (headers plus
    /// data) and check that its length matches the frame's `data_len`.
    #[cfg(test)]
    pub fn decode_rdma(b: &[u8]) -> Result<Frame, WireError> {
        Frame::decode_rdma_headers(&b[..b.len().min(RDMA_HDR_LEN)], b.len())
    }

    /// Decode the frame of an RDMA message of `len` bytes (headers plus
    /// data) from its first bytes (its headers, or all of it if shorter),
    /// and check that `len` matches the frame's `data_len`.
    pub fn decode_rdma_headers(headers: &[u8], len: usize) -> Result<Frame, WireError> {
        if len < RDMA_HDR_LEN || headers.len() < RDMA_HDR_LEN {
            return Err(WireError::Short {
                what: "RDMA message",
                len,
            });
        }
        let f = Frame::decode(&headers[ISER_LEN..RDMA_HDR_LEN])?;
        if len - RDMA_HDR_LEN != f.data_len as usize {
            return Err(WireError::Short {
                what: "RDMA message (length and data_len disagree)",
                len,
            });
        }
        Ok(f)
    }
}

/// Connect private data: the client's block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub bs: u32,
}

/// Bytes of an encoded [`Hello`] (the CM allows 56 on connect).
pub const HELLO_LEN: usize = 12;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut o = [0u8; HELLO_LEN];
        o[..4].copy_from_slice(&MAGIC);
        o[4] = VERSION;
        o[8..12].copy_from_slice(&self.bs.to_be_bytes());
        o
    }

    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        check_head(b, HELLO_LEN, "connect private data")?;
        let bs = u32_at(b, 8);
        if bs > MAX_BS {
            return Err(WireError::TooLong { len: bs });
        }
        Ok(Hello { bs })
    }
}

/// Accept private data: the server's buffers for ib_read_lat (the client
/// reads `read_*`) and ib_write_lat (the client writes `write_*`), each
/// `bs` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    pub bs: u32,
    pub read_addr: u64,
    pub read_rkey: u32,
    pub write_addr: u64,
    pub write_rkey: u32,
}

/// Bytes of an encoded [`Accept`] (the CM allows 196 on accept).
pub const ACCEPT_LEN: usize = 40;

impl Accept {
    pub fn encode(&self) -> [u8; ACCEPT_LEN] {
        let mut o = [0u8; ACCEPT_LEN];
        o[..4].copy_from_slice(&MAGIC);
        o[4] = VERSION;
        o[8..12].copy_from_slice(&self.bs.to_be_bytes());
        o[12..16].copy_from_slice(&self.read_rkey.to_be_bytes());
        o[16..24].copy_from_slice(&self.read_addr.to_be_bytes());
        o[24..28].copy_from_slice(&self.write_rkey.to_be_bytes());
        o[32..40].copy_from_slice(&self.write_addr.to_be_bytes());
        o
    }

    pub fn decode(b: &[u8]) -> Result<Accept, WireError> {
        check_head(b, ACCEPT_LEN, "accept private data")?;
        Ok(Accept {
            bs: u32_at(b, 8),
            read_rkey: u32_at(b, 12),
            read_addr: u64_at(b, 16),
            write_rkey: u32_at(b, 24),
            write_addr: u64_at(b, 32),
        })
    }
}

/// The last-byte marker of ib_write_lat iteration `n` (counted from 0 at
/// `WlatStart`): 1, 2, …, 255, 1, … — never 0, the value both sides put
/// there at the start, and always different from the previous one.
pub fn marker(n: u64) -> u8 {
    (n % 255) as u8 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Frame {
        Frame {
            op: Op::Read,
            seq: 0xdead_beef,
            data_len: 0,
            remote_addr: 0x7f00_1234_5678,
            rkey: 0x1234,
            remote_len: 4096,
        }
    }

    #[test]
    fn frame_round_trip() {
        for op in [Op::Data, Op::Read, Op::WlatStart, Op::WlatStop, Op::Reply] {
            let f = Frame { op, ..sample() };
            let mut b = [0xffu8; FRAME_LEN];
            f.encode(&mut b);
            assert_eq!(Frame::decode(&b), Ok(f));
            assert_eq!(&b[..4], b"RSLF");
            assert!(b[32..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn frame_rejects_garbage() {
        let mut b = [0u8; FRAME_LEN];
        sample().encode(&mut b);
        assert!(matches!(
            Frame::decode(&b[..47]),
            Err(WireError::Short { len: 47, .. })
        ));
        let mut long = [0u8; FRAME_LEN + 1];
        long[..FRAME_LEN].copy_from_slice(&b);
        assert!(matches!(Frame::decode(&long), Err(WireError::Short { .. })));
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(Frame::decode(&bad), Err(WireError::Magic { .. })));
        let mut bad = b;
        bad[4] = 9;
        assert!(matches!(
            Frame::decode(&bad),
            Err(WireError::Version { version: 9, .. })
        ));
        let mut bad = b;
        bad[5] = 0x42;
        assert_eq!(Frame::decode(&bad), Err(WireError::Opcode(0x42)));
        let f = Frame {
            data_len: MAX_BS + 1,
            ..sample()
        };
        f.encode(&mut bad);
        assert_eq!(
            Frame::decode(&bad),
            Err(WireError::TooLong { len: MAX_BS + 1 })
        );
        let f = Frame {
            remote_len: u32::MAX,
            ..sample()
        };
        f.encode(&mut bad);
        assert!(Frame::decode(&bad).is_err());
        let f = Frame {
            data_len: MAX_BS,
            ..sample()
        };
        f.encode(&mut bad);
        assert!(Frame::decode(&bad).is_ok());
        // Every error explains itself.
        for e in [
            WireError::Short { what: "x", len: 1 },
            WireError::Magic { what: "x" },
            WireError::Version {
                what: "x",
                version: 2,
            },
            WireError::Opcode(7),
            WireError::TooLong { len: 1 << 30 },
        ] {
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn rdma_message() {
        let mut m = vec![0xeeu8; RDMA_HDR_LEN + 512];
        let f = Frame {
            op: Op::Data,
            data_len: 512,
            ..sample()
        };
        f.encode_rdma(&mut m);
        assert!(m[..ISER_LEN].iter().all(|&x| x == 0));
        assert_eq!(Frame::decode_rdma(&m), Ok(f));
        // Received length must match data_len.
        assert!(Frame::decode_rdma(&m[..RDMA_HDR_LEN + 511]).is_err());
        assert!(Frame::decode_rdma(&m[..RDMA_HDR_LEN - 1]).is_err());
        let reply = Frame::new(Op::Reply, 7);
        reply.encode_rdma(&mut m);
        assert_eq!(Frame::decode_rdma(&m[..RDMA_HDR_LEN]), Ok(reply));
    }

    #[test]
    fn private_data_round_trip_with_cm_padding() {
        let h = Hello { bs: 4096 };
        let mut padded = [0u8; 56];
        padded[..HELLO_LEN].copy_from_slice(&h.encode());
        assert_eq!(Hello::decode(&padded), Ok(h));
        assert!(Hello::decode(&padded[..HELLO_LEN - 1]).is_err());
        let big = Hello { bs: MAX_BS + 1 }.encode();
        assert!(matches!(
            Hello::decode(&big),
            Err(WireError::TooLong { .. })
        ));
        assert!(matches!(
            Hello::decode(&[0u8; 56]),
            Err(WireError::Magic { .. })
        ));

        let a = Accept {
            bs: 512,
            read_addr: 0x1111_2222_3333,
            read_rkey: 0xaabb,
            write_addr: 0x4444_5555_6666,
            write_rkey: 0xccdd,
        };
        let mut padded = [0u8; 196];
        padded[..ACCEPT_LEN].copy_from_slice(&a.encode());
        assert_eq!(Accept::decode(&padded), Ok(a));
        assert!(Accept::decode(&padded[..ACCEPT_LEN - 1]).is_err());
        assert!(Accept::decode(&[]).is_err());
    }

    #[test]
    fn markers_never_zero_never_repeat() {
        let mut prev = 0u8;
        for n in 0..1000u64 {
            let m = marker(n);
            assert_ne!(m, 0);
            assert_ne!(m, prev, "iteration {n}");
            prev = m;
        }
        assert_eq!(marker(0), 1);
        assert_eq!(marker(254), 255);
        assert_eq!(marker(255), 1);
        assert_ne!(marker(u64::MAX), 0);
    }
}
