//! The TCP driver allocates nothing per I/O after warm-up either: the real
//! `tcp::serve` loop on a tokio runtime of its own, reached over loopback by
//! a client that writes and reads from buffers it made beforehand, so that
//! every allocation counted during the measured I/Os is the daemon's.
//! (zero_alloc.rs covers the engine, the SCSI device and the store alone.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ramslog_common::iscsi::{Bhs, Opcode};
use ramslog_target::testkit;
use ramslog_tests::counting_alloc::CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

const IQN: &str = "iqn.2026-11.org.ramslog:alloc-tcp";

/// Read one PDU into `buf` (BHS, then its padded data segment); its BHS.
fn read_pdu(s: &mut TcpStream, buf: &mut [u8]) -> Bhs {
    s.read_exact(&mut buf[..48]).expect("read BHS");
    let mut raw = [0u8; 48];
    raw.copy_from_slice(&buf[..48]);
    let bhs = Bhs::from_raw(raw);
    let len = bhs.data_segment_len() as usize;
    let padded = len.div_ceil(4) * 4;
    s.read_exact(&mut buf[..padded]).expect("read data segment");
    bhs
}

/// One command; reads until its status (a SCSI Response, or a Data-In with
/// the S bit); that status.
fn command(
    s: &mut TcpStream,
    buf: &mut [u8],
    cmd: &mut Bhs,
    seq: &mut (u32, u32),
    data: &[u8],
) -> u8 {
    let (cmdsn, exp_statsn) = seq;
    cmd.set_itt(*cmdsn)
        .set_cmdsn(*cmdsn)
        .set_exp_statsn(*exp_statsn);
    cmd.set_data_segment_len(data.len() as u32);
    *cmdsn = cmdsn.wrapping_add(1);
    s.write_all(cmd.as_bytes()).expect("send command");
    s.write_all(data).expect("send data");
    loop {
        let r = read_pdu(s, buf);
        let done = match r.opcode() {
            Some(Opcode::ScsiResponse) => true,
            Some(Opcode::DataIn) => r.flags() & 0x01 != 0,
            other => panic!("unexpected {other:?}"),
        };
        if done {
            *exp_statsn = r.statsn().wrapping_add(1);
            return r.scsi_status();
        }
    }
}

#[test]
fn the_tcp_driver_allocates_nothing_per_io_after_warm_up() {
    let portal = testkit::RamPortal::new(IQN)
        .size(8 << 20)
        .service_times()
        .build();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    {
        let portal = portal.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let l = ramslog_target::tcp::listen(addr).expect("listen");
                ready_tx.send(()).expect("ready");
                ramslog_target::tcp::serve(l, portal).await;
            });
        });
    }
    ready_rx.recv().expect("the server starts");
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = vec![0u8; 1 << 20];

    // Login in one PDU: security skipped, straight to full feature.
    let mut keys = Vec::new();
    for kv in [
        "InitiatorName=iqn.2026-11.org.ramslog:alloc-client",
        &format!("TargetName={IQN}"),
        "SessionType=Normal",
        "ImmediateData=Yes",
        "InitialR2T=No",
        "MaxRecvDataSegmentLength=262144",
        "HeaderDigest=None",
        "DataDigest=None",
    ] {
        keys.extend_from_slice(kv.as_bytes());
        keys.push(0);
    }
    let mut login = Bhs::new(Opcode::LoginRequest);
    login
        .set_immediate(true)
        .set_flags(0x80 | (1 << 2) | 3)
        .set_itt(0x1000)
        .set_data_segment_len(keys.len() as u32);
    login.set_isid([0x80, 0, 0, 0, 0, 7]);
    s.write_all(login.as_bytes()).expect("login");
    keys.resize(keys.len().div_ceil(4) * 4, 0);
    s.write_all(&keys).expect("login keys");
    let r = read_pdu(&mut s, &mut buf);
    assert_eq!(
        (r.opcode(), r.login_status()),
        (Some(Opcode::LoginResponse), 0),
        "login"
    );
    let mut seq = (0u32, r.statsn().wrapping_add(1));

    let data = vec![0x5au8; 4096];
    let mut write = Bhs::new(Opcode::ScsiCommand);
    write.set_flags(0xa1).set_expected_data_len(4096);
    let mut read = Bhs::new(Opcode::ScsiCommand);
    read.set_flags(0xc1).set_expected_data_len(4096);
    let mut tur = Bhs::new(Opcode::ScsiCommand);
    tur.set_flags(0x81);
    tur.set_cdb(&[0u8; 6]);
    // Warm-up: the power-on unit attention first.
    for _ in 0..4 {
        command(&mut s, &mut buf, &mut tur, &mut seq, &[]);
    }
    let mut io = |s: &mut TcpStream, buf: &mut [u8], i: u32| -> u8 {
        let lba = ((i * 8) % 8192).to_be_bytes();
        let cdb = |op: u8| [op, 0, lba[0], lba[1], lba[2], lba[3], 0, 0, 8, 0];
        if i.is_multiple_of(2) {
            write.set_cdb(&cdb(0x2a));
            command(s, buf, &mut write, &mut seq, &data)
        } else {
            read.set_cdb(&cdb(0x28));
            command(s, buf, &mut read, &mut seq, &[])
        }
    };
    // Then buffers growing to their size.
    for i in 0..400 {
        assert_eq!(io(&mut s, &mut buf, i), 0, "warm-up I/O {i}");
    }
    let before = ALLOCATOR.allocations();
    for i in 0..2000 {
        assert_eq!(io(&mut s, &mut buf, i), 0, "I/O {i}");
    }
    let allocated = ALLOCATOR.allocations() - before;
    assert_eq!(
        allocated, 0,
        "{allocated} allocations in 2000 I/Os through the TCP driver"
    );
}
