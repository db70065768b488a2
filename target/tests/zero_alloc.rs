//! The data path allocates nothing per I/O after warm-up: 4 KiB WRITE (with
//! immediate data) and READ through the engine, the SCSI device and the store,
//! counted by a global allocator, for both transports (over iSER, also a
//! 64 KiB WRITE whose data is RDMA-read). The metrics are on, as in the
//! daemon: every command is counted and its service time recorded the way
//! the drivers do once a response is out.

use std::time::Instant;

use ramslog_common::iscsi::{Bhs, Opcode};
use ramslog_common::iser::RemoteBuffer;
use ramslog_target::iscsi::engine::{Action, Connection, Input, OutData, ReadDest, RemoteBuffers};
use ramslog_target::metrics::CommandKind;
use ramslog_target::testkit;
use ramslog_tests::counting_alloc::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// Drain the engine's actions without allocating (completing RDMA READs as
/// the HCA would); returns (PDUs, SCSI status of the last response).
fn drain(conn: &mut Connection, now: Instant) -> (usize, Option<u8>) {
    let (mut n, mut st) = (0, None);
    while let Some(a) = conn.poll_action() {
        match a {
            Action::Send(p) => {
                n += 1;
                if let Some(served) = p.served {
                    conn.handle(now, Input::served_now(served));
                }
                if matches!(p.bhs.opcode(), Some(Opcode::ScsiResponse)) || p.bhs.flags() & 1 != 0 {
                    st = Some(p.bhs.scsi_status());
                }
                if let OutData::Store { len, .. } = p.data {
                    assert_eq!(len, 4096);
                }
            }
            Action::RdmaWrite { data, .. } => {
                assert!(matches!(data, OutData::Store { len: 4096, .. }));
            }
            Action::RdmaRead { tag, dest, .. } => {
                assert!(matches!(dest, ReadDest::Store { .. }));
                conn.handle(now, Input::RdmaReadDone { tag, data: &[] });
            }
            Action::Close => panic!("connection closed"),
        }
    }
    (n, st)
}

/// One test: the allocation counter is global, so a second test running on
/// another thread would be counted too.
#[test]
fn zero_allocations_per_io_after_warm_up() {
    io_loop(false);
    io_loop(true);
}

fn io_loop(iser: bool) {
    let now = Instant::now();
    let portal = testkit::RamPortal::new("iqn.2026-11.org.ramslog:alloc")
        .size(8 << 20)
        .service_times()
        .build();
    let keys = [
        ("ImmediateData", "Yes"),
        ("InitialR2T", "No"),
        ("MaxRecvDataSegmentLength", "262144"),
    ];
    let mut conn = testkit::logged_in(portal.clone(), iser.then_some(8192), &keys, now);
    let volume = portal.core.volumes.iter().next().expect("LUN 0").clone();
    let counted = || {
        let t = volume.metrics().totals();
        let w = CommandKind::Write as usize;
        (t.commands[w], t.service[w].count())
    };

    let data = vec![0x5au8; 4096];
    let mut cmdsn = 0u32;
    let remote = Some(RemoteBuffer {
        stag: 7,
        va: 0x10_0000,
    });
    // Over iSER every fourth write is 64 KiB: 4 KiB immediate, the rest RDMA-read.
    let mut io = |conn: &mut Connection, write: bool, lba: u32| {
        let big = iser && write && lba.is_multiple_of(32);
        let blocks: u8 = if big { 128 } else { 8 };
        let mut b = Bhs::new(Opcode::ScsiCommand);
        let l = lba.to_be_bytes();
        let cdb = [
            if write { 0x2a } else { 0x28 },
            0,
            l[0],
            l[1],
            l[2],
            l[3],
            0,
            0,
            blocks,
            0,
        ];
        b.set_cdb(&cdb);
        b.set_flags(if write { 0xa1 } else { 0xc1 })
            .set_itt(cmdsn)
            .set_cmdsn(cmdsn)
            .set_expected_data_len(u32::from(blocks) * 512);
        cmdsn = cmdsn.wrapping_add(1);
        let payload: &[u8] = if write { &data } else { &[] };
        b.set_data_segment_len(payload.len() as u32);
        if iser {
            let (w, r) = if write {
                (remote, None)
            } else {
                (None, remote)
            };
            conn.handle(
                now,
                Input::Pdu {
                    bhs: &b,
                    ahs: &[],
                    data: payload,
                    buffers: RemoteBuffers { write: w, read: r },
                },
            );
        } else {
            conn.handle(now, Input::pdu(&b, &[], payload));
        }
        drain(conn, now)
    };
    // Warm-up: the power-on unit attention, buffers growing to their size.
    for i in 0..200 {
        io(&mut conn, i % 2 == 0, (i * 8) % 8192);
    }
    let writes_before = counted();
    let before = ALLOCATOR.allocations();
    for i in 0..2000 {
        let (pdus, st) = io(&mut conn, i % 2 == 0, (i * 8) % 8192);
        assert_eq!(
            (pdus, st),
            (1, Some(0)),
            "one PDU with GOOD status per command"
        );
    }
    let after = ALLOCATOR.allocations();
    assert_eq!(after - before, 0, "allocations during 2000 4 KiB commands");
    let writes_after = counted();
    assert_eq!(
        (
            writes_after.0 - writes_before.0,
            writes_after.1 - writes_before.1
        ),
        (1000, 1000),
        "every WRITE counted, with its service time"
    );
}
