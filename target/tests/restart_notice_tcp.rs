//! A planned restart tells each host when to log in again (an Async Message,
//! AsyncEvent 3) before its connection drops, also when one of its writes
//! meets the restart's fence first. Without the notice open-iscsi waits its
//! DefaultTime2Wait (2 s) before reconnecting: the lab saw that stall in one
//! of five restarts under sync writes.
//!
//! The real TCP driver (`tcp::serve`) and the test's client share one
//! current-thread runtime, so the driver runs only while the client waits:
//! a write is in the driver's socket when the restart terminates its
//! connection and fences the volume, and the driver finds both at once.
//! Which it takes first is its own choice, so the test goes round enough
//! times to meet both orders.

use std::net::SocketAddr;
use std::time::Duration;

use ramslog_common::iscsi::{Bhs, Opcode};
use ramslog_target::testkit;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const IQN: &str = "iqn.2026-11.org.ramslog:notice-tcp";

/// Rounds: the driver takes the write first in about a third of them.
const ROUNDS: usize = 48;

async fn read_pdu(s: &mut TcpStream) -> Option<Bhs> {
    let mut raw = [0u8; 48];
    s.read_exact(&mut raw).await.ok()?;
    let bhs = Bhs::from_raw(raw);
    let padded = (bhs.data_segment_len() as usize).div_ceil(4) * 4;
    let mut data = vec![0u8; padded];
    s.read_exact(&mut data).await.ok()?;
    Some(bhs)
}

async fn send(s: &mut TcpStream, bhs: &Bhs, data: &[u8]) {
    s.write_all(bhs.as_bytes()).await.expect("send");
    let mut padded = data.to_vec();
    padded.resize(data.len().div_ceil(4) * 4, 0);
    s.write_all(&padded).await.expect("send data");
}

/// A logged-in normal session (security skipped, immediate data on); the
/// next (CmdSN, ExpStatSN).
async fn login(addr: SocketAddr) -> (TcpStream, (u32, u32)) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut keys = Vec::new();
    for kv in [
        "InitiatorName=iqn.2026-11.org.ramslog:notice-client",
        &format!("TargetName={IQN}"),
        "SessionType=Normal",
        "ImmediateData=Yes",
        "InitialR2T=No",
        "HeaderDigest=None",
        "DataDigest=None",
    ] {
        keys.extend_from_slice(kv.as_bytes());
        keys.push(0);
    }
    let mut req = Bhs::new(Opcode::LoginRequest);
    req.set_immediate(true)
        .set_flags(0x80 | (1 << 2) | 3)
        .set_itt(0x1000)
        .set_data_segment_len(keys.len() as u32);
    req.set_isid([0x80, 0, 0, 0, 0, 9]);
    send(&mut s, &req, &keys).await;
    let r = read_pdu(&mut s).await.expect("login response");
    assert_eq!(
        (r.opcode(), r.login_status()),
        (Some(Opcode::LoginResponse), 0),
        "login"
    );
    let seq = (0, r.statsn().wrapping_add(1));
    (s, seq)
}

/// TEST UNIT READY until GOOD: the power-on unit attention is answered
/// first, and a write must meet the volume, not the attention.
async fn clear_unit_attention(s: &mut TcpStream, seq: &mut (u32, u32)) {
    for _ in 0..4 {
        let mut tur = Bhs::new(Opcode::ScsiCommand);
        tur.set_flags(0x81)
            .set_itt(seq.0)
            .set_cmdsn(seq.0)
            .set_exp_statsn(seq.1);
        tur.set_cdb(&[0u8; 6]);
        seq.0 += 1;
        send(s, &tur, &[]).await;
        let r = read_pdu(s).await.expect("TEST UNIT READY answered");
        assert_eq!(r.opcode(), Some(Opcode::ScsiResponse));
        seq.1 = r.statsn().wrapping_add(1);
        if r.scsi_status() == 0 {
            return;
        }
    }
    panic!("TEST UNIT READY never GOOD");
}

/// A 4 KiB WRITE(10) at LBA 0 with its data as immediate data.
fn write_command(seq: (u32, u32)) -> Bhs {
    let mut w = Bhs::new(Opcode::ScsiCommand);
    w.set_flags(0xa1)
        .set_expected_data_len(4096)
        .set_itt(seq.0)
        .set_cmdsn(seq.0)
        .set_exp_statsn(seq.1);
    w.set_cdb(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0]);
    w.set_data_segment_len(4096);
    w
}

#[tokio::test(flavor = "current_thread")]
async fn a_write_that_meets_a_restarts_fence_still_gets_the_notice() {
    // Rounds in which the driver took the write first: its bytes landed in
    // the LUN and met the fence (no status). The race this test is about.
    let mut met_the_fence = 0;
    for round in 0..ROUNDS {
        let portal = testkit::RamPortal::new(IQN).size(1 << 20).build();
        let listener =
            ramslog_target::tcp::listen("127.0.0.1:0".parse().expect("addr")).expect("listen");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(ramslog_target::tcp::serve(listener, portal.clone()));
        let (mut s, mut seq) = login(addr).await;
        clear_unit_attention(&mut s, &mut seq).await;

        // The driver must find the write readable and the termination
        // pending in the same wake-up. The runtime learns of readable
        // sockets in the order they became readable, and wakes their tasks
        // in that order: `cue` wakes this task first, then the driver (its
        // write is in), and this task terminates before the driver runs.
        let (mut cue_tx, mut cue_rx) = tokio::net::UnixStream::pair().expect("socketpair");
        cue_tx.write_all(&[1]).await.expect("cue");
        // Loopback delivers the write before `write_all` returns.
        send(&mut s, &write_command(seq), &[0x5a; 4096]).await;
        let mut byte = [0u8; 1];
        cue_rx.read_exact(&mut byte).await.expect("cue");
        // As `lifecycle::shutdown` orders a restart without a dump.
        let told = portal.core.gate.close(true);
        assert_eq!(told, 1, "round {round}: the connection to tell");
        for v in portal.core.volumes.iter() {
            v.fence();
        }

        let first = tokio::time::timeout(Duration::from_secs(10), read_pdu(&mut s))
            .await
            .expect("the connection answers or ends within 10 s");
        let Some(notice) = first else {
            panic!("round {round}: the connection ended without the restart notice");
        };
        assert_eq!(
            (notice.opcode(), notice.async_event()),
            (Some(Opcode::AsyncMessage), (3, 0)),
            "round {round}: the first PDU after the restart began (the write gets no status)"
        );
        let (_, time2wait, _) = notice.async_parameters();
        assert_eq!(time2wait, 0, "round {round}: log in again at once");
        let after = tokio::time::timeout(Duration::from_secs(10), read_pdu(&mut s))
            .await
            .expect("the connection ends within 10 s");
        assert!(
            after.is_none(),
            "round {round}: after the notice came {:?}, not the close",
            after.and_then(|b| b.opcode())
        );
        server.abort();
        let volume = portal.core.volumes.iter().next().expect("the LUN");
        let mut lba0 = [0u8; 4096];
        volume.store().read(0, &mut lba0).expect("read the LUN");
        if lba0 == [0x5a; 4096] {
            met_the_fence += 1;
        }
    }
    println!("{met_the_fence} of {ROUNDS} rounds: the write met the fence");
    assert!(
        met_the_fence >= 1,
        "in no round did the driver take the write before the termination: the race was not run"
    );
}
