//! Aborted writes never land: a task management function or PREEMPT AND
//! ABORT is answered only once no task it aborted can place another byte.
//! Over iSER the bytes are placed by the adapter's RDMA READ, so these tests
//! run the engine against `testkit::SimulatedHca`, which copies the host's
//! bytes into LUN memory when a READ completes.

use super::*;
use crate::testkit::SimulatedHca;

const LUN_BYTES: u64 = 1 << 20;
/// The illumos initiator offers four RDMA READ credits: further READs wait.
const ILLUMOS_CREDITS: usize = 4;
const HOST_A: &str = "iqn.2026-11.org.ramslog:host-a";
const HOST_B: &str = "iqn.2026-11.org.ramslog:host-b";
/// The region host A writes 0xAA to, and host B then 0xBB.
const REGION_LBA: u32 = 64;
const WRITES: u32 = 6;
const BLOCKS: u16 = 8;

fn lun_range(h: &Harness, lba: u32, blocks: u32) -> Vec<u8> {
    let mut v = vec![0u8; blocks as usize * 512];
    assert!(h.read_lun(u64::from(lba) * 512, &mut v));
    v
}

fn login_as(h: &mut Harness, name: &str, extra: &[(&str, &str)]) {
    let r = h.login_as(name, extra);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
}

/// PERSISTENT RESERVE OUT with its parameter list as immediate data (TCP).
fn pr_out_pdu(h: &mut Harness, service_action: u8, key: u64, sa_key: u64) -> Vec<Rsp> {
    let (cdb, params) = ramslog_common::cdb::persistent_reserve_out(service_action, key, sa_key);
    h.command(&cdb, 0x81 | 0x20, 24, &params).1
}

fn status_of(r: &[Rsp]) -> Option<u8> {
    r.iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        .map(|p| p.bhs.scsi_status())
}

/// A PERSISTENT RESERVE OUT of host A, whose parameter list the illumos
/// profile fetches by RDMA READ.
fn a_pr_out(a: &mut Harness, hca: &mut SimulatedHca, sa: u8, key: u64, sa_key: u64) -> u8 {
    let (cdb, params) = ramslog_common::cdb::persistent_reserve_out(sa, key, sa_key);
    let stag = 0x50 + u32::from(sa);
    hca.register(stag, 0x5000, params.to_vec());
    let (_, r) = a.iser_command(&cdb, 0xa1, 24, &[], iser_buf_at(stag, 0x5000), None);
    assert!(r.is_empty(), "the parameter list is fetched first");
    to_adapter(a, hca);
    assert!(hca.complete_one(&mut a.conn, a.now));
    status_of(&a.drain()).expect("a status")
}

/// Host A over iSER with the illumos limits (its connection controlled by
/// `a_control`); the SimulatedHca plays its adapter. A registers 0xaa and
/// holds the reservation (WRITE EXCLUSIVE); host B over TCP registers 0xbb:
/// the fence_scsi arrangement before B preempts A.
fn two_hosts(a_control: Arc<SessionControl>) -> (Harness, SimulatedHca, Harness) {
    let (mut a, mut hca, mut b) = two_hosts_logged_in(a_control);
    assert_eq!(a_pr_out(&mut a, &mut hca, 0, 0, 0xaa), status::GOOD);
    assert_eq!(a_pr_out(&mut a, &mut hca, 1, 0xaa, 0), status::GOOD);
    assert_eq!(
        status_of(&pr_out_pdu(&mut b, 0, 0, 0xbb)),
        Some(status::GOOD)
    );
    (a, hca, b)
}

/// [`two_hosts`] before anyone registers: both logged in, nothing else.
fn two_hosts_logged_in(a_control: Arc<SessionControl>) -> (Harness, SimulatedHca, Harness) {
    let portal = RamPortal::new(IQN).size(LUN_BYTES).build();
    let mut a = Harness::new_iser_from(portal.clone(), CmPeer::Illumos);
    a.conn = Connection::iser(
        portal.clone(),
        a.conn.info,
        a_control,
        a.now,
        8192,
        CmPeer::Illumos,
    );
    login_as(&mut a, HOST_A, &[]);
    let mut b = Harness::new(portal);
    login_as(
        &mut b,
        HOST_B,
        &[("ImmediateData", "Yes"), ("InitialR2T", "No")],
    );
    (a, SimulatedHca::new(ILLUMOS_CREDITS), b)
}

/// Hand the RDMA actions the harness collected to the adapter.
fn to_adapter(h: &mut Harness, hca: &mut SimulatedHca) {
    let actions: Vec<Action> = h.rdma.drain(..).map(|(_, a)| a).collect();
    let _ = hca.take(&h.conn, actions);
}

fn iser_buf_at(stag: u32, va: u64) -> Option<ramslog_common::iser::RemoteBuffer> {
    Some(ramslog_common::iser::RemoteBuffer { stag, va })
}

/// A sends six 4 KiB writes of 0xAA: four RDMA READs go in flight, two
/// wait for a credit.
fn a_writes(a: &mut Harness, hca: &mut SimulatedHca) {
    for i in 0..WRITES {
        let stag = 0x100 + i;
        let va = 0x10_0000 * u64::from(i + 1);
        hca.register(stag, va, vec![0xaa; usize::from(BLOCKS) * 512]);
        let lba = REGION_LBA + i * u32::from(BLOCKS);
        let (_, r) = a.iser_command(
            &write10(lba, BLOCKS),
            0xa1,
            u32::from(BLOCKS) * 512,
            &[],
            iser_buf_at(stag, va),
            None,
        );
        assert!(r.is_empty(), "the write waits for its data");
        to_adapter(a, hca);
    }
    assert_eq!((hca.in_flight(), hca.held()), (4, 2));
}

/// B's PREEMPT AND ABORT of A, then B's WRITE of 0xBB over the region.
fn b_preempts_and_overwrites(b: &mut Harness) -> Vec<Rsp> {
    pr_out_pdu(b, 5, 0xbb, 0xaa)
}

fn b_writes_region(b: &mut Harness) {
    let bytes = WRITES * u32::from(BLOCKS) * 512;
    // Immediate data carries the first 8 KiB; the rest comes by R2T.
    let cdb = write10(REGION_LBA, (WRITES * u32::from(BLOCKS)) as u16);
    let (itt, cmd) = b.scsi_bhs(&cdb, 0xa1, bytes);
    let data = vec![0xbb; bytes as usize];
    let mut r = b.send(&cmd, &data[..8192]);
    loop {
        if let Some(p) = r
            .iter()
            .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        {
            assert_eq!(p.bhs.scsi_status(), status::GOOD, "B's write");
            return;
        }
        let r2t = r
            .iter()
            .find(|p| p.bhs.opcode() == Some(Opcode::ReadyToTransfer))
            .expect("an R2T for the rest");
        let (off, len) = (r2t.bhs.buffer_offset(), r2t.bhs.residual());
        let d = Bhs::data_out(itt, r2t.bhs.ttt(), off, 0, true);
        r = b.send(&d, &data[off as usize..(off + len) as usize]);
    }
}

#[test]
fn preempt_and_abort_over_iser_is_answered_only_when_the_aborted_reads_cannot_land() {
    let (mut a, mut hca, mut b) = two_hosts(SessionControl::new());
    a_writes(&mut a, &mut hca);
    let r = b_preempts_and_overwrites(&mut b);
    assert_eq!(
        status_of(&r),
        None,
        "PREEMPT AND ABORT answered while four of the aborted host's RDMA READs are in flight"
    );
    // A's adapter finishes what it had posted: those bytes land, before
    // the answer. The two held READs are never posted.
    while hca.complete_one(&mut a.conn, a.now) {}
    assert!(
        a.drain()
            .iter()
            .all(|p| p.bhs.opcode() != Some(Opcode::ScsiResponse)),
        "an aborted write got a status"
    );
    assert_eq!(hca.held(), 0);
    b.now += Duration::from_millis(1);
    b.conn.handle(b.now, Input::Timeout);
    assert_eq!(status_of(&b.drain()), Some(status::GOOD), "answered now");
    b_writes_region(&mut b);
    let region = lun_range(&b, REGION_LBA, WRITES * u32::from(BLOCKS));
    assert!(
        region.iter().all(|x| *x == 0xbb),
        "an aborted write of the preempted host landed over the new holder's data"
    );
}

#[test]
fn a_hung_hosts_transfers_are_cut_off_before_the_preempt_is_answered() {
    let a_control = SessionControl::new();
    let (mut a, mut hca, mut b) = two_hosts(a_control.clone());
    a_writes(&mut a, &mut hca);
    let start = b.now;
    let r = b_preempts_and_overwrites(&mut b);
    assert_eq!(
        status_of(&r),
        None,
        "PREEMPT AND ABORT answered while the hung host's RDMA READs are in flight"
    );
    // A completes nothing (a partitioned host). No plain timeout answers.
    for ms in [500u64, 1000, 1900] {
        b.now = start + Duration::from_millis(ms);
        b.conn.handle(b.now, Input::Timeout);
        assert_eq!(status_of(&b.drain()), None, "answered on a plain timeout");
    }
    assert!(!a_control.is_terminated());
    // Past the cut-off the engine ends A's connection...
    b.now = start + ABORT_CUT_OFF;
    b.conn.handle(b.now, Input::Timeout);
    assert_eq!(
        status_of(&b.drain()),
        None,
        "answered before A's connection is gone"
    );
    assert!(
        a_control.is_terminated(),
        "the hung host's connection is ended"
    );
    // ...whose queue pair is destroyed, its posted READs flushed: none of
    // their bytes lands. Then its permit goes, and B is answered.
    hca.destroy();
    a.conn.handle(Instant::now(), Input::Closed);
    a_control.release_for_test();
    b.now += Duration::from_millis(1);
    b.conn.handle(b.now, Input::Timeout);
    assert_eq!(status_of(&b.drain()), Some(status::GOOD));
    b_writes_region(&mut b);
    assert!(lun_range(&b, REGION_LBA, WRITES * u32::from(BLOCKS))
        .iter()
        .all(|x| *x == 0xbb));
}

#[test]
fn abort_task_of_a_write_whose_read_is_in_flight_waits_for_it() {
    let (mut a, mut hca, _b) = two_hosts(SessionControl::new());
    let first_write = a.itt + 1;
    a_writes(&mut a, &mut hca);
    // A aborts its own first write, whose READ is in flight.
    let t = a.tmf(tmf::ABORT_TASK, first_write);
    let r = a.send(&t, &[]);
    assert!(
        r.iter()
            .all(|p| p.bhs.opcode() != Some(Opcode::TaskMgmtResponse)),
        "ABORT TASK answered while the task's RDMA READ is in flight"
    );
    while hca.complete_one(&mut a.conn, a.now) {}
    let r = a.drain();
    assert!(
        r.iter()
            .any(|p| p.bhs.opcode() == Some(Opcode::TaskMgmtResponse)),
        "answered once the READ completed"
    );
}

/// The responses in `r`, as (ITT, status).
fn statuses(r: &[Rsp]) -> Vec<(u32, u8)> {
    r.iter()
        .filter(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        .map(|p| (p.bhs.itt(), p.bhs.scsi_status()))
        .collect()
}

/// Shutdown over TCP: a write whose R2T went out before the volume was
/// fenced and whose Data-Out arrives after it gets no status (the host
/// retries it after the restart) and the connection closes.
#[test]
fn solicited_data_out_after_the_shutdown_fence_gets_no_status() {
    let mut h = Harness::new(RamPortal::new(IQN).size(LUN_BYTES).build());
    login_as(
        &mut h,
        HOST_B,
        &[("InitialR2T", "Yes"), ("ImmediateData", "No")],
    );
    let (itt, r) = h.command(&write10(REGION_LBA, BLOCKS), 0xa1, 4096, &[]);
    let r2t = r
        .iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::ReadyToTransfer))
        .expect("an R2T for the write");
    let ttt = r2t.bhs.ttt();
    let scsi = h.conn.portal().targets[0].scsi.clone();
    scsi.lu(0).expect("LUN 0").volume().fence();
    let d = Bhs::data_out(itt, ttt, 0, 0, true);
    let r = h.send(&d, &[0x5e; 4096]);
    assert_eq!(statuses(&r), vec![], "a status went out after the fence");
    assert!(h.closed, "the connection closes instead");
}

/// Shutdown over iSER: RDMA READs of a write are in flight when the volume
/// is fenced; when they complete, the write gets no status and the
/// connection closes. A write acknowledged before the fence stays so.
#[test]
fn rdma_reads_completing_after_the_shutdown_fence_get_no_status() {
    let portal = RamPortal::new(IQN).size(LUN_BYTES).build();
    let mut a = Harness::new_iser_from(portal, CmPeer::Illumos);
    login_as(&mut a, HOST_A, &[]);
    let mut hca = SimulatedHca::new(ILLUMOS_CREDITS);
    let (before, _) = {
        hca.register(0x99, 0x9_0000, vec![0x11; 4096]);
        let r = a.iser_command(
            &write10(0, BLOCKS),
            0xa1,
            4096,
            &[],
            iser_buf_at(0x99, 0x9_0000),
            None,
        );
        to_adapter(&mut a, &mut hca);
        r
    };
    assert!(hca.complete_one(&mut a.conn, a.now));
    assert_eq!(statuses(&a.drain()), vec![(before, status::GOOD)]);
    a_writes(&mut a, &mut hca);
    let scsi = a.conn.portal().targets[0].scsi.clone();
    scsi.lu(0).expect("LUN 0").volume().fence();
    let mut after = Vec::new();
    while hca.complete_one(&mut a.conn, a.now) {
        after.extend(a.drain());
        to_adapter(&mut a, &mut hca);
    }
    assert_eq!(
        statuses(&after),
        vec![],
        "a status went out after the fence"
    );
    assert!(a.closed, "the connection closes instead");
}

/// LOGICAL UNIT RESET from host B (TCP) while host A's writes (iSER) have
/// RDMA READs in flight and held: A's tasks end without status (TAS=0),
/// the held READs are never posted, B's reset is answered only once the
/// posted ones completed, and nothing of A lands over what B writes next.
/// Every host then sees the reset once, as a unit attention (29h/03h).
#[test]
fn logical_unit_reset_aborts_the_other_hosts_tasks() {
    let (mut a, mut hca, mut b) = two_hosts_logged_in(SessionControl::new());
    a_writes(&mut a, &mut hca);
    let t = b.tmf(tmf::LOGICAL_UNIT_RESET, RESERVED_TAG);
    let tmf_answer = |r: &[Rsp]| {
        r.iter()
            .find(|p| p.bhs.opcode() == Some(Opcode::TaskMgmtResponse))
            .map(|p| p.bhs.response())
    };
    let r = b.send(&t, &[]);
    assert_eq!(
        tmf_answer(&r),
        None,
        "LOGICAL UNIT RESET answered while four of A's RDMA READs are in flight"
    );
    while hca.complete_one(&mut a.conn, a.now) {}
    assert_eq!(
        statuses(&a.drain()),
        vec![],
        "an aborted write got a status"
    );
    assert_eq!(hca.held(), 0, "the held READs are dropped, never posted");
    b.now += Duration::from_millis(1);
    b.conn.handle(b.now, Input::Timeout);
    assert_eq!(tmf_answer(&b.drain()), Some(tmf::RSP_COMPLETE));
    let tur = [0u8; 6];
    let reset_seen = |r: &[Rsp]| {
        let p = r
            .iter()
            .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
            .expect("a status");
        let s = sense_of(p);
        (p.bhs.scsi_status(), s.key, s.asc, s.ascq)
            == (
                status::CHECK_CONDITION,
                sense_key::UNIT_ATTENTION,
                0x29,
                0x03,
            )
    };
    assert!(
        reset_seen(&b.command(&tur, 0x81, 0, &[]).1),
        "B's unit attention"
    );
    b_writes_region(&mut b);
    assert!(
        lun_range(&b, REGION_LBA, WRITES * u32::from(BLOCKS))
            .iter()
            .all(|x| *x == 0xbb),
        "an aborted write of host A landed over host B's data"
    );
    assert!(
        reset_seen(&a.iser_command(&tur, 0x81, 0, &[], None, None).1),
        "A's unit attention"
    );
    let (_, r) = a.iser_command(&tur, 0x81, 0, &[], None, None);
    assert_eq!(status_of(&r), Some(status::GOOD), "reported once");
}

/// iSER teardown with RDMA READs in flight: host A's queue pair is
/// destroyed while four READs of its writes are posted and two held. None
/// of those writes is acknowledged, no byte of them lands (a flushed READ
/// places nothing), a completion the engine hears of after the teardown
/// changes nothing, and another host's reset, waiting for those READs, is
/// answered once they are flushed.
#[test]
fn iser_teardown_with_reads_in_flight_acknowledges_and_places_nothing() {
    let a_control = SessionControl::new();
    let (mut a, mut hca, mut b) = two_hosts_logged_in(a_control.clone());
    let first = a.itt + 1;
    a_writes(&mut a, &mut hca);
    let transfers = a.conn.transfers().expect("a session");
    assert_eq!(transfers.in_flight(), 4, "four READs into the LUN posted");
    let t = b.tmf(tmf::LOGICAL_UNIT_RESET, RESERVED_TAG);
    let answered = |r: &[Rsp]| {
        r.iter()
            .any(|p| p.bhs.opcode() == Some(Opcode::TaskMgmtResponse))
    };
    assert!(!answered(&b.send(&t, &[])), "answered with READs in flight");

    // The connection fails: the driver destroys the queue pair (its posted
    // READs are flushed) and the engine hears the transport is gone.
    hca.destroy();
    a.conn.handle(Instant::now(), Input::Closed);
    a_control.release_for_test();
    assert_eq!(transfers.in_flight(), 0, "the flushed READs are over");
    assert_eq!(statuses(&a.drain()), vec![], "a write was acknowledged");
    // A completion that arrives after all is ignored.
    a.conn.handle(
        a.now,
        Input::RdmaReadDone {
            tag: first,
            data: &[],
        },
    );
    assert_eq!(
        statuses(&a.drain()),
        vec![],
        "a late completion was acknowledged"
    );
    assert!(
        lun_range(&b, REGION_LBA, WRITES * u32::from(BLOCKS))
            .iter()
            .all(|x| *x == 0),
        "a byte of a flushed READ landed"
    );
    b.now += Duration::from_millis(1);
    b.conn.handle(b.now, Input::Timeout);
    assert!(
        answered(&b.drain()),
        "the reset is answered once the READs are flushed"
    );
}
