//! Closing the admission gate ends every connection the daemon serves:
//! normal and discovery sessions, and a connection that has not logged in.
//! Each connection's session control is the one its permit watches (the
//! driver registers it before the engine sees a byte), so no session can
//! escape the gate's close, and a stop needs no second pass over the
//! iSCSI portal's session table. The real TCP driver (`tcp::serve`) and
//! real logins by ramslog-initiator.

use std::time::{Duration, Instant};

use ramslog_initiator::{LoginParams, Session};
use ramslog_target::testkit;
use tokio::io::AsyncReadExt;

const IQN: &str = "iqn.2026-12.org.ramslog:gate-close";
const INITIATOR: &str = "iqn.2026-12.org.ramslog:gate-close-client";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_gate_ends_every_session_and_connection() {
    let portal = testkit::RamPortal::new(IQN).size(1 << 20).build();
    let listener =
        ramslog_target::tcp::listen("127.0.0.1:0".parse().expect("addr")).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(ramslog_target::tcp::serve(listener, portal.clone()));

    let mut sessions = Vec::new();
    for _ in 0..3 {
        let s = Session::login(addr, LoginParams::normal(INITIATOR, IQN))
            .await
            .expect("normal login");
        sessions.push(s);
    }
    for _ in 0..2 {
        let s = Session::login(addr, LoginParams::discovery(INITIATOR))
            .await
            .expect("discovery login");
        sessions.push(s);
    }
    let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
    assert_eq!(portal.sessions_info().len(), 5, "the sessions logged in");
    let (normal, discovery) = portal.sessions_info().iter().fold((0, 0), |(n, d), s| {
        if s.discovery {
            (n, d + 1)
        } else {
            (n + 1, d)
        }
    });
    assert_eq!((normal, discovery), (3, 2));

    // The silent connection is admitted (its driver may not have
    // registered its control yet: then it ends as it registers).
    let deadline = Instant::now() + Duration::from_secs(10);
    while portal.core.gate.counts_now().total < 6 {
        assert!(
            Instant::now() < deadline,
            "the silent connection was never admitted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let told = portal.core.gate.close(false);
    assert!(
        told >= 5,
        "the five sessions are the gate's to end; it told {told}"
    );

    // The silent connection is closed by the target.
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut byte))
        .await
        .expect("the silent connection ends within 10 s");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // Every session is gone from the portal, and each initiator sees its
    // connection end.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !portal.sessions_info().is_empty() {
        assert!(
            Instant::now() < deadline,
            "sessions outlived the gate's close: {:?}",
            portal
                .sessions_info()
                .iter()
                .map(|s| s.tsih)
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for s in &sessions {
        let r = tokio::time::timeout(Duration::from_secs(10), s.nop()).await;
        assert!(
            matches!(r, Ok(Err(_))),
            "a session still answers after the gate closed"
        );
    }
    server.abort();
}
