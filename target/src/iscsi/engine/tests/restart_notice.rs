//! A planned restart tells the host of each normal session when to log in
//! again (an Async Message, AsyncEvent 3) before its connection drops.
//!
//! Over iSER the drop travels apart from the notice: the RDMA connection
//! manager's disconnect can reach a Linux host before it has processed the
//! receive that holds the notice, and iscsid then drops the notice as a PDU
//! of a failed connection and waits its DefaultTime2Wait. A lab run lost all
//! three notices of a run so, on a loaded machine. So over iSER the engine
//! asks for a receipt: a NOP-In ping right after the notice, and the
//! connection ends once a PDU of the host carries an ExpStatSN past the
//! notice's StatSN (the host took it: it processes PDUs in order) or when
//! the restart drain runs out. Over TCP the host's stack delivers the notice
//! before the close, so nothing is awaited.

use super::*;

/// A logged-in iSER session with immediate data.
fn iser_logged_in() -> Harness {
    let mut h = Harness::new_iser(RamPortal::new(IQN).size(1 << 20).build());
    let r = h.login(&[("InitialR2T", "No"), ("ImmediateData", "Yes")]);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    h
}

/// The restart's notice and what follows it: (the notice's StatSN, the
/// ping's TTT if one was sent).
fn restart(h: &mut Harness) -> (u32, Option<u32>) {
    h.conn.control().terminate_for_restart();
    h.conn.handle(h.now, Input::Terminated);
    let r = h.drain();
    let notice = &r[0].bhs;
    assert_eq!(notice.opcode(), Some(Opcode::AsyncMessage));
    assert_eq!(notice.async_event().0, 3, "dropping all connections");
    // The engine picks Time2Wait by transport: the TCP listener passes to
    // the new program, the rdma_cm listener is bound again a moment later.
    let time2wait = match h.conn.transport() {
        Transport::Tcp => 0,
        Transport::Iser => 1,
    };
    assert_eq!(notice.async_parameters().1, time2wait, "Time2Wait");
    let ping = r.get(1).map(|p| {
        assert_eq!(
            (p.bhs.opcode(), p.bhs.itt()),
            (Some(Opcode::NopIn), RESERVED_TAG),
            "a ping of the target's own"
        );
        assert_ne!(p.bhs.ttt(), RESERVED_TAG, "a ping asks for an answer");
        p.bhs.ttt()
    });
    assert!(r.len() <= 2, "nothing but the notice and its ping");
    (notice.statsn(), ping)
}

/// The host's answer to the ping, sent after it took PDUs up to `exp_statsn`.
fn nop_answer(h: &mut Harness, ttt: u32, exp_statsn: u32) -> Vec<Rsp> {
    let mut a = Bhs::new(Opcode::NopOut);
    a.set_immediate(true)
        .set_final(true)
        .set_itt(RESERVED_TAG)
        .set_ttt(ttt)
        .set_cmdsn(h.cmdsn)
        .set_exp_statsn(exp_statsn);
    h.send(&a, &[])
}

#[test]
fn over_iser_the_connection_ends_once_the_host_took_the_notice() {
    let mut h = iser_logged_in();
    let (statsn, ping) = restart(&mut h);
    let ttt = ping.expect("over iSER the notice is followed by a ping");
    assert!(!h.closed, "the connection waits for the host's receipt");
    assert!(!h.conn.is_closed());

    // A write the host sent before it took the notice: not executed, not
    // answered (the host sends it again after its new login), and it is no
    // receipt.
    let (_, mut w) = h.scsi_bhs(&write10(0, 8), 0xa1, 4096);
    w.set_exp_statsn(statsn);
    assert!(h.send(&w, &[0x5a; 4096]).is_empty());
    assert!(!h.closed, "an ExpStatSN up to the notice is no receipt");
    let mut lun = vec![0u8; 4096];
    assert!(h.read_lun(0, &mut lun));
    assert!(
        lun.iter().all(|&b| b == 0),
        "nothing is written after the notice"
    );

    // The answer to the ping: the host is past the notice.
    assert!(nop_answer(&mut h, ttt, statsn.wrapping_add(1)).is_empty());
    assert!(h.closed, "the receipt ends the connection");
}

#[test]
fn over_iser_a_host_that_never_confirms_is_let_go_at_the_restart_drain() {
    let mut h = iser_logged_in();
    let (_, ping) = restart(&mut h);
    assert!(ping.is_some(), "over iSER the notice is followed by a ping");
    let drain = h.conn.portal().core.limits.restart_drain;
    assert_eq!(h.conn.poll_timeout(), Some(h.now + drain));
    h.now += drain - Duration::from_millis(1);
    h.conn.handle(h.now, Input::Timeout);
    assert!(h.drain().is_empty());
    assert!(!h.closed);
    h.now += Duration::from_millis(1);
    h.conn.handle(h.now, Input::Timeout);
    assert!(h.drain().is_empty());
    assert!(h.closed, "the restart does not wait longer than its drain");
}

#[test]
fn over_tcp_the_notice_is_followed_by_the_close() {
    let mut h = logged_in();
    let (_, ping) = restart(&mut h);
    assert_eq!(ping, None, "TCP delivers the notice before the close");
    assert!(h.closed);
}

#[test]
fn a_termination_without_a_restart_ends_the_connection_with_nothing_sent() {
    for mut h in [logged_in(), iser_logged_in()] {
        // A response queued but not yet taken by the driver.
        let mut nop = Bhs::new(Opcode::NopOut);
        nop.set_immediate(true)
            .set_final(true)
            .set_itt(77)
            .set_ttt(RESERVED_TAG)
            .set_cmdsn(h.cmdsn)
            .set_exp_statsn(0);
        h.conn.handle(h.now, Input::pdu(&nop, &[], &[]));
        assert!(h.conn.has_output(), "the NOP-In waits to be sent");
        h.conn.control().terminate();
        h.conn.handle(h.now, Input::Terminated);
        assert!(h.conn.termination_seen());
        assert!(
            h.conn.has_ended(),
            "nothing more is sent: the connection ends now"
        );
        assert!(h.drain().is_empty());
        // A second termination changes nothing.
        h.conn.handle(h.now, Input::Terminated);
        assert!(h.conn.has_ended());
    }
}

#[test]
fn the_restart_notice_is_given_once() {
    let mut h = iser_logged_in();
    restart(&mut h);
    h.conn.control().terminate_for_restart();
    h.conn.handle(h.now, Input::Terminated);
    assert!(h.drain().is_empty(), "no second notice");
}
