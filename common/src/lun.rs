//! The 8-byte LUN field (SAM-5 4.7), in the two forms ramslog speaks:
//! peripheral device addressing (bus 0) below 256 and flat space addressing
//! up to 16383. A configuration cannot name a larger LUN, so no other form is
//! ever encoded; any other form received names no LUN here.

use std::fmt;

/// A logical unit number, 0 to [`Lun::MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lun(u16);

impl Lun {
    /// The largest LUN flat space addressing holds.
    pub const MAX: u64 = 0x3fff;

    /// `None` above [`Lun::MAX`].
    pub const fn new(number: u64) -> Option<Self> {
        if number <= Self::MAX {
            Some(Self(number as u16))
        } else {
            None
        }
    }

    pub const fn number(self) -> u64 {
        self.0 as u64
    }

    /// The field as the big-endian 64-bit value a BHS carries.
    pub const fn to_wire(self) -> u64 {
        if self.0 < 256 {
            (self.0 as u64) << 48
        } else {
            (0x4000 | self.0 as u64) << 48
        }
    }

    /// The field's eight bytes, as REPORT LUNS lists them.
    pub const fn to_bytes(self) -> [u8; 8] {
        self.to_wire().to_be_bytes()
    }

    /// The LUN a field names: peripheral device addressing on bus 0 or flat
    /// space addressing, with the second level (bytes 2 to 7) all zero.
    pub const fn from_wire(raw: u64) -> Option<Self> {
        let b = raw.to_be_bytes();
        if raw & 0x0000_ffff_ffff_ffff != 0 {
            return None;
        }
        match b[0] >> 6 {
            0 if b[0] & 0x3f == 0 => Some(Self(b[1] as u16)),
            1 => Some(Self((((b[0] & 0x3f) as u16) << 8) | b[1] as u16)),
            _ => None,
        }
    }
}

impl fmt::Display for Lun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_addressing_methods_round_trip() {
        assert_eq!(Lun::new(1).map(Lun::to_wire), Some(0x0001_0000_0000_0000));
        assert_eq!(Lun::new(300).map(Lun::to_wire), Some(0x412c_0000_0000_0000));
        assert_eq!(
            Lun::new(5).map(Lun::to_bytes),
            Some([0, 5, 0, 0, 0, 0, 0, 0])
        );
        for n in [0, 1, 255, 256, 4095, Lun::MAX] {
            let lun = Lun::new(n).expect("in range");
            assert_eq!(Lun::from_wire(lun.to_wire()), Some(lun));
        }
        assert_eq!(Lun::new(Lun::MAX + 1), None);
    }

    #[test]
    fn other_forms_name_no_lun() {
        // A second level, another bus, logical unit / extended addressing.
        for raw in [
            0x0001_0000_0000_0001,
            0x0101_0000_0000_0000,
            0x8001_0000_0000_0000,
            0xd200_0001_0000_0000,
        ] {
            assert_eq!(Lun::from_wire(raw), None, "{raw:#x}");
        }
    }
}
