//! The timers that keep connections nobody authenticated from living long:
//! the first-PDU timeout, and a discovery session's lifetime after its
//! last SendTargets.

use super::*;

fn timed_portal(first_pdu: u64, discovery_lifetime: u64) -> Arc<Portal> {
    RamPortal::new(IQN)
        .limits(Limits {
            first_pdu_timeout: Duration::from_secs(first_pdu),
            discovery_lifetime: Duration::from_secs(discovery_lifetime),
            login_timeout: Duration::from_secs(30),
            ..Limits::default()
        })
        .build()
}

fn advance_to(h: &mut Harness, at: Instant) -> Vec<Rsp> {
    h.now = at;
    h.conn.handle(h.now, Input::Timeout);
    h.drain()
}

#[test]
fn a_connection_that_sends_nothing_is_closed_by_the_first_pdu_timeout() {
    let mut h = Harness::new(timed_portal(2, 30));
    let start = h.now;
    advance_to(&mut h, start + Duration::from_millis(1900));
    assert!(!h.closed);
    advance_to(&mut h, start + Duration::from_secs(2));
    assert!(h.closed, "closed when no PDU came within 2 s");
}

#[test]
fn a_login_that_started_in_time_has_the_whole_login_timeout() {
    let mut h = Harness::new(timed_portal(2, 30));
    let start = h.now;
    h.now = start + Duration::from_secs(1);
    // A first login PDU that does not finish the login (C=1: more text).
    let r = h.login_pdu(
        0x40 | (1 << 2),
        &[("InitiatorName", INI), ("TargetName", IQN)],
    );
    assert_eq!(r[0].bhs.login_status(), 0);
    advance_to(&mut h, start + Duration::from_secs(29));
    assert!(
        !h.closed,
        "the login timeout runs from the connection's start"
    );
    advance_to(&mut h, start + Duration::from_secs(30));
    assert!(h.closed);
}

fn discovery_login(h: &mut Harness) {
    let flags = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
    let r = h.login_pdu(
        flags,
        &[("InitiatorName", INI), ("SessionType", "Discovery")],
    );
    assert_eq!(r[0].bhs.login_status(), 0);
}

fn send_targets(h: &mut Harness) {
    let r = h.send_targets();
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::TextResponse));
}

#[test]
fn a_discovery_session_is_asked_to_log_out_after_its_lifetime_then_closed() {
    let mut h = Harness::new(timed_portal(5, 10));
    discovery_login(&mut h);
    let start = h.now;
    h.now = start + Duration::from_secs(6);
    send_targets(&mut h);
    // Ten seconds after the last SendTargets, not after the login.
    let r = advance_to(&mut h, start + Duration::from_secs(15));
    assert!(
        r.iter()
            .all(|p| p.bhs.opcode() != Some(Opcode::AsyncMessage)),
        "too early"
    );
    // Answer the pings in between, as a live initiator does: still asked.
    let r = advance_to(&mut h, start + Duration::from_secs(16));
    let asked = r
        .iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::AsyncMessage))
        .expect("an Async Message once the lifetime is over");
    assert_eq!(
        asked.bhs.async_event().0,
        1,
        "AsyncEvent 1: logout requested"
    );
    assert!(!h.closed);
    advance_to(&mut h, start + Duration::from_secs(18));
    assert!(h.closed, "closed when the logout did not come");
}

#[test]
fn a_discovery_session_that_logs_out_when_asked_ends_cleanly() {
    let mut h = Harness::new(timed_portal(5, 10));
    discovery_login(&mut h);
    let start = h.now;
    let r = advance_to(&mut h, start + Duration::from_secs(10));
    assert!(r
        .iter()
        .any(|p| p.bhs.opcode() == Some(Opcode::AsyncMessage)));
    let mut l = Bhs::new(Opcode::LogoutRequest);
    l.set_immediate(true)
        .set_final(true)
        .set_itt(h.next_itt())
        .set_cmdsn(h.cmdsn);
    let r = h.send(&l, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::LogoutResponse));
    assert!(h.closed);
}
