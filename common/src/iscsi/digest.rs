//! CRC32C header and data digests (RFC 7143 12.1). iSCSI sends the digest
//! least-significant byte first.

/// Header digest over the BHS and AHS.
pub fn header(bhs: &[u8], ahs: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(bhs), ahs)
}

/// Data digest over the data segment and its zero padding.
pub fn data(segment: &[u8]) -> u32 {
    let crc = crc32c::crc32c(segment);
    let pad = super::padded(segment.len()) - segment.len();
    crc32c::crc32c_append(crc, &[0u8; 3][..pad])
}

pub fn to_wire(d: u32) -> [u8; 4] {
    d.to_le_bytes()
}

pub fn from_wire(b: [u8; 4]) -> u32 {
    u32::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    #[test]
    fn known_vector() {
        // RFC 3720 B.4: 32 bytes of zeros -> CRC aa 36 91 8a (as transmitted).
        assert_eq!(
            super::to_wire(super::data(&[0u8; 32])),
            [0xaa, 0x36, 0x91, 0x8a]
        );
    }
}
