//! A data CDB's transfer length and the initiator's Expected Data Transfer
//! Length must agree for anything that writes: a write whose EDTL is
//! shorter or longer than its blocks is refused whole (CHECK CONDITION,
//! ILLEGAL REQUEST, INVALID FIELD IN COMMAND INFORMATION UNIT, as LIO's
//! `target_cmd_size_check`), never written in part and answered GOOD.

use super::*;

const LUN_BYTES: u64 = 1 << 20;

fn lun_bytes(h: &Harness) -> Vec<u8> {
    let mut v = vec![0u8; LUN_BYTES as usize];
    assert!(h.read_lun(0, &mut v));
    v
}

fn patterned() -> Harness {
    let mut h = Harness::new(RamPortal::new(IQN).size(LUN_BYTES).build());
    let r = h.login(&[
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("MaxRecvDataSegmentLength", "8192"),
    ]);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    let pattern: Vec<u8> = (0..LUN_BYTES).map(|i| (i % 253) as u8).collect();
    let scsi = h.conn.portal().targets[0].scsi.clone();
    scsi.lu(0)
        .expect("LUN 0")
        .volume()
        .store()
        .write(0, &pattern)
        .expect("fill");
    h
}

/// The response is CHECK CONDITION 05h/0Eh/03h with the residual between
/// EDTL and the CDB's length, and no byte of the LUN changed.
fn assert_refused_whole(h: &Harness, r: &[Rsp], before: &[u8], residual: (u8, u32), what: &str) {
    let rsp = r
        .iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        .unwrap_or_else(|| panic!("{what}: no response"));
    assert_eq!(
        rsp.bhs.scsi_status(),
        status::CHECK_CONDITION,
        "{what}: answered {:#04x} for a write whose EDTL differs from its transfer length",
        rsp.bhs.scsi_status()
    );
    let s = sense_of(rsp);
    assert_eq!(
        (s.key, s.asc, s.ascq),
        (sense_key::ILLEGAL_REQUEST, 0x0e, 0x03),
        "{what}: INVALID FIELD IN COMMAND INFORMATION UNIT"
    );
    assert_eq!(
        (rsp.bhs.flags() & 0x06, rsp.bhs.residual()),
        residual,
        "{what}: residual"
    );
    assert!(lun_bytes(h) == before, "{what}: the LUN changed");
}

fn write_verify10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x2e;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn verify10_bytchk(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x2f;
    c[1] = 0x02; // BYTCHK=1: the data-out is compared with the medium
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

const OVERFLOW: u8 = 0x04;
const UNDERFLOW: u8 = 0x02;
const WRITE_FINAL: u8 = 0xa1;

#[test]
fn a_short_edtl_write16_is_refused_whole() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    let cdb = ramslog_common::cdb::write16(0, 8, false);
    let (_, r) = h.command(&cdb, WRITE_FINAL, 512, &[0xbb; 512]);
    assert_refused_whole(
        &h,
        &r,
        &before,
        (OVERFLOW, 7 * 512),
        "WRITE(16), 8 blocks, EDTL 512",
    );
}

#[test]
fn a_long_edtl_write_is_refused_whole() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    let (_, r) = h.command(&write10(4, 1), WRITE_FINAL, 1024, &[0xbb; 1024]);
    assert_refused_whole(
        &h,
        &r,
        &before,
        (UNDERFLOW, 512),
        "WRITE(10), 1 block, EDTL 1024",
    );
}

#[test]
fn a_short_edtl_write_and_verify_is_refused_whole() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    let (_, r) = h.command(&write_verify10(8, 4), WRITE_FINAL, 1024, &[0xbb; 1024]);
    assert_refused_whole(
        &h,
        &r,
        &before,
        (OVERFLOW, 1024),
        "WRITE AND VERIFY(10), 4 blocks, EDTL 1024",
    );
}

#[test]
fn a_short_edtl_verify_with_bytchk_is_refused() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    // The first block's bytes match the medium; the second's were never sent.
    let first = before[..512].to_vec();
    let (_, r) = h.command(&verify10_bytchk(0, 2), WRITE_FINAL, 512, &first);
    assert_refused_whole(
        &h,
        &r,
        &before,
        (OVERFLOW, 512),
        "VERIFY(10) BYTCHK=1, 2 blocks, EDTL 512",
    );
}

#[test]
fn a_write_cdb_without_the_w_bit_is_refused() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    // R=1, W=0: the initiator says data flows in, the CDB says out.
    let (_, r) = h.command(&write10(0, 1), 0xc1, 512, &[]);
    assert_refused_whole(
        &h,
        &r,
        &before,
        (OVERFLOW, 512),
        "WRITE(10) with R set and W clear",
    );
}

#[test]
fn no_direction_with_a_transfer_length_is_rejected() {
    let mut h = patterned();
    let before = lun_bytes(&h);
    let (_, r) = h.command(&write10(0, 1), 0x81, 512, &[]);
    assert_eq!(
        r.first().and_then(|p| p.bhs.opcode()),
        Some(Opcode::Reject),
        "R=W=0 with EDTL 512 is a protocol error (RFC 7143 11.3.1)"
    );
    assert!(lun_bytes(&h) == before);
}
