//! Malformed and abusive PDUs, one test per class: unknown opcodes, PDUs of
//! the wrong phase, lying lengths (data segment, AHS), CmdSN outside the
//! window, login key abuse, malformed text, mid-transfer disconnects. Each
//! shows the right Reject, sense or closed connection, and that the target
//! keeps serving another session with no block changed.

use ramslog_common::iscsi::{digest, text, Bhs, Opcode, RejectReason, BHS_LEN, RESERVED_TAG};
use ramslog_common::scsi_wire::{sense_key, status};
use ramslog_initiator::{Connection, Digest, Error, Pdu, Residual};
use ramslog_tests::TargetProcess;

use super::*;

const CANARY_LBA: u64 = 1000;

async fn expect_reject(c: &mut Connection, reason: RejectReason) -> Pdu {
    let p = c
        .recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("a Reject");
    assert_eq!(p.opcode(), Some(Opcode::Reject), "got {:?}", p.bhs);
    assert_eq!(p.bhs.reject_reason(), reason as u8);
    assert!(p.data.len() >= 48, "Reject carries the rejected header");
    p
}

async fn expect_closed(c: &mut Connection) {
    loop {
        match c.recv_pdu_timeout(Duration::from_secs(5)).await {
            Err(Error::Closed) | Err(Error::Io(_)) => return,
            Ok(Some(p)) if p.opcode() == Some(Opcode::Reject) => continue,
            other => panic!("expected the connection to close, got {other:?}"),
        }
    }
}

async fn tur_works(c: &mut Connection) {
    for _ in 0..3 {
        let b = scsi_cmd(c, &[0; 6], 0x81, 0);
        c.send_pdu(&b, &[], &[]).await.expect("send TUR");
        let p = c
            .recv_pdu_timeout(Duration::from_secs(5))
            .await
            .expect("recv")
            .expect("TUR response");
        assert_eq!(p.opcode(), Some(Opcode::ScsiResponse));
        if p.bhs.scsi_status() == status::GOOD {
            return;
        }
    }
    panic!("TEST UNIT READY never succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_opcode_is_rejected() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |_| {}).await;
    let mut raw = [0; BHS_LEN];
    raw[0] = 0x1d; // not an iSCSI opcode
    let mut b = Bhs::from_raw(raw);
    b.set_itt(7);
    c.send_pdu(&b, &[], &[]).await.expect("send");
    let r = expect_reject(&mut c, RejectReason::CommandNotSupported).await;
    assert_eq!(&r.data[..48], &b.as_bytes()[..]);
    // A target-only opcode from the initiator is just as unsupported.
    let mut b = Bhs::new(Opcode::ScsiResponse);
    b.set_itt(8);
    c.send_pdu(&b, &[], &[]).await.expect("send");
    expect_reject(&mut c, RejectReason::CommandNotSupported).await;
    tur_works(&mut c).await;
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdus_of_the_wrong_phase() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    // A SCSI command before login: the connection is dropped.
    let mut c = Connection::connect(t.addr()).await.expect("connect");
    let b = scsi_cmd(&mut c, &[0; 6], 0x81, 0);
    c.send_pdu(&b, &[], &[]).await.expect("send");
    expect_closed(&mut c).await;
    // A Login Request in full feature phase: Reject, protocol error.
    let mut c = raw_login(&t, |_| {}).await;
    let mut l = Bhs::new(Opcode::LoginRequest);
    l.set_flags(0x87).set_itt(c.next_itt());
    c.fill_sn(&mut l, true);
    c.send_pdu(&l, &[], b"InitiatorName=x\0")
        .await
        .expect("send");
    expect_reject(&mut c, RejectReason::ProtocolError).await;
    // SNACK needs ErrorRecoveryLevel > 0.
    let mut s = Bhs::new(Opcode::SnackRequest);
    s.set_final(true).set_itt(RESERVED_TAG);
    c.send_pdu(&s, &[], &[]).await.expect("send");
    expect_reject(&mut c, RejectReason::ProtocolError).await;
    tur_works(&mut c).await;
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_segment_longer_than_negotiated() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |_| {}).await;
    let b = scsi_cmd(&mut c, &[0x2a, 0, 0, 0, 0, 0, 0, 0x08, 0, 0], 0xa1, 1 << 20);
    let big = vec![0x5a; 1 << 20]; // the target declared 256 KiB
                                   // The target may close while the megabyte is still on its way: the
                                   // send's own result says nothing; the log says whether the attack
                                   // arrived and why it was cut off.
    let _ = c.send_pdu(&b, &[], &big).await;
    expect_closed(&mut c).await;
    assert!(
        t.output()
            .contains("data segment longer than MaxRecvDataSegmentLength"),
        "the oversized segment is the logged reason: {}",
        t.output_tail(5)
    );
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_segment_longer_than_the_bytes_sent() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |_| {}).await;
    let mut b = scsi_cmd(&mut c, &[0x2a, 0, 0, 0, 0x03, 0xe8, 0, 0, 8, 0], 0xa1, 4096);
    b.set_data_segment_len(4096);
    let mut bytes = b.as_bytes().to_vec();
    bytes.extend_from_slice(&[0xee; 100]);
    c.send_raw(&bytes).await.expect("send");
    c.shutdown_write().await.expect("half-close");
    expect_closed(&mut c).await;
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ahs_length_lies() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |_| {}).await;
    let mut b = scsi_cmd(&mut c, &[0; 6], 0x81, 0);
    // TotalAHSLength says 8 bytes; the AHS inside claims 100.
    b.set_total_ahs_len(8)
        .expect("8 bytes is a valid AHS length");
    let mut bytes = b.as_bytes().to_vec();
    bytes.extend_from_slice(&[0, 100, 1, 0, 0, 0, 0, 0]);
    c.send_raw(&bytes).await.expect("send");
    expect_reject(&mut c, RejectReason::InvalidPduField).await;
    tur_works(&mut c).await;
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cmdsn_outside_the_window_is_ignored() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |_| {}).await;
    tur_works(&mut c).await;
    let good = c.next_cmdsn();
    for sn in [good.wrapping_add(100_000), good.wrapping_sub(1)] {
        let mut b = scsi_cmd(&mut c, &[0; 6], 0x81, 0);
        b.set_cmdsn(sn);
        c.set_next_cmdsn(good);
        c.send_pdu(&b, &[], &[]).await.expect("send");
        assert!(
            before_a_ping(&mut c).await.is_empty(),
            "CmdSN {sn} must be ignored"
        );
    }
    tur_works(&mut c).await;
    by.still_fine().await;
}

async fn login_status(t: &TargetProcess, text: &[u8]) -> (u8, u8, Vec<u8>) {
    let mut c = Connection::connect(t.addr()).await.expect("connect");
    let mut l = Bhs::new(Opcode::LoginRequest);
    l.set_immediate(true).set_flags(0x87).set_itt(1);
    l.set_isid([0x80, 9, 9, 9, 0, 1]);
    c.send_pdu(&l, &[], text).await.expect("send login");
    let p = c
        .recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("login response");
    assert_eq!(p.opcode(), Some(Opcode::LoginResponse));
    (
        p.bhs.login_status_class(),
        p.bhs.login_status().to_be_bytes()[1],
        p.data,
    )
}

fn login_text(extra: &[(&str, &str)], name: &str) -> Vec<u8> {
    let mut t = Vec::new();
    text::encode_pair(&mut t, "InitiatorName", INITIATOR);
    text::encode_pair(&mut t, "TargetName", name);
    for (k, v) in extra {
        text::encode_pair(&mut t, k, v);
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_login_keys() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let name = t.target_name().to_string();
    let dup = login_text(
        &[("MaxBurstLength", "65536"), ("MaxBurstLength", "65536")],
        &name,
    );
    assert_eq!(
        login_status(&t, &dup).await.0,
        2,
        "duplicate key: initiator error"
    );
    let long = "x".repeat(300);
    let oversized = login_text(&[("MaxBurstLength", &long)], &name);
    assert_eq!(
        login_status(&t, &oversized).await.0,
        2,
        "oversized value: initiator error"
    );
    let mut no_equals = login_text(&[], &name);
    no_equals.extend_from_slice(b"ImmediateData\0");
    assert_eq!(
        login_status(&t, &no_equals).await.0,
        2,
        "key without '=': initiator error"
    );
    // An unknown key is answered NotUnderstood and the login goes on.
    let (class, _, data) =
        login_status(&t, &login_text(&[("X-org.example.Thing", "1")], &name)).await;
    assert_eq!(class, 0);
    let pairs = text::decode(&data).expect("login text");
    assert!(pairs
        .iter()
        .any(|p| p.key == "X-org.example.Thing" && p.value == "NotUnderstood"));
    // Out-of-range numeric value: that key is rejected, the login goes on.
    let (class, _, data) = login_status(&t, &login_text(&[("MaxBurstLength", "100")], &name)).await;
    assert_eq!(class, 0);
    assert!(text::decode(&data)
        .expect("text")
        .iter()
        .any(|p| p.key == "MaxBurstLength" && p.value == "Reject"));
    by.still_fine().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_request_without_equals_is_rejected() {
    let t = TargetProcess::start();
    let mut c = raw_login(&t, |_| {}).await;
    let mut b = Bhs::new(Opcode::TextRequest);
    b.set_final(true)
        .set_itt(c.next_itt())
        .set_ttt(RESERVED_TAG);
    c.fill_sn(&mut b, false);
    c.send_pdu(&b, &[], b"SendTargets\0").await.expect("send");
    expect_reject(&mut c, RejectReason::ProtocolError).await;
    tur_works(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lba_past_the_end_and_length_mismatch() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let s = open(&t, INITIATOR).await;
    let last = (256u64 << 20) / 512;
    let r = s
        .command(0, &ramslog_initiator::cdb::read16(last, 1), None, 512)
        .await
        .expect("cmd");
    assert_eq!(
        (r.status, sense(&r)),
        (
            status::CHECK_CONDITION,
            (sense_key::ILLEGAL_REQUEST, 0x21, 0)
        )
    );
    let r = s
        .command(
            0,
            &ramslog_initiator::cdb::write16(last - 1, 2, false),
            Some(&[0u8; 1024]),
            0,
        )
        .await
        .expect("cmd");
    assert_eq!(
        (r.status, sense(&r)),
        (
            status::CHECK_CONDITION,
            (sense_key::ILLEGAL_REQUEST, 0x21, 0)
        )
    );
    // READ(10) of two blocks with room for one: one block moves, overflow reported.
    let r = s
        .command(0, &[0x28, 0, 0, 0, 0x03, 0xe8, 0, 0, 2, 0], None, 512)
        .await
        .expect("cmd");
    assert_eq!(
        (r.status, r.data.len(), r.residual),
        (status::GOOD, 512, Residual::Over(512))
    );
    by.still_fine().await;
}

/// Write data goes straight to the LUN (docs/write-placement.md): a write
/// that is never acknowledged may leave its own blocks partly written, as on
/// any disk, but no block outside its LBA range ever changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_mid_r2t_changes_nothing_outside_the_write() {
    let t = TargetProcess::start();
    // Below the write: the bystander's 128 blocks; above it: another 128.
    let by = Bystander::new(&t, CANARY_LBA).await;
    let above = Bystander::new(&t, CANARY_LBA + 256).await;
    let mut c = raw_login(&t, |p| {
        p.initial_r2t = true;
        p.immediate_data = false;
    })
    .await;
    tur_works(&mut c).await;
    // WRITE(10) of 128 blocks right after the bystander's; send half, then vanish.
    let (b, r2t) = write_awaiting_r2t(&mut c, CANARY_LBA as u32 + 128, 128).await;
    let d = data_out(&b, &r2t, 0, 0, false);
    c.send_pdu(&d, &[], &[0xdd; 8192]).await.expect("send half");
    drop(c);
    // Checked once the target has ended that session (the bystanders' stay).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !t.output().contains("session ended") {
        assert!(
            std::time::Instant::now() < deadline,
            "the target never ended the dropped connection's session\n{}",
            t.output_tail(10)
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    by.still_fine().await;
    above.still_fine().await;
}

/// RFC 7143 11.1: the data digest covers the data segment with its padding
/// as sent. A peer that pads with non-zero bytes and digests them sent a
/// sound PDU; taking it for a corrupted one would Reject every such command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_digest_covers_the_padding_as_sent() {
    let t = TargetProcess::start();
    let mut c = raw_login(&t, |p| p.data_digest = Digest::Crc32c).await;
    assert!(c.digests().data, "DataDigest=CRC32C was negotiated");
    let mut b = Bhs::new(Opcode::NopOut);
    b.set_final(true)
        .set_itt(c.next_itt())
        .set_ttt(RESERVED_TAG);
    c.fill_sn(&mut b, true);
    b.set_data_segment_len(5);
    let mut wire = b.as_bytes().to_vec();
    wire.extend_from_slice(b"hello\x77\x77\x77");
    let d = digest::data(&wire[BHS_LEN..]);
    wire.extend_from_slice(&digest::to_wire(d));
    c.send_raw(&wire).await.expect("send");
    let p = c
        .recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("an answer");
    assert_eq!(
        p.opcode(),
        Some(Opcode::NopIn),
        "non-zero padding under a matching digest: got {:?}",
        p.bhs
    );
    assert_eq!(p.data, b"hello");
}

/// The wire form of `b` carrying `data` under a data digest that does not
/// match it (the header itself is sound).
fn with_bad_data_digest(b: &mut Bhs, data: &[u8]) -> Vec<u8> {
    b.set_data_segment_len(data.len() as u32);
    let mut wire = b.as_bytes().to_vec();
    wire.extend_from_slice(data);
    wire.resize(BHS_LEN + data.len().next_multiple_of(4), 0);
    let d = digest::data(&wire[BHS_LEN..]) ^ 0x5a5a_5a5a;
    wire.extend_from_slice(&digest::to_wire(d));
    wire
}

async fn zeros_at(s: &ramslog_initiator::Session, lba: u64, blocks: u32) -> bool {
    let got = s.read(0, lba, blocks, 512).await.expect("READ");
    got.iter().all(|&b| b == 0)
}

/// RFC 7143 § 7.8 at ErrorRecoveryLevel 0: a command whose immediate data
/// fails its digest is discarded unaccounted, so its CmdSN would hold the
/// window shut until the host's command timeout. The target Rejects it and
/// closes the connection at once (session recovery), and nothing of it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_digest_error_on_immediate_data_rejects_and_closes() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |p| {
        p.data_digest = Digest::Crc32c;
        p.immediate_data = true;
    })
    .await;
    tur_works(&mut c).await;
    let lba = CANARY_LBA as u32 + 512;
    let l = lba.to_be_bytes();
    let mut b = scsi_cmd(
        &mut c,
        &[0x2a, 0, l[0], l[1], l[2], l[3], 0, 0, 8, 0],
        0xa0,
        4096,
    );
    let wire = with_bad_data_digest(&mut b, &[0xab; 4096]);
    c.send_raw(&wire).await.expect("send");
    let r = expect_reject(&mut c, RejectReason::DataDigestError).await;
    assert_eq!(
        r.data[..48][1..4],
        b.as_bytes()[1..4],
        "the rejected header"
    );
    let started = std::time::Instant::now();
    expect_closed(&mut c).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed at once, not after a timeout: {:?}",
        started.elapsed()
    );
    assert!(zeros_at(&by.s, u64::from(lba), 8).await, "nothing landed");
    by.still_fine().await;
}

/// RFC 7143 § 7.8 option b: a Data-Out whose data fails its digest has a
/// sound header, so its task ends, once its sequence has, with CHECK
/// CONDITION, ABORTED COMMAND, PROTOCOL SERVICE CRC ERROR (47h/05h) instead
/// of waiting for the host's command timeout; the damaged data is not
/// placed, and the connection serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_digest_error_on_data_out_ends_its_task_with_a_crc_error() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, CANARY_LBA).await;
    let mut c = raw_login(&t, |p| {
        p.data_digest = Digest::Crc32c;
        p.initial_r2t = true;
        p.immediate_data = false;
    })
    .await;
    tur_works(&mut c).await;
    // The damaged PDU first (the sound one after it then leaves a gap in
    // the sequence), then last (the one with the Final bit).
    for damaged in [0u32, 1] {
        let lba = CANARY_LBA as u32 + 512 + damaged * 16;
        let (b, r2t) = write_awaiting_r2t(&mut c, lba, 16).await;
        for i in 0..2u32 {
            let mut d = data_out(&b, &r2t, i * 4096, i, i == 1);
            if i == damaged {
                c.send_raw(&with_bad_data_digest(&mut d, &[0xcd; 4096]))
                    .await
                    .expect("send the damaged PDU");
                expect_reject(&mut c, RejectReason::DataDigestError).await;
            } else {
                c.send_pdu(&d, &[], &[0xcd; 4096])
                    .await
                    .expect("send the sound PDU");
            }
        }
        let p = c
            .recv_pdu_timeout(Duration::from_secs(5))
            .await
            .expect("recv")
            .expect("the task ends once its sequence has, not at the host's timeout");
        assert_eq!(p.opcode(), Some(Opcode::ScsiResponse), "got {:?}", p.bhs);
        assert_eq!(p.bhs.itt(), b.itt());
        assert_eq!(p.bhs.scsi_status(), status::CHECK_CONDITION);
        let slen = usize::from(u16::from_be_bytes([p.data[0], p.data[1]]));
        let sense = ramslog_common::scsi_wire::Sense::decode(&p.data[2..2 + slen]).expect("sense");
        assert_eq!(
            (sense.key, sense.asc, sense.ascq),
            (sense_key::ABORTED_COMMAND, 0x47, 0x05),
            "PROTOCOL SERVICE CRC ERROR (damaged PDU {damaged})"
        );
        // Nothing after the damage is placed; what came before may be, as
        // for any write that fails (docs/write-placement.md).
        assert!(
            zeros_at(&by.s, u64::from(lba) + u64::from(damaged) * 8, 8).await,
            "the damaged data is not placed"
        );
    }
    tur_works(&mut c).await;
    by.still_fine().await;
}
