//! With `--verify-kept-memory` a write counts itself in on the pages it may
//! place bytes into, and out once it is over. A write that never completes
//! (refused after its plan, aborted, its data damaged, its connection gone
//! with an RDMA READ under way) must count itself out too: a page left
//! counted in is never checksummed again, and after a crash the check
//! skips it as "in flight", so a wild write there would be served READY.

use super::*;

const LUN_BYTES: u64 = 1 << 20;

/// The LUN's pages a write is counted in now.
fn counted_in(h: &Harness) -> u64 {
    lun_volume(h).pages_being_written()
}

fn tcp_session() -> Harness {
    let portal = RamPortal::new(IQN).size(LUN_BYTES).page_crcs().build();
    let mut h = Harness::new(portal);
    let r = h.login(&[
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("MaxRecvDataSegmentLength", "8192"),
    ]);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    h
}

/// A WRITE (10) of 8 blocks at LBA 8 waiting for its unsolicited data:
/// its one page is counted in.
fn waiting_write(h: &mut Harness) -> u32 {
    let (itt, r) = h.command(&write10(8, 8), 0x21, 4096, &[]);
    assert!(r.is_empty(), "the write waits for its data");
    assert_eq!(counted_in(h), 1, "the waiting write is counted in");
    itt
}

/// A 16-byte CDB: `opcode`, LBA, and `blocks` in bytes 10..14 (WRITE SAME
/// (16)); COMPARE AND WRITE puts its block count in byte 13.
fn cdb16(opcode: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = opcode;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// A write that completes counts itself out, and so do WRITE SAME and
/// COMPARE AND WRITE, which write inside their execution.
#[test]
fn a_completed_write_counts_its_pages_out() {
    let mut h = tcp_session();
    let itt = waiting_write(&mut h);
    let d = Bhs::data_out(itt, RESERVED_TAG, 0, 0, true);
    let r = h.send(&d, &[0x5a; 4096]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    let (_, r) = h.command(&cdb16(0x93, 64, 16), 0xa0, 512, &[0x33; 512]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    let mut cdb = cdb16(0x89, 8, 0);
    cdb[13] = 1;
    let mut data = vec![0x5a; 512];
    data.extend_from_slice(&[0x77; 512]);
    let (_, r) = h.command(&cdb, 0xa0, 1024, &data);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    assert_eq!(counted_in(&h), 0);
}

/// A write refused after the SCSI device planned it (its EDTL does not
/// match its blocks) places nothing and leaves nothing counted in.
#[test]
fn a_write_refused_after_its_plan_leaves_nothing_counted_in() {
    let mut h = tcp_session();
    let (_, r) = h.command(&write10(8, 8), 0xa0, 2048, &[]);
    assert_eq!(r[0].bhs.scsi_status(), status::CHECK_CONDITION);
    assert_eq!(counted_in(&h), 0, "a refused write left pages counted in");
}

#[test]
fn an_aborted_write_counts_its_pages_out() {
    let mut h = tcp_session();
    let itt = waiting_write(&mut h);
    let t = h.tmf(tmf::ABORT_TASK, itt);
    let r = h.send(&t, &[]);
    assert_eq!(r[0].bhs.response(), tmf::RSP_COMPLETE);
    assert_eq!(counted_in(&h), 0, "an aborted write left pages counted in");
}

#[test]
fn a_write_whose_data_failed_its_digest_counts_its_pages_out() {
    let mut h = tcp_session();
    let itt = waiting_write(&mut h);
    let d = Bhs::data_out(itt, RESERVED_TAG, 0, 0, true);
    let mut damaged = d;
    damaged.set_data_segment_len(4096);
    h.conn.handle(h.now, Input::DataDigestError(&damaged));
    let r = h.drain();
    let status_of = r
        .iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        .map(|p| p.bhs.scsi_status());
    assert_eq!(status_of, Some(status::CHECK_CONDITION));
    assert_eq!(
        counted_in(&h),
        0,
        "a write with damaged data left pages counted in"
    );
}

#[test]
fn a_write_whose_connection_ended_counts_its_pages_out() {
    let mut h = tcp_session();
    waiting_write(&mut h);
    h.conn.handle(h.now, Input::Closed);
    assert_eq!(
        counted_in(&h),
        0,
        "a write whose connection ended left pages counted in"
    );
}

/// Over iSER a failed RDMA READ ends the connection (the queue pair is in
/// error): the write it was fetching counts itself out.
#[test]
fn a_write_whose_rdma_read_failed_counts_its_pages_out() {
    let portal = RamPortal::new(IQN).size(LUN_BYTES).page_crcs().build();
    let mut h = Harness::new_iser(portal);
    let r = h.login_response(INI, &[("RDMAExtensions", "Yes")]);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    h.clear_unit_attention();
    let (_, r) = h.iser_command(
        &write10(8, 8),
        scsi_cmd_flags(true, false),
        4096,
        &[],
        iser_buf(0x9000),
        None,
    );
    assert!(r.is_empty(), "waits for the RDMA READ");
    assert!(
        matches!(h.rdma.last(), Some((_, Action::RdmaRead { .. }))),
        "an RDMA READ is under way"
    );
    assert_eq!(counted_in(&h), 1);
    h.conn.handle(h.now, Input::Closed);
    assert_eq!(
        counted_in(&h),
        0,
        "a write whose RDMA READ failed left pages counted in"
    );
}
