//! The target's own cost per command, with no transport: decode → iSCSI
//! engine → SCSI device → store → encoded response, for one 4 KiB WRITE (with
//! immediate data) and one 4 KiB READ, on the TCP action path (Data-In copied
//! from the LUN into the send buffer) and the iSER path (the READ's data is an
//! RDMA WRITE action the HCA would execute; the response is encoded into a
//! send slot). On real InfiniBand this is added to every ZFS log write.
//! Commands are always counted; "+metrics" also measures service times, as
//! the daemon does with `--metrics` (two TSC reads per command).
//!
//!     cargo bench -p ramslog-target --bench engine

use std::hint::black_box;
use std::time::Instant;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use ramslog_common::iscsi::{Bhs, Opcode, BHS_LEN};
use ramslog_common::iser::{Header, Message, RemoteBuffer, HEADER_LEN};
use ramslog_target::iscsi;
use ramslog_target::iscsi::engine::{Action, Connection, Input, OutPdu};
use ramslog_target::{rdma, testkit};

const BLOCKS: u32 = 8;
const LUN_BLOCKS: u32 = 16384;
const PAGE: usize = 4096;

fn logged_in(iser: bool, metrics: bool) -> Connection {
    let (name, size) = ("iqn.2026-11.org.ramslog:bench", u64::from(LUN_BLOCKS) * 512);
    let portal = testkit::RamPortal::new(name).size(size);
    let portal = if metrics {
        portal.service_times()
    } else {
        portal
    }
    .build();
    let keys = [
        ("ImmediateData", "Yes"),
        ("InitialR2T", "Yes"),
        ("MaxRecvDataSegmentLength", "262144"),
    ];
    testkit::logged_in(portal, iser.then_some(8192), &keys, Instant::now())
}

/// The received bytes of one command: [iSER header +] BHS + immediate data.
struct Wire {
    /// `len` bytes from `at`, which is page-aligned as a receive slot is: a
    /// 4 KiB copy's speed depends on where its source sits in a page
    /// (4K aliasing), so a heap-placed buffer would make the numbers depend
    /// on allocation history.
    storage: Vec<u8>,
    at: usize,
    len: usize,
    bhs_at: usize,
    cmdsn: u32,
}

impl Wire {
    fn new(iser: bool, write: bool) -> Wire {
        let remote = Some(RemoteBuffer {
            stag: 0x1234,
            va: 0x7f00_0000_0000,
        });
        let mut bytes = Vec::new();
        if iser {
            let h = if write {
                Header::Control {
                    write: remote,
                    read: None,
                }
            } else {
                Header::Control {
                    write: None,
                    read: remote,
                }
            };
            bytes.resize(HEADER_LEN, 0);
            h.encode_into(&mut bytes).expect("header");
        }
        let bhs_at = bytes.len();
        let mut b = Bhs::new(Opcode::ScsiCommand);
        let cdb = [
            if write { 0x2a } else { 0x28 },
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            BLOCKS as u8,
            0,
        ];
        b.set_cdb(&cdb);
        b.set_flags(if write { 0xa1 } else { 0xc1 })
            .set_expected_data_len(BLOCKS * 512)
            .set_data_segment_len(if write { BLOCKS * 512 } else { 0 });
        bytes.extend_from_slice(b.as_bytes());
        if write {
            bytes.resize(bytes.len() + (BLOCKS * 512) as usize, 0x5a);
        }
        let mut storage = vec![0u8; bytes.len() + PAGE];
        let at = storage.as_ptr().align_offset(PAGE);
        storage[at..at + bytes.len()].copy_from_slice(&bytes);
        Wire {
            storage,
            at,
            len: bytes.len(),
            bhs_at,
            cmdsn: 0,
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.storage[self.at..self.at + self.len]
    }

    /// Give the next command its CmdSN, ITT and LBA, as an initiator would.
    fn next(&mut self) {
        let bhs_at = self.at + self.bhs_at;
        let b = &mut self.storage[bhs_at..bhs_at + BHS_LEN];
        b[16..20].copy_from_slice(&self.cmdsn.to_be_bytes());
        b[24..28].copy_from_slice(&self.cmdsn.to_be_bytes());
        let lba = (self.cmdsn * BLOCKS) % (LUN_BLOCKS - BLOCKS);
        b[34..38].copy_from_slice(&lba.to_be_bytes());
        self.cmdsn = self.cmdsn.wrapping_add(1);
    }
}

/// The SCSI status a response PDU carries, if it carries one.
fn status(p: &OutPdu) -> Option<u8> {
    let op = p.bhs.opcode();
    (op == Some(Opcode::ScsiResponse) || (op == Some(Opcode::DataIn) && p.bhs.flags() & 1 != 0))
        .then_some(p.bhs.scsi_status())
}

/// One command the way the TCP driver handles it; returns its SCSI status.
// Never inlined: tests/bench/instructions.sh counts the instructions of
// each call of it.
#[inline(never)]
fn tcp_command(conn: &mut Connection, wire: &Wire, wbuf: &mut Vec<u8>) -> Option<u8> {
    let now = Instant::now();
    let Ok(bhs) = Bhs::decode(&wire.bytes()[..BHS_LEN]) else {
        panic!("bad BHS");
    };
    conn.handle(now, Input::pdu(&bhs, &[], &wire.bytes()[BHS_LEN..]));
    wbuf.clear();
    let mut st = None;
    while let Some(a) = conn.poll_action() {
        match a {
            Action::Send(p) => {
                st = status(&p).or(st);
                assert!(iscsi::tcp::encode_pdu(conn, &p, wbuf));
                if let Some(served) = p.served {
                    conn.handle(now, Input::served_now(served));
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    black_box(&wbuf);
    st
}

/// One command the way the iSER driver handles it (the RDMA WRITE of read
/// data is the HCA's work); returns its SCSI status.
// Never inlined: tests/bench/instructions.sh counts the instructions of
// each call of it.
#[inline(never)]
fn iser_command(conn: &mut Connection, wire: &Wire, slot: &mut [u8]) -> Option<u8> {
    let now = Instant::now();
    let Ok(Message::Pdu(pdu)) = Message::parse(wire.bytes(), conn.max_rx_data_segment()) else {
        panic!("bad iSER message");
    };
    conn.handle(now, Input::iser(&pdu));
    let mut st = None;
    while let Some(a) = conn.poll_action() {
        match a {
            Action::Send(p) => {
                st = status(&p).or(st);
                black_box(rdma::encode_pdu(conn, &p, slot).expect("encode"));
                if let Some(served) = p.served {
                    conn.handle(now, Input::served_now(served));
                }
            }
            Action::RdmaWrite { data, .. } => {
                black_box(data);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    st
}

/// Measure one case: `command` runs the next command of `wire` and returns
/// its status. The power-on unit attention goes to the first command; the
/// measured path must be the successful one.
fn measure(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: String,
    mut wire: Wire,
    mut command: impl FnMut(&Wire) -> Option<u8>,
) {
    wire.next();
    command(&wire);
    wire.next();
    assert_eq!(command(&wire), Some(0));
    g.bench_function(name, |b| {
        b.iter(|| {
            wire.next();
            command(&wire);
        })
    });
}

fn engine(c: &mut Criterion) {
    let mut g = c.benchmark_group("4KiB command");
    g.throughput(Throughput::Elements(1));
    for (name, write, metrics) in [
        ("write", true, false),
        ("read", false, false),
        ("write +metrics", true, true),
        ("read +metrics", false, true),
    ] {
        let mut conn = logged_in(false, metrics);
        let mut wbuf = Vec::with_capacity(64 * 1024);
        measure(
            &mut g,
            format!("tcp {name}"),
            Wire::new(false, write),
            |w| tcp_command(&mut conn, w, &mut wbuf),
        );
        let mut conn = logged_in(true, metrics);
        let mut slot = vec![0u8; ramslog_common::iser::peer::ILLUMOS_MSG_LEN];
        measure(
            &mut g,
            format!("iser {name}"),
            Wire::new(true, write),
            |w| iser_command(&mut conn, w, &mut slot),
        );
    }
    g.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);
