//! One case per trust defect class, on the real binary over TCP: a hole in
//! a write's data, CHAP skipped by key order, a discovery login ending a
//! session, a command beyond MaxCmdSN, a silent peer, PREEMPT AND ABORT,
//! heavy commands, names that steer a terminal.

use std::time::Duration;

use ramslog_common::iscsi::{login, login_status, text, Bhs, Opcode, RESERVED_TAG};
use ramslog_common::scsi_wire::{sense_key, status, Sense};
use ramslog_initiator::{Connection, LoginParams, Pdu, Session};
use ramslog_tests::{TargetOptions, TargetProcess};

use super::*;

async fn next(c: &mut Connection) -> Pdu {
    c.recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("a PDU")
}

fn write10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = read10(lba, blocks);
    c[0] = 0x2a;
    c
}

fn sense_of(p: &Pdu) -> Sense {
    Sense::decode(&p.data[2..]).expect("sense data")
}

fn data_out(itt: u32, ttt: u32, offset: u32, last: bool) -> Bhs {
    Bhs::data_out(itt, ttt, offset, 0, last)
}

/// TEST UNIT READY until the power-on unit attention has been reported.
async fn clear_unit_attention(c: &mut Connection) {
    for _ in 0..2 {
        let tur = scsi_cmd(c, &[0; 6], 0x81, 0);
        c.send_pdu(&tur, &[], &[]).await.expect("TEST UNIT READY");
        next(c).await;
    }
}

async fn read_lun(s: &Session, lba: u64, blocks: u32) -> Vec<u8> {
    s.read(0, lba, blocks, 512).await.expect("read")
}

/// Defect 1 on the wire: a solicited burst that ends at half its length
/// (the 256 KiB write of the reproduction, 64 KiB bursts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_with_a_hole_is_never_good() {
    let t = TargetProcess::start();
    let by = Bystander::new(&t, 500_000).await;
    let before = read_lun(&by.s, 1000, 640).await;
    let mut c = raw_login(&t, |p| {
        p.initial_r2t = true;
        p.immediate_data = false;
        p.max_burst_length = 65536;
        p.first_burst_length = 65536;
    })
    .await;
    clear_unit_attention(&mut c).await;
    let cmd = scsi_cmd(&mut c, &write10(1064, 512), 0xa1, 262144);
    c.send_pdu(&cmd, &[], &[]).await.expect("send");
    // This initiator offers MaxOutstandingR2T=1; the engine tests cover 2.
    let mut r2ts = vec![next(&mut c).await];
    let mut first = true;
    let mut answer = None;
    while let Some(r) = r2ts.pop() {
        assert_eq!(r.opcode(), Some(Opcode::ReadyToTransfer));
        let (off, len) = (r.bhs.buffer_offset(), r.bhs.residual());
        let send = if first { len / 2 } else { len };
        first = false;
        let d = data_out(cmd.itt(), r.bhs.ttt(), off, true);
        c.send_pdu(&d, &[], &vec![0xa5; send as usize])
            .await
            .expect("data");
        for p in before_a_ping(&mut c).await {
            match p.opcode() {
                Some(Opcode::ReadyToTransfer) => r2ts.push(p),
                _ => answer = Some(p),
            }
        }
    }
    let p = answer.expect("a response once every burst ended");
    assert_eq!(
        p.bhs.scsi_status(),
        status::CHECK_CONDITION,
        "never GOOD with a hole"
    );
    let s = sense_of(&p);
    assert_eq!(
        (s.key, s.asc, s.ascq),
        (sense_key::ABORTED_COMMAND, 0x4b, 0)
    );
    let after = read_lun(&by.s, 1000, 640).await;
    assert_eq!(&after[..64 * 512], &before[..64 * 512], "below the write");
    assert_eq!(&after[576 * 512..], &before[576 * 512..], "above the write");
    by.still_fine().await;
}

/// Defect 2 on the wire: AuthMethod=None before TargetName on a CHAP target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chap_is_not_skipped_by_key_order() {
    let secret = ramslog_tests::secret_file("hostile-chap", "a-long-enough-secret");
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec![
            "--chap-user".into(),
            "alice".into(),
            "--chap-secret-file".into(),
            secret.display().to_string(),
        ],
        ..Default::default()
    });
    let orders: [&[(&str, &str)]; 3] = [
        &[
            ("InitiatorName", INITIATOR),
            ("AuthMethod", "None"),
            ("TargetName", t.target_name()),
        ],
        &[
            ("AuthMethod", "None"),
            ("InitiatorName", INITIATOR),
            ("TargetName", t.target_name()),
        ],
        &[
            ("InitiatorName", INITIATOR),
            ("AuthMethod", "None"),
            ("SessionType", "Normal"),
            ("TargetName", t.target_name()),
        ],
    ];
    for keys in orders {
        let mut c = Connection::connect(t.addr()).await.expect("connect");
        let mut body = Vec::new();
        for (k, v) in keys {
            text::encode_pair(&mut body, k, v);
        }
        let mut l = Bhs::new(Opcode::LoginRequest);
        // Security → full feature in one step.
        l.set_immediate(true)
            .set_flags(login::TRANSIT | login::STAGE_FULL_FEATURE)
            .set_itt(1);
        l.set_isid([0x80, 9, 9, 9, 0, 2]);
        c.send_pdu(&l, &[], &body).await.expect("send login");
        let p = next(&mut c).await;
        assert_eq!(p.opcode(), Some(Opcode::LoginResponse));
        assert_eq!(
            p.bhs.login_status_class(),
            2,
            "{keys:?}: the login must fail (initiator error class)"
        );
        assert_eq!(
            p.bhs.login_status(),
            login_status::AUTH_FAILED,
            "{keys:?}: authentication failure"
        );
    }
    let _ = std::fs::remove_file(&secret);
}

/// Defect 3 on the wire: a discovery login with the victim's names and ISID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovery_login_does_not_end_a_session() {
    let t = TargetProcess::start();
    let isid = [0x80, 1, 2, 3, 4, 5];
    let mut p = LoginParams::normal(BYSTANDER, t.target_name());
    p.isid = Some(isid);
    let victim = Session::login(t.addr(), p).await.expect("victim login");
    let _ = victim.test_unit_ready(0).await;
    let mut d = LoginParams::discovery(BYSTANDER);
    d.isid = Some(isid);
    d.extra_keys
        .push(("TargetName".into(), t.target_name().into()));
    let mut c = Connection::connect(t.addr()).await.expect("connect");
    // The attack must really happen: a discovery session with the victim's
    // names and ISID is logged in (the TargetName key is ignored there).
    let outcome = c.login(&d).await;
    assert!(
        outcome.is_ok(),
        "the discovery login itself failed: {outcome:?}"
    );
    // Had it reinstated the victim's session, the victim's connection would
    // be gone before this login was answered (a reinstating login is
    // answered only then), and surely once this session logged out.
    c.logout().await.expect("discovery logout");
    let r = victim.test_unit_ready(0).await;
    assert!(
        r.is_ok_and(|r| r.is_good() || r.sense.is_some()),
        "the victim's session must survive a discovery login"
    );
}

/// Defect 4 on the wire: four commands wait for data with a window of four;
/// the next command is beyond MaxCmdSN and gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_beyond_max_cmdsn_is_dropped() {
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec!["--cmd-window".into(), "4".into()],
        ..Default::default()
    });
    let mut c = raw_login(&t, |p| {
        p.initial_r2t = true;
        p.immediate_data = false;
    })
    .await;
    clear_unit_attention(&mut c).await;
    let mut waiting = Vec::new();
    let mut last = None;
    for i in 0..4u32 {
        let cmd = scsi_cmd(&mut c, &write10(2000 + i * 8, 8), 0xa1, 4096);
        c.send_pdu(&cmd, &[], &[]).await.expect("send");
        let r2t = next(&mut c).await;
        assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
        waiting.push((cmd.itt(), r2t.bhs.ttt()));
        last = Some(r2t);
    }
    let r2t = last.expect("R2Ts");
    assert_eq!(
        r2t.bhs.max_cmdsn(),
        r2t.bhs.exp_cmdsn().wrapping_sub(1),
        "window shut"
    );
    let tur = scsi_cmd(&mut c, &[0; 6], 0x81, 0);
    c.send_pdu(&tur, &[], &[]).await.expect("send");
    let answered = before_a_ping(&mut c).await;
    assert!(
        answered.is_empty(),
        "a command beyond MaxCmdSN was answered: {:?}",
        answered.iter().map(|p| p.opcode()).collect::<Vec<_>>()
    );
    let (itt, ttt) = waiting[0];
    c.send_pdu(&data_out(itt, ttt, 0, true), &[], &[0u8; 4096])
        .await
        .expect("data");
    let p = next(&mut c).await;
    assert_eq!(p.bhs.scsi_status(), status::GOOD);
    assert_eq!(p.bhs.max_cmdsn(), p.bhs.exp_cmdsn(), "one slot open again");
}

/// Defect 7 on the wire: a peer that never answers NOP-In is dropped after
/// the interval plus the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_dropped() {
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec![
            "--nop-interval".into(),
            "1".into(),
            "--nop-timeout".into(),
            "2".into(),
        ],
        ..Default::default()
    });
    let mut c = raw_login(&t, |_| {}).await;
    let started = std::time::Instant::now();
    let mut pings = 0;
    loop {
        match c.recv_pdu_timeout(Duration::from_secs(10)).await {
            Ok(Some(p)) if p.opcode() == Some(Opcode::NopIn) => {
                assert_eq!(p.bhs.itt(), RESERVED_TAG);
                pings += 1;
            }
            Ok(Some(p)) => panic!("unexpected {:?}", p.opcode()),
            Ok(None) => panic!("still open after 10 s of silence"),
            Err(_) => break,
        }
    }
    assert_eq!(pings, 1, "one ping, then the connection ends");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

/// Defect 8 on the wire: data for a preempted write does not land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_and_abort_fences_the_other_host() {
    let t = TargetProcess::start();
    let a = Session::login(t.addr(), LoginParams::normal(BYSTANDER, t.target_name()))
        .await
        .expect("login a");
    let mut b = raw_login(&t, |p| {
        p.initial_r2t = true;
        p.immediate_data = true;
    })
    .await;
    for _ in 0..4 {
        let _ = a.test_unit_ready(0).await;
    }
    let pr_out = ramslog_common::cdb::persistent_reserve_out;
    // B: clear its unit attention, register.
    clear_unit_attention(&mut b).await;
    let (cdb, params) = pr_out(0, 0, 0xbb);
    let reg = scsi_cmd(&mut b, &cdb, 0xa1, 24);
    b.send_pdu(&reg, &[], &params).await.expect("register");
    assert_eq!(next(&mut b).await.bhs.scsi_status(), status::GOOD);
    let (cdb, params) = pr_out(0, 0, 0xaa);
    let r = a
        .command(0, &cdb, Some(&params), 0)
        .await
        .expect("register a");
    assert!(r.is_good());
    let marker = vec![0x11u8; 4096];
    a.write(0, 3000, &marker, true).await.expect("marker");
    // B's write waits for its data; A preempts B and aborts its tasks.
    let w = scsi_cmd(&mut b, &write10(3000, 8), 0xa1, 4096);
    b.send_pdu(&w, &[], &[]).await.expect("write");
    let r2t = next(&mut b).await;
    assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
    let (cdb, params) = pr_out(5, 0xaa, 0xbb);
    let r = a.command(0, &cdb, Some(&params), 0).await.expect("preempt");
    assert!(r.is_good(), "PREEMPT AND ABORT");
    b.send_pdu(
        &data_out(w.itt(), r2t.bhs.ttt(), 0, true),
        &[],
        &[0x99; 4096],
    )
    .await
    .expect("late data");
    // TAS=0: an aborted task ends without any status.
    let answered = before_a_ping(&mut b).await;
    assert!(
        !answered
            .iter()
            .any(|p| p.opcode() == Some(Opcode::ScsiResponse) && p.bhs.itt() == w.itt()),
        "the preempted write got a status: {:?}",
        answered
            .iter()
            .map(|p| (p.opcode(), p.bhs.scsi_status()))
            .collect::<Vec<_>>()
    );
    assert_eq!(read_lun(&a, 3000, 8).await, marker, "preempted data landed");
}

/// Defect 9 on the wire: VERIFY BYTCHK=3 over the whole LUN and a 64 MiB
/// WRITE SAME are refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_commands_are_refused() {
    let t = TargetProcess::start();
    let s = Session::login(t.addr(), LoginParams::normal(BYSTANDER, t.target_name()))
        .await
        .expect("login");
    for _ in 0..4 {
        let _ = s.test_unit_ready(0).await;
    }
    let mut verify = [0u8; 16];
    verify[0] = 0x8f;
    verify[1] = 3 << 1;
    verify[10..14].copy_from_slice(&(512u32 * 1024).to_be_bytes());
    let started = std::time::Instant::now();
    let r = s
        .command(0, &verify, Some(&[0u8; 512]), 0)
        .await
        .expect("verify");
    assert_eq!(r.status, status::CHECK_CONDITION);
    assert_eq!(r.sense.map(|x| x.key), Some(sense_key::ILLEGAL_REQUEST));
    let mut ws = [0u8; 16];
    ws[0] = 0x93;
    ws[10..14].copy_from_slice(&(128u32 * 1024).to_be_bytes());
    let r = s
        .command(0, &ws, Some(&[0x5au8; 512]), 0)
        .await
        .expect("write same");
    assert_eq!(r.status, status::CHECK_CONDITION);
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Defect 11 on the wire: an initiator name with a terminal escape is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_steer_a_terminal_are_refused() {
    let t = TargetProcess::start();
    let mut c = Connection::connect(t.addr()).await.expect("connect");
    let p = LoginParams::normal("iqn.2026-11.evil:\u{1b}]0;pwned\u{7}", t.target_name());
    assert!(c.login(&p).await.is_err(), "login refused");
    // The refusal is logged (the name escaped), and no raw escape is.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !t.output().contains("login refused: not an iSCSI name") {
        assert!(
            std::time::Instant::now() < deadline,
            "the refusal was not logged\n{}",
            t.output_tail(10)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        t.output().contains("\\u{1b}]0;pwned"),
        "the name is not in the log, escaped\n{}",
        t.output_tail(10)
    );
    assert!(!t.output().contains('\u{1b}'), "the escape reached the log");
}
