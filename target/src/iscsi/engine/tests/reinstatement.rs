//! Session reinstatement: the new login is answered only once the old
//! connection is gone (its permit dropped, which happens after its engine
//! ended and, on iSER, after its queue pair was destroyed), or refused with
//! Service Unavailable after a bounded wait. Otherwise writes the old
//! session still had in flight could land after the new session's writes
//! to the same blocks.

use super::*;

const FULL_FEATURE_LOGIN: u8 =
    login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;

fn keys() -> Vec<(&'static str, &'static str)> {
    vec![
        ("InitiatorName", INI),
        ("TargetName", IQN),
        ("SessionType", "Normal"),
    ]
}

/// A logged-in session whose connection has a transport behind it: it is
/// released only when the test says so.
fn old_session(portal: &Arc<Portal>) -> (Harness, Arc<SessionControl>) {
    let control = SessionControl::new();
    let mut h = Harness::new(portal.clone());
    h.conn = Connection::tcp(portal.clone(), h.conn.info, control.clone(), h.now);
    assert_eq!(h.login(&[]).bhs.login_status(), login_status::SUCCESS);
    (h, control)
}

fn login_responses(r: &[Rsp]) -> Vec<u16> {
    r.iter()
        .filter(|p| p.bhs.opcode() == Some(Opcode::LoginResponse))
        .map(|p| p.bhs.login_status())
        .collect()
}

#[test]
fn the_new_login_waits_until_the_old_connection_is_released() {
    let portal = RamPortal::new(IQN).build();
    let (_old, old_control) = old_session(&portal);
    let mut new = Harness::new(portal.clone());
    let r = new.login_pdu(FULL_FEATURE_LOGIN, &keys());
    assert!(
        old_control.is_terminated(),
        "the old session is told to end"
    );
    assert!(
        login_responses(&r).is_empty(),
        "the new login was answered while the old connection still holds its resources"
    );
    // Time passes and the old connection is still there: still no answer.
    new.now += Duration::from_millis(500);
    new.conn.handle(new.now, Input::Timeout);
    assert!(
        login_responses(&new.drain()).is_empty(),
        "the new login was answered while the old connection still holds its resources"
    );
    old_control.release_for_test();
    let recheck = new.conn.poll_timeout().expect("the engine checks again");
    assert!(
        recheck <= new.now + Duration::from_millis(50),
        "rechecked soon"
    );
    new.now = recheck;
    new.conn.handle(new.now, Input::Timeout);
    assert_eq!(
        login_responses(&new.drain()),
        vec![login_status::SUCCESS],
        "answered once the old connection is gone"
    );
    assert!(new.conn.is_logged_in());
    new.clear_unit_attention();
}

#[test]
fn an_old_connection_that_never_goes_away_gets_the_new_login_refused() {
    let portal = RamPortal::new(IQN).build();
    let (_old, _old_control) = old_session(&portal);
    let mut new = Harness::new(portal.clone());
    let mut statuses = login_responses(&new.login_pdu(FULL_FEATURE_LOGIN, &keys()));
    let give_up = new.now + Duration::from_secs(60);
    while statuses.is_empty() && new.now < give_up {
        let Some(t) = new.conn.poll_timeout() else {
            break;
        };
        new.now = t.max(new.now);
        new.conn.handle(new.now, Input::Timeout);
        statuses = login_responses(&new.drain());
    }
    assert_eq!(
        statuses,
        vec![0x0301],
        "Service Unavailable (0x0301) after a bounded wait"
    );
    assert!(new.closed, "the refused connection ends");
    assert!(!new.conn.is_logged_in());
}

/// A connection with no transport behind it is released when terminated:
/// the engine answers the new login at once.
#[test]
fn reinstating_a_released_session_answers_at_once() {
    let portal = RamPortal::new(IQN).build();
    let mut old = Harness::new(portal.clone());
    assert_eq!(old.login(&[]).bhs.login_status(), login_status::SUCCESS);
    let mut new = Harness::new(portal);
    let r = new.login_pdu(FULL_FEATURE_LOGIN, &keys());
    assert_eq!(login_responses(&r), vec![login_status::SUCCESS]);
}
