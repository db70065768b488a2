//! SCSI wire fields shared by target and initiator: status codes, sense keys,
//! fixed-format sense data (SPC-4 4.5.3) and big-endian CDB field readers.

use thiserror::Error;

pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const CONDITION_MET: u8 = 0x04;
    pub const BUSY: u8 = 0x08;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    pub const TASK_SET_FULL: u8 = 0x28;
    pub const ACA_ACTIVE: u8 = 0x30;
    pub const TASK_ABORTED: u8 = 0x40;
}

pub mod sense_key {
    pub const NO_SENSE: u8 = 0x0;
    pub const RECOVERED_ERROR: u8 = 0x1;
    pub const NOT_READY: u8 = 0x2;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const HARDWARE_ERROR: u8 = 0x4;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const ABORTED_COMMAND: u8 = 0xb;
    pub const MISCOMPARE: u8 = 0xe;
}

/// Length of fixed-format sense data as ramslog sends it.
pub const FIXED_SENSE_LEN: usize = 18;

/// Sense-key-specific field pointer (SPC-4 4.5.2.4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldPointer {
    /// true: the error is in the CDB; false: in the parameter data.
    pub in_cdb: bool,
    pub byte: u16,
    /// Bit within the byte, when one bit is to blame.
    pub bit: Option<u8>,
}

impl FieldPointer {
    pub const fn cdb(byte: u16) -> Self {
        FieldPointer {
            in_cdb: true,
            byte,
            bit: None,
        }
    }
    pub const fn cdb_bit(byte: u16, bit: u8) -> Self {
        FieldPointer {
            in_cdb: true,
            byte,
            bit: Some(bit),
        }
    }
    pub const fn param(byte: u16) -> Self {
        FieldPointer {
            in_cdb: false,
            byte,
            bit: None,
        }
    }
    pub const fn param_bit(byte: u16, bit: u8) -> Self {
        FieldPointer {
            in_cdb: false,
            byte,
            bit: Some(bit),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// INFORMATION field; sets the VALID bit when present.
    pub information: Option<u32>,
    pub field: Option<FieldPointer>,
}

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Sense {
        Sense {
            key,
            asc,
            ascq,
            information: None,
            field: None,
        }
    }

    pub fn encode_fixed(&self) -> [u8; FIXED_SENSE_LEN] {
        let mut s = [0u8; FIXED_SENSE_LEN];
        s[0] = 0x70;
        s[2] = self.key & 0x0f;
        if let Some(info) = self.information {
            s[0] |= 0x80;
            s[3..7].copy_from_slice(&info.to_be_bytes());
        }
        s[7] = (FIXED_SENSE_LEN - 8) as u8;
        s[12] = self.asc;
        s[13] = self.ascq;
        if let Some(fp) = self.field {
            s[15] = 0x80 | if fp.in_cdb { 0x40 } else { 0 };
            if let Some(bit) = fp.bit {
                s[15] |= 0x08 | (bit & 7);
            }
            s[16..18].copy_from_slice(&fp.byte.to_be_bytes());
        }
        s
    }

    /// Decode fixed (0x70/0x71) or descriptor (0x72/0x73) format sense.
    pub fn decode(buf: &[u8]) -> Result<Sense, SenseError> {
        let code = buf.first().ok_or(SenseError::Short)? & 0x7f;
        match code {
            0x70 | 0x71 => {
                if buf.len() < 14 {
                    return Err(SenseError::Short);
                }
                let information = (buf[0] & 0x80 != 0)
                    .then(|| u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]));
                let field = buf.get(15..18).and_then(|sks| {
                    (sks[0] & 0x80 != 0).then(|| FieldPointer {
                        in_cdb: sks[0] & 0x40 != 0,
                        byte: u16::from_be_bytes([sks[1], sks[2]]),
                        bit: (sks[0] & 0x08 != 0).then_some(sks[0] & 7),
                    })
                });
                Ok(Sense {
                    key: buf[2] & 0x0f,
                    asc: buf[12],
                    ascq: buf[13],
                    information,
                    field,
                })
            }
            0x72 | 0x73 => {
                if buf.len() < 4 {
                    return Err(SenseError::Short);
                }
                Ok(Sense::new(buf[1] & 0x0f, buf[2], buf[3]))
            }
            other => Err(SenseError::ResponseCode(other)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SenseError {
    #[error("sense data too short")]
    Short,
    #[error("unknown sense response code {0:#04x}")]
    ResponseCode(u8),
}

/// Big-endian readers for CDB and parameter fields; out-of-range reads give 0
/// so callers validate lengths once, up front.
pub fn be16(b: &[u8], off: usize) -> u16 {
    b.get(off..off + 2)
        .map_or(0, |s| u16::from_be_bytes([s[0], s[1]]))
}
pub fn be24(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 3)
        .map_or(0, |s| u32::from_be_bytes([0, s[0], s[1], s[2]]))
}
pub fn be32(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .map_or(0, |s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}
pub fn be64(b: &[u8], off: usize) -> u64 {
    b.get(off..off + 8).map_or(0, |s| {
        u64::from_be_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn field_pointer_encoding() {
        let s = Sense {
            field: Some(FieldPointer::cdb_bit(1, 3)),
            ..Sense::new(sense_key::ILLEGAL_REQUEST, 0x24, 0)
        };
        let b = s.encode_fixed();
        assert_eq!(b[15], 0x80 | 0x40 | 0x08 | 3);
        assert_eq!(&b[16..18], &[0, 1]);
        assert_eq!(Sense::decode(&b), Ok(s));
    }

    proptest! {
        #[test]
        fn fixed_round_trip(key in 0u8..16, asc: u8, ascq: u8, info: Option<u32>,
                            fp in proptest::option::of((any::<bool>(), any::<u16>(), proptest::option::of(0u8..8)))) {
            let s = Sense { key, asc, ascq, information: info,
                field: fp.map(|(in_cdb, byte, bit)| FieldPointer { in_cdb, byte, bit }) };
            prop_assert_eq!(Sense::decode(&s.encode_fixed()), Ok(s));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = Sense::decode(&bytes);
        }
    }
}
