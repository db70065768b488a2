//! What a volume is to hosts, whatever the protocol: SCSI shows it in VPD
//! pages 80h and 83h; NVMe identifiers will derive from it.

use std::fmt::Write as _;

/// What makes a LU a particular device to hosts: the NAA designator in VPD
/// 83h and the serial number in VPD 80h. A LU whose content was lost must
/// come back under a new identity (see docs/design.md, "The identity rule").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// NAA 3h (locally assigned) designator, 8 bytes, first nibble 3.
    pub naa: [u8; 8],
    /// UUID text.
    pub serial: String,
}

impl Identity {
    /// A fresh random identity.
    pub fn generate() -> Identity {
        let mut naa: [u8; 8] = rand::random();
        naa[0] = 0x30 | (naa[0] & 0x0f);
        let mut u: [u8; 16] = rand::random();
        u[6] = (u[6] & 0x0f) | 0x40; // UUID version 4
        u[8] = (u[8] & 0x3f) | 0x80; // RFC 4122 variant
        let mut serial = String::with_capacity(36);
        for (i, b) in u.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                serial.push('-');
            }
            let _ = write!(serial, "{b:02x}");
        }
        Identity { naa, serial }
    }
}

/// The NAA designator as 16 lower-case hex digits: how the state file,
/// image names, `status` and the log spell it.
pub fn naa_hex(naa: &[u8; 8]) -> String {
    naa.iter().map(|b| format!("{b:02x}")).collect()
}
