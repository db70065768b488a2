//! SCSI operation codes (SPC-4, SBC-3) and builders for the CDBs the
//! initiator, the bench and the tests send. The target's command table
//! names its opcodes from here too.

/// Operation codes, and the service actions ramslog uses.
pub mod opcode {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ6: u8 = 0x08;
    pub const WRITE6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT6: u8 = 0x15;
    pub const RESERVE6: u8 = 0x16;
    pub const RELEASE6: u8 = 0x17;
    pub const MODE_SENSE6: u8 = 0x1a;
    pub const START_STOP_UNIT: u8 = 0x1b;
    pub const READ_CAPACITY10: u8 = 0x25;
    pub const READ10: u8 = 0x28;
    pub const WRITE10: u8 = 0x2a;
    pub const WRITE_VERIFY10: u8 = 0x2e;
    pub const VERIFY10: u8 = 0x2f;
    pub const PRE_FETCH10: u8 = 0x34;
    pub const SYNC_CACHE10: u8 = 0x35;
    pub const WRITE_SAME10: u8 = 0x41;
    pub const MODE_SELECT10: u8 = 0x55;
    pub const MODE_SENSE10: u8 = 0x5a;
    pub const PR_IN: u8 = 0x5e;
    pub const PR_OUT: u8 = 0x5f;
    pub const READ16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE16: u8 = 0x8a;
    pub const WRITE_VERIFY16: u8 = 0x8e;
    pub const VERIFY16: u8 = 0x8f;
    pub const PRE_FETCH16: u8 = 0x90;
    pub const SYNC_CACHE16: u8 = 0x91;
    pub const WRITE_SAME16: u8 = 0x93;
    pub const SERVICE_ACTION_IN16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ12: u8 = 0xa8;
    pub const WRITE12: u8 = 0xaa;
    pub const WRITE_VERIFY12: u8 = 0xae;
    pub const VERIFY12: u8 = 0xaf;

    pub const SA_READ_CAPACITY16: u8 = 0x10;
    pub const SA_REPORT_SUPPORTED_OPCODES: u8 = 0x0c;
}

pub fn test_unit_ready() -> [u8; 6] {
    [opcode::TEST_UNIT_READY, 0, 0, 0, 0, 0]
}

pub fn inquiry(evpd: bool, page: u8, alloc: u16) -> [u8; 6] {
    let a = alloc.to_be_bytes();
    [opcode::INQUIRY, evpd as u8, page, a[0], a[1], 0]
}

/// PERSISTENT RESERVE OUT `service_action` with its 24-byte basic
/// parameter list: reservation key `key`, service action key `sa_key`, LU
/// scope and type WRITE EXCLUSIVE (what fence_scsi uses). The CDB and the
/// list.
pub fn persistent_reserve_out(service_action: u8, key: u64, sa_key: u64) -> ([u8; 10], [u8; 24]) {
    let mut cdb = [0u8; 10];
    cdb[0] = opcode::PR_OUT;
    cdb[1] = service_action;
    cdb[2] = 0x01;
    cdb[8] = 24;
    let mut params = [0u8; 24];
    params[0..8].copy_from_slice(&key.to_be_bytes());
    params[8..16].copy_from_slice(&sa_key.to_be_bytes());
    (cdb, params)
}

/// READ (10): what illumos sd sends below LBA 2^32 and 65536 blocks.
/// `None` when the LBA or length does not fit.
pub fn read10(lba: u64, blocks: u32) -> Option<[u8; 10]> {
    rw10(opcode::READ10, lba, blocks, false)
}

/// WRITE (10), optionally with FUA; `None` when the LBA or length does not fit.
pub fn write10(lba: u64, blocks: u32, fua: bool) -> Option<[u8; 10]> {
    rw10(opcode::WRITE10, lba, blocks, fua)
}

fn rw10(op: u8, lba: u64, blocks: u32, fua: bool) -> Option<[u8; 10]> {
    let lba = u32::try_from(lba).ok()?;
    let blocks = u16::try_from(blocks).ok()?;
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    Some([
        op,
        if fua { 0x08 } else { 0 },
        l[0],
        l[1],
        l[2],
        l[3],
        0,
        n[0],
        n[1],
        0,
    ])
}

pub fn read_capacity10() -> [u8; 10] {
    [opcode::READ_CAPACITY10, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(opcode::READ16, lba, blocks, false)
}

pub fn write16(lba: u64, blocks: u32, fua: bool) -> [u8; 16] {
    rw16(opcode::WRITE16, lba, blocks, fua)
}

fn rw16(op: u8, lba: u64, blocks: u32, fua: bool) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    if fua {
        c[1] = 0x08;
    }
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// SYNCHRONIZE CACHE (10) of the whole LUN (LBA 0, 0 blocks).
pub fn sync_cache10() -> [u8; 10] {
    [opcode::SYNC_CACHE10, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

pub fn read_capacity16(alloc: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = opcode::SERVICE_ACTION_IN16;
    c[1] = opcode::SA_READ_CAPACITY16;
    c[10..14].copy_from_slice(&alloc.to_be_bytes());
    c
}

pub fn report_luns(alloc: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = opcode::REPORT_LUNS;
    c[6..10].copy_from_slice(&alloc.to_be_bytes());
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let w = write16(0x0102_0304_0506_0708, 8, true);
        assert_eq!(w[0], 0x8a);
        assert_eq!(w[1], 0x08);
        assert_eq!(&w[2..10], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&w[10..14], &[0, 0, 0, 8]);
        assert_eq!(inquiry(true, 0x83, 255), [0x12, 1, 0x83, 0, 255, 0]);
        assert_eq!(read_capacity16(32)[13], 32);
        assert_eq!(report_luns(4096)[8], 0x10);
        assert_eq!(
            write10(0x0102_0304, 0x0506, true),
            Some([0x2a, 0x08, 1, 2, 3, 4, 0, 5, 6, 0])
        );
        assert_eq!(read10(7, 1).map(|c| c[0]), Some(0x28));
        assert_eq!(write10(1 << 32, 1, false), None);
        assert_eq!(read10(0, 65536), None);
        assert_eq!(read_capacity10()[0], 0x25);
    }
}
