//! INQUIRY (standard data and VPD pages) and REPORT LUNS.

use super::vocab::{Geometry, MAX_CAW_BLOCKS, MAX_TRANSFER_BYTES, MAX_WRITE_SAME_BYTES, VPD_PAGES};
use super::Identity;
use ramslog_common::lun::Lun;

pub(crate) const VENDOR: &[u8; 8] = b"RAMSLOG ";
pub(crate) const PRODUCT: &[u8; 16] = b"RAMDISK         ";
pub(crate) const REVISION: &[u8; 4] = b"0001";

/// Peripheral qualifier 011b / device type 1Fh: "no LU at this LUN".
const NO_LU: u8 = 0x7f;
const SBC_DISK: u8 = 0x00;

/// Standard INQUIRY data (SPC-4 6.6.2), 96 bytes.
pub(crate) fn standard(out: &mut Vec<u8>, present: bool) {
    let start = out.len();
    out.resize(start + 96, 0);
    let d = &mut out[start..];
    d[0] = if present { SBC_DISK } else { NO_LU };
    d[2] = 0x06; // SPC-4
    d[3] = 0x12; // HISUP, response data format 2
    d[4] = 96 - 5;
    d[7] = 0x02; // CMDQUE
    d[8..16].copy_from_slice(VENDOR);
    d[16..32].copy_from_slice(PRODUCT);
    d[32..36].copy_from_slice(REVISION);
    // Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3. libiscsi's test tool
    // enables its SBC-3 checks (READ CAPACITY 16, 60-byte Block Limits) on 04C0h.
    for (i, v) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
        d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
    }
}

/// VPD page header + body; `body` fills in the page after the 4-byte header.
fn page(out: &mut Vec<u8>, pdt: u8, code: u8, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[pdt, code, 0, 0]);
    body(out);
    let len = (out.len() - start - 4) as u16;
    out[start + 2..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// VPD pages for a LU that does not exist: just the header.
pub(crate) fn absent_vpd(out: &mut Vec<u8>, code: u8) {
    page(out, NO_LU, code, |_| {});
}

pub(crate) fn vpd(out: &mut Vec<u8>, code: u8, id: &Identity, geo: Geometry) {
    let bs = geo.block_size;
    match code {
        0x00 => page(out, SBC_DISK, code, |o| o.extend_from_slice(&VPD_PAGES)),
        0x80 => page(out, SBC_DISK, code, |o| {
            o.extend_from_slice(id.serial.as_bytes())
        }),
        0x83 => page(out, SBC_DISK, code, |o| {
            // NAA designator: binary code set, LU association, type 3.
            o.extend_from_slice(&[0x01, 0x03, 0x00, 8]);
            o.extend_from_slice(&id.naa);
            // T10 vendor ID designator: ASCII, LU association, type 1.
            let t10_len = (VENDOR.len() + id.serial.len()) as u8;
            o.extend_from_slice(&[0x02, 0x01, 0x00, t10_len]);
            o.extend_from_slice(VENDOR);
            o.extend_from_slice(id.serial.as_bytes());
            // Relative target port 1: iSCSI protocol id, PIV, target port
            // association, type 4. We expose exactly one target port.
            o.extend_from_slice(&[0x51, 0x94, 0x00, 4, 0, 0, 0, 1]);
        }),
        0x86 => page(out, SBC_DISK, code, |o| {
            let mut b = [0u8; 60];
            b[1] = 0x01; // SIMPSUP: SIMPLE task attribute supported
            o.extend_from_slice(&b);
        }),
        0xb0 => page(out, SBC_DISK, code, |o| {
            let limits = block_limits(bs);
            let mut b = [0u8; 60];
            // b[0] bit 0 WSNZ = 0: WRITE SAME with 0 blocks means "to the end".
            b[1] = limits.max_compare_and_write;
            b[2..4].copy_from_slice(&1u16.to_be_bytes()); // OPTIMAL TRANSFER LENGTH GRANULARITY
            b[4..8].copy_from_slice(&limits.max_transfer.to_be_bytes());
            // MAXIMUM UNMAP LBA COUNT / BLOCK DESCRIPTOR COUNT stay 0: no UNMAP.
            b[32..40].copy_from_slice(&limits.max_write_same.to_be_bytes());
            o.extend_from_slice(&b);
        }),
        0xb1 => page(out, SBC_DISK, code, |o| {
            let mut b = [0u8; 60];
            b[0..2].copy_from_slice(&1u16.to_be_bytes()); // non-rotating medium
            o.extend_from_slice(&b);
        }),
        _ => absent_vpd(out, code),
    }
}

/// The limits the Block Limits VPD page (B0h) advertises, in logical
/// blocks of `block_size`. Hosts cache them (Linux at the first scan,
/// illumos at attach), so a restart may raise none of them lower: a host
/// would send commands the new program refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockLimits {
    pub max_compare_and_write: u8,
    pub max_transfer: u32,
    pub max_write_same: u64,
}

impl BlockLimits {
    /// The first limit `new` lowers, named, with both values.
    pub fn lowered_by(&self, new: &BlockLimits) -> Option<String> {
        let pairs = [
            (
                "MAXIMUM COMPARE AND WRITE LENGTH",
                u64::from(self.max_compare_and_write),
                u64::from(new.max_compare_and_write),
            ),
            (
                "MAXIMUM TRANSFER LENGTH",
                u64::from(self.max_transfer),
                u64::from(new.max_transfer),
            ),
            (
                "MAXIMUM WRITE SAME LENGTH",
                self.max_write_same,
                new.max_write_same,
            ),
        ];
        pairs
            .into_iter()
            .find(|(_, old, new)| new < old)
            .map(|(name, old, new)| format!("{name} {old} -> {new} blocks"))
    }
}

/// SCSI's part of the hand-over's shape check: the Block Limits VPD page
/// a LU of a given block size advertises, which hosts cache.
pub struct BlockLimitsAdvertised;

impl crate::core::Advertised for BlockLimitsAdvertised {
    fn key(&self) -> &'static str {
        "block_limits"
    }

    fn name(&self) -> &'static str {
        "Block Limits"
    }

    fn of(&self, block_size: u32) -> serde_json::Value {
        serde_json::to_value(block_limits(block_size)).unwrap_or(serde_json::Value::Null)
    }

    fn lowered(&self, now: &serde_json::Value, new: &serde_json::Value) -> Option<String> {
        let read = |v: &serde_json::Value| serde_json::from_value::<BlockLimits>(v.clone());
        match (read(now), read(new)) {
            (Ok(now), Ok(new)) => now.lowered_by(&new),
            (_, Err(e)) => Some(format!("what it advertises does not read: {e}")),
            (Err(_), Ok(_)) => None,
        }
    }
}

pub fn block_limits(block_size: u32) -> BlockLimits {
    BlockLimits {
        max_compare_and_write: MAX_CAW_BLOCKS,
        max_transfer: MAX_TRANSFER_BYTES / block_size.max(1),
        max_write_same: MAX_WRITE_SAME_BYTES / u64::from(block_size.max(1)),
    }
}

/// A checksum of the INQUIRY data and every VPD page this binary serves for
/// a LU of `geo`, its identity left out (accept-empty changes that, and
/// hosts learn it as a new device): a successor whose checksum differs
/// from the one recorded beside the kept memory tells hosts INQUIRY DATA
/// HAS CHANGED.
pub(crate) fn digest(geo: Geometry) -> u32 {
    let anonymous = Identity {
        naa: [0; 8],
        serial: String::new(),
    };
    let mut out = Vec::with_capacity(512);
    standard(&mut out, true);
    for code in VPD_PAGES {
        vpd(&mut out, code, &anonymous, geo);
    }
    crc32c::crc32c(&out)
}

pub(crate) fn report_luns(out: &mut Vec<u8>, select: u8, luns: impl Iterator<Item = u64>) {
    out.extend_from_slice(&[0; 8]);
    // SELECT REPORT 01h asks for well-known LUNs only; we have none.
    if select != 1 {
        // The configuration admits no LUN above Lun::MAX.
        for lun in luns.filter_map(Lun::new) {
            out.extend_from_slice(&lun.to_bytes());
        }
    }
    let len = (out.len() - 8) as u32;
    out[0..4].copy_from_slice(&len.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::{PRODUCT, VENDOR};

    /// The illumos `sd.conf` line the README gives names this device as
    /// INQUIRY reports it: `sd` matches the 8-byte vendor field, then the
    /// product. A change to either constant must change the docs with it.
    #[test]
    fn the_sd_conf_line_in_the_docs_names_this_device() {
        let vendor = std::str::from_utf8(VENDOR).expect("ASCII");
        let product = std::str::from_utf8(PRODUCT).expect("ASCII").trim_end();
        let line = format!("sd-config-list = \"{vendor}{product}\", \"cache-nonvolatile:true\";");
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut docs = vec![root.join("README.md")];
        if let Ok(dir) = std::fs::read_dir(root.join("docs")) {
            docs.extend(dir.filter_map(|e| e.ok()).map(|e| e.path()));
        }
        let mut found = 0;
        for path in docs
            .iter()
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
        {
            let text = std::fs::read_to_string(path).expect("read the docs");
            for l in text.lines().filter(|l| l.contains("sd-config-list = ")) {
                assert_eq!(l.trim(), line, "{}", path.display());
                found += 1;
            }
        }
        assert!(found > 0, "no sd-config-list line in README.md or docs/");
    }
}
