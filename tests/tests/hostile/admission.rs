//! Admission under floods: connections that have not logged in, and
//! discovery sessions, live in pools of their own, so no unauthenticated
//! peer can take the places of the initiators on the ACL.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use ramslog_initiator::{Connection, LoginParams, Session};
use ramslog_tests::{TargetOptions, TargetProcess};

/// The initiator the ACL admits.
const ALLOWED: &str = "iqn.2026-11.org.ramslog:allowed-host";

/// 127.0.0.`n`: each one a host of its own on the loopback network.
fn host(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

/// A discovery session that answers the target's NOP-In pings, as a
/// well-written (or well-disguised) initiator would.
async fn discovery_session(t: &TargetProcess, from: IpAddr) -> Option<Connection> {
    let mut c = Connection::connect_from(from, t.addr()).await.ok()?;
    let p = LoginParams::discovery(format!("iqn.2026-11.org.ramslog:flood-{from}"));
    tokio::time::timeout(Duration::from_secs(5), c.login(&p))
        .await
        .ok()?
        .ok()?;
    Some(c)
}

/// Keep `c` alive: answer every NOP-In until the target closes it.
async fn answer_pings(mut c: Connection) {
    while let Ok(p) = c.recv_pdu().await {
        if p.bhs.opcode() == Some(ramslog_common::iscsi::Opcode::NopIn)
            && c.answer_nop_in(&p).await.is_err()
        {
            return;
        }
    }
}

fn target_with_acl(extra: &[&str]) -> TargetProcess {
    let mut extra_args = vec!["--allow".to_string(), ALLOWED.to_string()];
    extra_args.extend(extra.iter().map(|s| s.to_string()));
    TargetProcess::start_with(TargetOptions {
        extra_args,
        ..Default::default()
    })
}

/// The reproduction: 16 discovery sessions from each of 17 addresses
/// (127.0.0.2-18) held open, then a normal login of the initiator on the
/// ACL from another address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "locked out by discovery sessions")]
async fn discovery_sessions_from_17_addresses_do_not_lock_out_the_allowed_initiator() {
    let t = target_with_acl(&[]);
    let mut held = 0;
    for n in 2..=18u8 {
        for _ in 0..16 {
            if let Some(c) = discovery_session(&t, host(n)).await {
                held += 1;
                tokio::spawn(answer_pings(c));
            }
        }
    }
    println!("{held} discovery sessions held");
    let login = Session::login(t.addr(), LoginParams::normal(ALLOWED, t.target_name()));
    let s = tokio::time::timeout(Duration::from_secs(10), login)
        .await
        .map_err(|_| "timed out".to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
        .unwrap_or_else(|e| {
            panic!("the allowed initiator is locked out by discovery sessions ({held} held): {e}")
        });
    s.logout().await.expect("logout");
}
