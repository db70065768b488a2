//! The 48-byte basic header segment and its opcode-specific fields.
//!
//! [`Bhs`] is a plain byte array with named accessors: the target reads the
//! fields a handler needs, and replies are built by the typed emitters in
//! [`emit`], so nothing is allocated and no intermediate struct is copied per
//! PDU. The array is private: outside this crate every byte is reached through
//! a named field, so each field's offset is written once.

use thiserror::Error;

mod emit;
pub use emit::{DataIn, DataInStatus, LoginResponse, R2t, Residual};

pub const BHS_LEN: usize = 48;
/// Largest data segment length the 24-bit field can express.
pub const MAX_DATA_SEGMENT_LEN: u32 = (1 << 24) - 1;
/// Reserved tag value meaning "no task" (RFC 7143 11.2.1.8).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    NopOut = 0x00,
    ScsiCommand = 0x01,
    TaskMgmtRequest = 0x02,
    LoginRequest = 0x03,
    TextRequest = 0x04,
    DataOut = 0x05,
    LogoutRequest = 0x06,
    SnackRequest = 0x10,
    NopIn = 0x20,
    ScsiResponse = 0x21,
    TaskMgmtResponse = 0x22,
    LoginResponse = 0x23,
    TextResponse = 0x24,
    DataIn = 0x25,
    LogoutResponse = 0x26,
    ReadyToTransfer = 0x31,
    AsyncMessage = 0x32,
    Reject = 0x3f,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Self> {
        use Opcode::*;
        Some(match v {
            0x00 => NopOut,
            0x01 => ScsiCommand,
            0x02 => TaskMgmtRequest,
            0x03 => LoginRequest,
            0x04 => TextRequest,
            0x05 => DataOut,
            0x06 => LogoutRequest,
            0x10 => SnackRequest,
            0x20 => NopIn,
            0x21 => ScsiResponse,
            0x22 => TaskMgmtResponse,
            0x23 => LoginResponse,
            0x24 => TextResponse,
            0x25 => DataIn,
            0x26 => LogoutResponse,
            0x31 => ReadyToTransfer,
            0x32 => AsyncMessage,
            0x3f => Reject,
            _ => return None,
        })
    }

    /// Opcodes an initiator may send.
    pub fn is_initiator_opcode(self) -> bool {
        (self as u8) < 0x20
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("header is {0} bytes, a BHS needs 48")]
    ShortHeader(usize),
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    #[error("AHS of {declared} bytes does not fit the {available} bytes given")]
    AhsLength { declared: usize, available: usize },
    #[error("AHS entry is malformed at offset {0}")]
    AhsEntry(usize),
    #[error("buffer too small: {need} bytes needed")]
    BufTooSmall { need: usize },
    #[error("data segment of {len} bytes exceeds the limit of {limit}")]
    DataSegmentTooLong { len: u32, limit: u32 },
    #[error("{0} trailing bytes after the PDU")]
    TrailingBytes(usize),
    #[error("both the underflow and the overflow bit are set")]
    BothResiduals,
}

/// Basic header segment.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs([u8; BHS_LEN]);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bhs")
            .field("opcode", &format_args!("{:#04x}", self.raw_opcode()))
            .field("flags", &format_args!("{:#04x}", self.flags()))
            .field("ahs", &self.total_ahs_len())
            .field("dsl", &self.data_segment_len())
            .field("itt", &format_args!("{:#x}", self.itt()))
            .finish()
    }
}

impl Default for Bhs {
    fn default() -> Self {
        Bhs([0; BHS_LEN])
    }
}

macro_rules! be32_field {
    ($get:ident, $set:ident, $off:expr) => {
        pub fn $get(&self) -> u32 {
            self.u32_at($off)
        }
        pub fn $set(&mut self, v: u32) -> &mut Self {
            self.set_u32_at($off, v);
            self
        }
    };
}

impl Bhs {
    /// Decode a BHS from exactly 48 bytes; the opcode must be one RFC 7143 defines.
    pub fn decode(buf: &[u8]) -> Result<Bhs, WireError> {
        let bytes: [u8; BHS_LEN] = buf
            .try_into()
            .map_err(|_| WireError::ShortHeader(buf.len()))?;
        let bhs = Bhs(bytes);
        Opcode::from_u8(bhs.raw_opcode()).ok_or(WireError::UnknownOpcode(bhs.raw_opcode()))?;
        Ok(bhs)
    }

    /// A header taken as it arrived, opcode unchecked: the engine answers an
    /// unknown opcode with a Reject instead of the transport dropping it.
    pub fn from_raw(bytes: [u8; BHS_LEN]) -> Bhs {
        Bhs(bytes)
    }

    /// The 48 wire bytes.
    pub fn as_bytes(&self) -> &[u8; BHS_LEN] {
        &self.0
    }

    pub fn new(op: Opcode) -> Bhs {
        let mut b = Bhs::default();
        b.0[0] = op as u8;
        b
    }

    /// A Data-Out header: number `datasn` of task `itt`'s burst that the
    /// R2T `ttt` asked for (RESERVED_TAG: unsolicited), carrying the bytes
    /// at `offset`; `last` sets the Final bit.
    pub fn data_out(itt: u32, ttt: u32, offset: u32, datasn: u32, last: bool) -> Bhs {
        let mut b = Bhs::new(Opcode::DataOut);
        b.set_final(last)
            .set_itt(itt)
            .set_ttt(ttt)
            .set_buffer_offset(offset)
            .set_datasn(datasn);
        b
    }

    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, WireError> {
        let dst = out
            .get_mut(..BHS_LEN)
            .ok_or(WireError::BufTooSmall { need: BHS_LEN })?;
        dst.copy_from_slice(&self.0);
        Ok(BHS_LEN)
    }

    fn u32_at(&self, off: usize) -> u32 {
        u32::from_be_bytes([
            self.0[off],
            self.0[off + 1],
            self.0[off + 2],
            self.0[off + 3],
        ])
    }
    fn set_u32_at(&mut self, off: usize, v: u32) {
        self.0[off..off + 4].copy_from_slice(&v.to_be_bytes());
    }
    fn u16_at(&self, off: usize) -> u16 {
        u16::from_be_bytes([self.0[off], self.0[off + 1]])
    }
    pub(crate) fn set_u16_at(&mut self, off: usize, v: u16) {
        self.0[off..off + 2].copy_from_slice(&v.to_be_bytes());
    }

    pub fn raw_opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }
    /// The opcode; [`Bhs::decode`] guarantees it is known.
    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.raw_opcode())
    }
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }
    pub fn set_immediate(&mut self, on: bool) -> &mut Self {
        self.set_bit(0, 0x40, on)
    }
    /// Byte 1: the F bit and opcode-specific flags.
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn set_flags(&mut self, v: u8) -> &mut Self {
        self.0[1] = v;
        self
    }
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    pub fn set_final(&mut self, on: bool) -> &mut Self {
        self.set_bit(1, 0x80, on)
    }
    fn set_bit(&mut self, byte: usize, mask: u8, on: bool) -> &mut Self {
        if on {
            self.0[byte] |= mask;
        } else {
            self.0[byte] &= !mask;
        }
        self
    }
    /// Total AHS length in bytes (the wire field counts 4-byte words).
    pub fn total_ahs_len(&self) -> usize {
        self.0[4] as usize * 4
    }
    /// Set TotalAHSLength (in 4-byte words) and DataSegmentLength at once,
    /// for the framers, which have checked both.
    #[inline]
    pub(crate) fn set_lengths(&mut self, ahs_words: u8, data_len: u32) {
        debug_assert!(data_len <= MAX_DATA_SEGMENT_LEN);
        let b = data_len.to_be_bytes();
        self.0[4] = ahs_words;
        self.0[5..8].copy_from_slice(&b[1..4]);
    }
    /// Set `TotalAHSLength` from a length in bytes, which must be a multiple
    /// of 4 and at most 1020.
    pub fn set_total_ahs_len(&mut self, bytes: usize) -> Result<&mut Self, WireError> {
        if !bytes.is_multiple_of(4) || bytes / 4 > u8::MAX as usize {
            return Err(WireError::AhsLength {
                declared: bytes,
                available: u8::MAX as usize * 4,
            });
        }
        self.0[4] = (bytes / 4) as u8;
        Ok(self)
    }
    pub fn data_segment_len(&self) -> u32 {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]])
    }
    pub fn set_data_segment_len(&mut self, len: u32) -> &mut Self {
        debug_assert!(len <= MAX_DATA_SEGMENT_LEN);
        let b = len.to_be_bytes();
        self.0[5..8].copy_from_slice(&b[1..4]);
        self
    }
    pub fn lun(&self) -> u64 {
        u64::from_be_bytes(self.0[8..16].try_into().unwrap_or([0; 8]))
    }
    pub fn set_lun(&mut self, lun: u64) -> &mut Self {
        self.0[8..16].copy_from_slice(&lun.to_be_bytes());
        self
    }

    be32_field!(itt, set_itt, 16);
    // Target transfer tag (Data-Out, NOP, R2T, Data-In, Text, Login: offset 20).
    be32_field!(ttt, set_ttt, 20);
    // SCSI Command: expected data transfer length (offset 20).
    be32_field!(expected_data_len, set_expected_data_len, 20);
    // CmdSN (requests) at offset 24.
    be32_field!(cmdsn, set_cmdsn, 24);
    // StatSN (responses) at offset 24.
    be32_field!(statsn, set_statsn, 24);
    // ExpStatSN (requests) at offset 28.
    be32_field!(exp_statsn, set_exp_statsn, 28);
    // ExpCmdSN (responses) at offset 28.
    be32_field!(exp_cmdsn, set_exp_cmdsn, 28);
    // MaxCmdSN (responses) at offset 32.
    be32_field!(max_cmdsn, set_max_cmdsn, 32);
    // DataSN / R2TSN at offset 36.
    be32_field!(datasn, set_datasn, 36);
    // Buffer offset (Data-In/Out, R2T) at offset 40.
    be32_field!(buffer_offset, set_buffer_offset, 40);
    // Residual count (SCSI Response, Data-In) or desired length (R2T) at offset 44.
    be32_field!(residual, set_residual, 44);

    // SCSI Command: the first 16 CDB bytes (offset 32).
    pub fn cdb(&self) -> &[u8; 16] {
        self.0[32..48].try_into().unwrap_or(&[0; 16])
    }
    /// SCSI Command: the CDB, zero-padded to 16 bytes; a longer CDB's first
    /// 16 bytes (the rest travels in an extended-CDB AHS).
    pub fn set_cdb(&mut self, cdb: &[u8]) -> &mut Self {
        let n = cdb.len().min(16);
        self.0[32..48].fill(0);
        self.0[32..32 + n].copy_from_slice(&cdb[..n]);
        self
    }

    /// Byte 2 of SCSI, Logout and Task Management Responses: the response code.
    pub fn response(&self) -> u8 {
        self.0[2]
    }
    /// Byte 2 of a Reject: the reason (RFC 7143 11.17.1).
    pub fn reject_reason(&self) -> u8 {
        self.0[2]
    }
    /// Byte 3 of a SCSI Response or a status-carrying Data-In: the SCSI status.
    pub fn scsi_status(&self) -> u8 {
        self.0[3]
    }
    /// Login Request and Response byte 2: Version-max. Every version so far
    /// is 0 (RFC 7143 11.12.4).
    pub fn version_max(&self) -> u8 {
        self.0[2]
    }
    /// Login Request byte 3: Version-min; in a Login Response the same byte
    /// is Version-active.
    pub fn version_min(&self) -> u8 {
        self.0[3]
    }
    pub fn version_active(&self) -> u8 {
        self.0[3]
    }
    /// Login Request: Version-max and Version-min.
    pub fn set_versions(&mut self, max: u8, min: u8) -> &mut Self {
        self.0[2] = max;
        self.0[3] = min;
        self
    }
    /// Login Response: status class and detail (offset 36) as one number, as
    /// in [`login_status`].
    pub fn login_status(&self) -> u16 {
        self.u16_at(36)
    }
    /// Login Response: the status class alone (0 success, 1 redirect, 2
    /// initiator error, 3 target error).
    pub fn login_status_class(&self) -> u8 {
        self.0[36]
    }
    /// Asynchronous Message: AsyncEvent and AsyncVCode (offsets 36, 37).
    pub fn async_event(&self) -> (u8, u8) {
        (self.0[36], self.0[37])
    }
    /// Asynchronous Message: Parameter1, Parameter2 and Parameter3
    /// (offsets 38, 40, 42); for AsyncEvent 2 and 3, Parameter2 is
    /// Time2Wait and Parameter3 Time2Retain, in seconds.
    pub fn async_parameters(&self) -> (u16, u16, u16) {
        (self.u16_at(38), self.u16_at(40), self.u16_at(42))
    }

    // Login: ISID (6 bytes at offset 8).
    pub fn isid(&self) -> [u8; 6] {
        let mut v = [0; 6];
        v.copy_from_slice(&self.0[8..14]);
        v
    }
    pub fn set_isid(&mut self, isid: [u8; 6]) -> &mut Self {
        self.0[8..14].copy_from_slice(&isid);
        self
    }
    // Login: TSIH (offset 14).
    pub fn tsih(&self) -> u16 {
        self.u16_at(14)
    }
    pub fn set_tsih(&mut self, v: u16) -> &mut Self {
        self.set_u16_at(14, v);
        self
    }
    // Login/Logout: CID (offset 20, 2 bytes).
    pub fn cid(&self) -> u16 {
        self.u16_at(20)
    }
    pub fn set_cid(&mut self, cid: u16) -> &mut Self {
        self.set_u16_at(20, cid);
        self
    }
}

/// Login request/response flags in byte 1.
pub mod login {
    pub const TRANSIT: u8 = 0x80;
    pub const CONTINUE: u8 = 0x40;
    /// Current stage (bits 2-3).
    pub fn csg(flags: u8) -> u8 {
        (flags >> 2) & 3
    }
    /// Next stage (bits 0-1).
    pub fn nsg(flags: u8) -> u8 {
        flags & 3
    }
    pub const STAGE_SECURITY: u8 = 0;
    pub const STAGE_OPERATIONAL: u8 = 1;
    pub const STAGE_FULL_FEATURE: u8 = 3;
}

/// SCSI Command flags in byte 1.
pub mod scsi_cmd {
    pub const READ: u8 = 0x40;
    pub const WRITE: u8 = 0x20;
    pub const ATTR_MASK: u8 = 0x07;
}

/// SCSI Response / Data-In flags in byte 1.
pub mod scsi_rsp {
    pub const BIDI_OVERFLOW: u8 = 0x10;
    pub const BIDI_UNDERFLOW: u8 = 0x08;
    pub const OVERFLOW: u8 = 0x04;
    pub const UNDERFLOW: u8 = 0x02;
    /// Data-In: status is present (phase collapse).
    pub const STATUS: u8 = 0x01;
    /// Data-In: acknowledge requested.
    pub const ACK: u8 = 0x40;
}

/// Reject reasons (RFC 7143 11.17.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    DataDigestError = 0x02,
    SnackReject = 0x03,
    ProtocolError = 0x04,
    CommandNotSupported = 0x05,
    ImmediateCommandReject = 0x06,
    TaskInProgress = 0x07,
    InvalidDataAck = 0x08,
    InvalidPduField = 0x09,
    LongOpReject = 0x0a,
    WaitingForLogout = 0x0c,
}

/// Login response status class/detail (RFC 7143 11.13.5).
pub mod login_status {
    pub const SUCCESS: u16 = 0x0000;
    pub const INITIATOR_ERROR: u16 = 0x0200;
    pub const AUTH_FAILED: u16 = 0x0201;
    pub const FORBIDDEN: u16 = 0x0202;
    pub const NOT_FOUND: u16 = 0x0203;
    pub const REMOVED: u16 = 0x0204;
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    pub const TOO_MANY_CONNECTIONS: u16 = 0x0206;
    pub const MISSING_PARAMETER: u16 = 0x0207;
    pub const CANT_INCLUDE_IN_SESSION: u16 = 0x0208;
    pub const SESSION_TYPE_NOT_SUPPORTED: u16 = 0x0209;
    pub const SESSION_DOES_NOT_EXIST: u16 = 0x020a;
    pub const INVALID_DURING_LOGIN: u16 = 0x020b;
    pub const TARGET_ERROR: u16 = 0x0300;
    pub const SERVICE_UNAVAILABLE: u16 = 0x0301;
    pub const OUT_OF_RESOURCES: u16 = 0x0302;
}

/// Task management functions (RFC 7143 11.5.1) and responses (11.6.1).
pub mod tmf {
    pub const ABORT_TASK: u8 = 1;
    pub const ABORT_TASK_SET: u8 = 2;
    pub const CLEAR_ACA: u8 = 3;
    pub const CLEAR_TASK_SET: u8 = 4;
    pub const LOGICAL_UNIT_RESET: u8 = 5;
    pub const TARGET_WARM_RESET: u8 = 6;
    pub const TARGET_COLD_RESET: u8 = 7;
    pub const TASK_REASSIGN: u8 = 8;

    pub const RSP_COMPLETE: u8 = 0;
    pub const RSP_NO_TASK: u8 = 1;
    pub const RSP_NO_LUN: u8 = 2;
    pub const RSP_TASK_ALLEGIANT: u8 = 3;
    pub const RSP_NO_REASSIGN: u8 = 4;
    pub const RSP_NOT_SUPPORTED: u8 = 5;
    pub const RSP_NOT_AUTHORIZED: u8 = 6;
    pub const RSP_REJECTED: u8 = 255;
}

/// A decoded PDU layout: where the AHS and the data segment sit in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PduLayout {
    pub ahs_len: usize,
    pub header_digest: bool,
    pub data_len: usize,
    pub data_digest: bool,
}

impl PduLayout {
    pub fn of(bhs: &Bhs, header_digest: bool, data_digest: bool) -> PduLayout {
        PduLayout {
            ahs_len: bhs.total_ahs_len(),
            header_digest,
            data_len: bhs.data_segment_len() as usize,
            data_digest,
        }
    }
    /// Bytes after the BHS up to and including the header digest.
    pub fn header_rest(&self) -> usize {
        self.ahs_len + if self.header_digest { 4 } else { 0 }
    }
    /// Bytes of the data segment on the wire: padded data plus its digest.
    pub fn data_wire_len(&self) -> usize {
        if self.data_len == 0 {
            0
        } else {
            super::padded(self.data_len) + if self.data_digest { 4 } else { 0 }
        }
    }
}

/// One Additional Header Segment entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ahs<'a> {
    pub ahs_type: u8,
    pub specific: u8,
    pub data: &'a [u8],
}

pub const AHS_EXTENDED_CDB: u8 = 1;
pub const AHS_BIDI_READ_LENGTH: u8 = 2;

/// Iterate over the AHS entries in `buf` (the AHS area, `TotalAHSLength` bytes).
pub fn parse_ahs(buf: &[u8]) -> impl Iterator<Item = Result<Ahs<'_>, WireError>> {
    let mut off = 0usize;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || off >= buf.len() {
            return None;
        }
        let start = off;
        let step = (|| {
            let hdr = buf.get(off..off + 3).ok_or(WireError::AhsEntry(start))?;
            let len = u16::from_be_bytes([hdr[0], hdr[1]]) as usize;
            let body_start = off + 3;
            let body = buf
                .get(body_start..body_start + len)
                .ok_or(WireError::AhsEntry(start))?;
            let entry = Ahs {
                ahs_type: hdr[2],
                specific: body.first().copied().unwrap_or(0),
                data: body.get(1..).unwrap_or(&[]),
            };
            // Each AHS occupies 4-byte words: length + type + specific + data, padded.
            off = start + super::padded(3 + len);
            Ok(entry)
        })();
        if step.is_err() {
            failed = true;
        }
        Some(step)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_short_and_unknown() {
        assert_eq!(Bhs::decode(&[0; 47]), Err(WireError::ShortHeader(47)));
        let mut b = [0u8; 48];
        b[0] = 0x3e;
        assert_eq!(Bhs::decode(&b), Err(WireError::UnknownOpcode(0x3e)));
    }

    #[test]
    fn ahs_lies_are_errors() {
        // length 20 but only 8 bytes present
        let buf = [0u8, 20, 1, 0, 0, 0, 0, 0];
        let r: Vec<_> = parse_ahs(&buf).collect();
        assert_eq!(r, vec![Err(WireError::AhsEntry(0))]);
    }

    #[test]
    fn extended_cdb_ahs() {
        // AHSLength 9 = reserved byte + 8 CDB bytes, padded to 12
        let mut buf = vec![0u8, 9, AHS_EXTENDED_CDB, 0];
        buf.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let r: Vec<_> = parse_ahs(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].data, &[1, 2, 3, 4, 5, 6, 7, 8]);
    }

    proptest! {
        #[test]
        fn bhs_round_trip(bytes in proptest::collection::vec(any::<u8>(), 48)) {
            if let Ok(bhs) = Bhs::decode(&bytes) {
                let mut out = [0u8; 48];
                prop_assert_eq!(bhs.encode_into(&mut out), Ok(48));
                prop_assert_eq!(&out[..], &bytes[..]);
            }
        }

        #[test]
        fn setters_round_trip(dsl in 0u32..=MAX_DATA_SEGMENT_LEN, itt: u32, lun: u64, sn: u32) {
            let mut b = Bhs::new(Opcode::ScsiResponse);
            b.set_data_segment_len(dsl).set_itt(itt).set_lun(lun).set_statsn(sn);
            let d = Bhs::decode(&b.0).unwrap();
            prop_assert_eq!(d.data_segment_len(), dsl);
            prop_assert_eq!(d.itt(), itt);
            prop_assert_eq!(d.lun(), lun);
            prop_assert_eq!(d.statsn(), sn);
        }

        #[test]
        fn ahs_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for e in parse_ahs(&bytes) { let _ = e; }
        }
    }
}
