//! Floods: a client that sends and never reads.

use std::time::Duration;

use ramslog_common::iscsi::{Bhs, Opcode};
use ramslog_tests::{TargetOptions, TargetProcess};

use super::memory::{record, RssSampler};
use super::*;

const LUN: &str = "256M";
const LUN_BYTES: u64 = 256 << 20;

/// A target with the flood tests' LUN and `flags`, on normal pages: huge
/// pages are not counted in VmRSS, which the memory bounds are read from.
fn flood_target(flags: &[&str]) -> TargetProcess {
    TargetProcess::start_with(TargetOptions {
        size: LUN.into(),
        extra_args: ["--hugepages", "off"]
            .iter()
            .chain(flags)
            .map(|f| f.to_string())
            .collect(),
        ..Default::default()
    })
}

/// 120 READs of 16 MiB sent back to back without reading a byte of the
/// answers: the target must stream its Data-In with back-pressure, not
/// build ~2 GiB of output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_reads_without_reading_stay_bounded() {
    let t = flood_target(&[]);
    let by = Bystander::new(&t, 500_000).await;
    let sampler = RssSampler::start(t.pid());
    let mut c = raw_login(&t, |_| {}).await;
    // All 120 in one burst of 5,760 bytes: the target reads them at once.
    let mut burst = Vec::new();
    for i in 0..120u32 {
        let b = scsi_cmd(&mut c, &read10((i % 16) * 32768, 32768), 0xc1, 16 << 20);
        burst.extend_from_slice(b.as_bytes());
    }
    c.send_raw(&burst).await.expect("send the READs");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let above = record("pipelined-reads", 1, sampler.peak(), LUN_BYTES);
    assert!(
        above < PER_CONNECTION_LIMIT,
        "defect 4: {} MiB above the LUN for one connection",
        above >> 20
    );
    drop(c);
    by.still_fine().await;
    let above = record("pipelined-reads-end", 1, sampler.finish(), LUN_BYTES);
    assert!(above < PER_CONNECTION_LIMIT, "defect 4: after close");
}

/// Eight logged-in connections flooding READs at once: each stays under the
/// per-connection bound and all together under the total one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_flooding_reads_stay_bounded_in_total() {
    let t = flood_target(&[]);
    let by = Bystander::new(&t, 500_000).await;
    let sampler = RssSampler::start(t.pid());
    let mut conns = Vec::new();
    for n in 0..8u32 {
        let mut c = raw_login(&t, |p| p.initiator_name = format!("{INITIATOR}-{n}")).await;
        for i in 0..64u32 {
            let b = scsi_cmd(&mut c, &read10((i % 16) * 32768, 32768), 0xc1, 16 << 20);
            c.send_pdu(&b, &[], &[]).await.expect("send READ");
        }
        conns.push(c);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let above = record(
        "8-connections-pipelined-reads",
        8,
        sampler.peak(),
        LUN_BYTES,
    );
    assert!(
        above < TOTAL_LIMIT,
        "{} MiB above the LUN in total",
        above >> 20
    );
    assert!(above / 8 < PER_CONNECTION_LIMIT);
    drop(conns);
    by.still_fine().await;
}

/// Connections that never log in: at most `--max-logins-per-host` from one
/// address are kept; the rest are closed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_log_in_are_capped_per_host() {
    let t = flood_target(&["--max-logins-per-host", "4"]);
    let by = Bystander::new(&t, 500_000).await;
    let sampler = RssSampler::start(t.pid());
    let mut streams = Vec::new();
    for _ in 0..12 {
        streams.push(
            tokio::net::TcpStream::connect(t.addr())
                .await
                .expect("connect"),
        );
    }
    let mut closed = 0;
    for s in &mut streams {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::io::AsyncReadExt::read(s, &mut b),
        )
        .await
        {
            closed += 1;
        }
    }
    assert_eq!(
        closed, 8,
        "defect 6: four connections still logging in are kept, eight refused"
    );
    assert!(
        t.output().contains("still logging in (the limit)"),
        "the refusal is logged with its reason"
    );
    record("12-connections-no-login", 12, sampler.finish(), LUN_BYTES);
    drop(streams);
    by.still_fine().await;
}

/// A client that keeps sending login PDUs and reads none of the answers is
/// dropped by the login timeout: its output stalls, but the timer still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_that_never_reads_is_dropped_by_the_login_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = flood_target(&["--login-timeout", "8"]);
    let sampler = RssSampler::start(t.pid());
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    // The login timer runs from the connection's start.
    let connecting = std::time::Instant::now();
    let mut s = socket.connect(t.addr()).await.expect("connect");
    let mut login = Bhs::new(Opcode::LoginRequest);
    // C=1, CSG=operational: "more text follows", each answered by an empty response.
    login
        .set_immediate(true)
        .set_flags(0x40 | (1 << 2))
        .set_itt(1);
    login.set_isid([0x40, 0, 0, 9, 0, 0]);
    let batch: Vec<u8> = login
        .as_bytes()
        .iter()
        .copied()
        .cycle()
        .take(48 * 20_000)
        .collect();
    let started = std::time::Instant::now();
    // Send until the target stops reading: its answers fill both socket
    // buffers, and a target blocked on them would never see its timer.
    while started.elapsed() < Duration::from_secs(7) {
        match tokio::time::timeout(Duration::from_secs(1), s.write_all(&batch)).await {
            Ok(Ok(())) => {}
            _ => break,
        }
    }
    println!("target stopped reading after {:?}", started.elapsed());
    // The login timeout (8 s) plus the closing linger (5 s) end it.
    let mut buf = vec![0u8; 1 << 20];
    let closed = tokio::time::timeout(Duration::from_secs(25), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok();
    assert!(
        closed,
        "defect 6: the connection was still open {:?} after an 8 s login timeout",
        started.elapsed()
    );
    // The login timer, not the 30 s output stall: it fired at 8 s, closed
    // within the 5 s linger, and the log names it.
    let elapsed = connecting.elapsed();
    assert!(
        elapsed >= Duration::from_secs(8) && elapsed < Duration::from_secs(20),
        "closed after {elapsed:?}: the 8 s login timeout must be what ended it"
    );
    let log = t.output();
    assert!(
        log.contains("login timed out") && !log.contains("no output progress"),
        "the login timeout is the logged reason: {}",
        t.output_tail(10)
    );
    record("login-never-reads", 1, sampler.finish(), LUN_BYTES);
}
