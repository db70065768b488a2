//! Admission under floods: connections that have not logged in, and
//! discovery sessions, live in pools of their own, so no unauthenticated
//! peer can take the places of the initiators on the ACL.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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
/// ACL from another address. The discovery pool must really be full when
/// it logs in (16 sessions open, the cap given here), or the test shows
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_sessions_from_17_addresses_do_not_lock_out_the_allowed_initiator() {
    const POOL: usize = 16;
    let t = target_with_acl(&[
        "--max-discovery-sessions",
        &POOL.to_string(),
        "--max-discovery-sessions-per-host",
        "2",
    ]);
    let open = Arc::new(AtomicUsize::new(0));
    let mut held = 0;
    for n in 2..=18u8 {
        for _ in 0..16 {
            if let Some(c) = discovery_session(&t, host(n)).await {
                held += 1;
                let open = open.clone();
                open.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    answer_pings(c).await;
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        }
    }
    // The sessions the target evicted end as it closes them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while open.load(Ordering::SeqCst) != POOL {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the discovery pool is not full: {} of {POOL} sessions open after {held} logins",
            open.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("{held} discovery logins, {POOL} sessions open");
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

/// Seconds the lasting floods run: 15 s is three discovery lifetimes (5 s,
/// set below) and more than three NOP-In interval-and-timeouts (4 s), so
/// every pool is emptied and filled again several times while the allowed
/// initiator logs in each second (RAMSLOG_FLOOD_SECONDS for longer runs).
fn flood_seconds() -> u64 {
    std::env::var("RAMSLOG_FLOOD_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
}

/// One discovery flooder: logs in from `from`, answers pings, and when the
/// target ends the session (eviction, lifetime, refusal) reconnects at once.
async fn discovery_flooder(
    target: std::net::SocketAddr,
    from: IpAddr,
    until: tokio::time::Instant,
) -> u64 {
    let mut sessions = 0;
    while tokio::time::Instant::now() < until {
        let Ok(mut c) = Connection::connect_from(from, target).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let p = LoginParams::discovery(format!("iqn.2026-11.org.ramslog:flood-{from}"));
        match tokio::time::timeout(Duration::from_secs(5), c.login(&p)).await {
            Ok(Ok(_)) => {
                sessions += 1;
                let _ = tokio::time::timeout_at(until, answer_pings(c)).await;
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    sessions
}

/// One pending flooder: a connection that sends nothing, again at once
/// when the target closes it.
async fn pending_flooder(
    target: std::net::SocketAddr,
    from: IpAddr,
    until: tokio::time::Instant,
) -> u64 {
    use tokio::io::AsyncReadExt;
    let mut connections = 0;
    while tokio::time::Instant::now() < until {
        let Ok(socket) = tokio::net::TcpSocket::new_v4() else {
            return connections;
        };
        if socket.bind(std::net::SocketAddr::new(from, 0)).is_err() {
            return connections;
        }
        let Ok(mut s) = socket.connect(target).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        connections += 1;
        let mut b = [0u8; 64];
        // Read until the target closes it (eviction or the first-PDU timeout).
        let _ = tokio::time::timeout_at(until, async {
            while let Ok(n) = s.read(&mut b).await {
                if n == 0 {
                    return;
                }
            }
        })
        .await;
    }
    connections
}

/// The lasting floods: discovery sessions from 17 addresses that answer
/// NOP-Ins and reconnect at once when ended, and 64 addresses x 4
/// connections that send nothing and reconnect likewise, for longer than
/// nop_interval + nop_timeout and the discovery lifetime (shortened by
/// flag). The initiator on the ACL must log in every second throughout.
async fn allowed_initiator_logs_in_every_second_under_floods(chap: Option<&str>) {
    let mut extra = vec![
        "--nop-interval",
        "2",
        "--nop-timeout",
        "2",
        "--discovery-lifetime",
        "5",
    ];
    let secret_arg = chap
        .map(|secret| {
            ramslog_tests::secret_file("flood-chap", secret)
                .display()
                .to_string()
        })
        .unwrap_or_default();
    if chap.is_some() {
        extra.extend([
            "--chap-user",
            "slog-host",
            "--chap-secret-file",
            &secret_arg,
        ]);
    }
    let t = target_with_acl(&extra);
    let seconds = flood_seconds();
    let until = tokio::time::Instant::now() + Duration::from_secs(seconds + 5);
    let mut floods = Vec::new();
    for n in 2..=18u8 {
        for _ in 0..16 {
            floods.push(tokio::spawn(discovery_flooder(t.addr(), host(n), until)));
        }
    }
    let mut pending = Vec::new();
    for n in 1..=64u8 {
        for _ in 0..4 {
            let from = IpAddr::V4(Ipv4Addr::new(127, 0, 1, n));
            pending.push(tokio::spawn(pending_flooder(t.addr(), from, until)));
        }
    }
    // Let the floods fill every pool first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for second in 0..seconds {
        let tick = tokio::time::Instant::now();
        let mut p = LoginParams::normal(ALLOWED, t.target_name());
        if let Some(secret) = chap {
            p.chap = Some(ramslog_initiator::ChapParams {
                initiator: ramslog_initiator::Credentials {
                    name: "slog-host".into(),
                    secret: secret.as_bytes().to_vec(),
                },
                mutual: None,
            });
        }
        match tokio::time::timeout(Duration::from_secs(5), Session::login(t.addr(), p)).await {
            Ok(Ok(s)) => {
                slowest = slowest.max(tick.elapsed());
                let _ = s.logout().await;
            }
            Ok(Err(e)) => failures.push(format!("second {second}: {e}")),
            Err(_) => failures.push(format!("second {second}: no answer in 5 s")),
        }
        tokio::time::sleep_until(tick + Duration::from_secs(1)).await;
    }
    let mut discovery_sessions = 0;
    for f in floods {
        discovery_sessions += f.await.unwrap_or(0);
    }
    let mut pending_connections = 0;
    for f in pending {
        pending_connections += f.await.unwrap_or(0);
    }
    if chap.is_some() {
        let _ = std::fs::remove_file(&secret_arg);
    }
    println!(
        "{seconds} s of floods: {discovery_sessions} discovery sessions, {pending_connections} \
         silent connections; slowest allowed login {slowest:?}"
    );
    assert!(
        discovery_sessions > 17 * 2 && pending_connections > 64 * 4,
        "the floods ran: {discovery_sessions} discovery sessions, {pending_connections} connections"
    );
    assert!(
        failures.is_empty(),
        "the allowed initiator could not log in {} of {seconds} times: {}",
        failures.len(),
        failures.join("; ")
    );
    let log = t.output();
    let lines = log
        .lines()
        .filter(|l| l.contains("evicted the oldest"))
        .count() as u64;
    assert!(lines > 0, "evictions are logged");
    assert!(
        lines <= 2 * (seconds + 10),
        "evictions are logged at most once a second per reason: {lines} lines in {seconds} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_that_last_never_keep_the_allowed_initiator_out() {
    allowed_initiator_logs_in_every_second_under_floods(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_that_last_never_keep_the_allowed_initiator_out_with_chap() {
    allowed_initiator_logs_in_every_second_under_floods(Some("flood-chap-secret-1")).await;
}
