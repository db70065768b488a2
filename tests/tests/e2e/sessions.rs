//! Login, discovery, I/O, several sessions, CHAP, ACL, reinstatement.

use ramslog_initiator::{discover, ChapParams, Credentials, Error, LoginParams, Session};
use ramslog_tests::{secret_file, TargetOptions, TargetProcess};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_discovery_write_read_flush() {
    let t = TargetProcess::start();
    let found = discover(t.addr(), INITIATOR, None)
        .await
        .expect("discovery");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, t.target_name());
    assert_eq!(found[0].1, vec![format!("{},1", t.addr())]);

    let s = open(&t, INITIATOR).await;
    let (last_lba, bs) = s.read_capacity16(0).await.expect("READ CAPACITY 16");
    assert_eq!((last_lba + 1) * bs as u64, 256 << 20);
    assert_eq!(bs, 512);
    let inq = s.inquiry(0, false, 0, 96).await.expect("INQUIRY");
    assert_eq!(&inq[8..15], b"RAMSLOG");

    for (lba, len, fua) in [
        (0u64, 512usize, false),
        (100, 64 * 1024, true),
        (5000, 1 << 20, false),
    ] {
        let data = random_bytes(len);
        s.write(0, lba, &data, fua).await.expect("WRITE");
        s.sync_cache(0).await.expect("SYNCHRONIZE CACHE");
        let back = s.read(0, lba, (len / 512) as u32, 512).await.expect("READ");
        assert!(back == data, "read back differs at lba {lba}");
    }
    s.logout().await.expect("logout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_sessions_at_once() {
    let t = TargetProcess::start();
    let mut sessions = Vec::new();
    for i in 0..8 {
        sessions.push(open(&t, &format!("{INITIATOR}-{i}")).await);
    }
    let mut tasks = Vec::new();
    for (i, s) in sessions.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let data = vec![i as u8 + 1; 4096];
            s.write(0, i as u64 * 8, &data, true).await.expect("write");
            assert_eq!(s.read(0, i as u64 * 8, 8, 512).await.expect("read"), data);
            s
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.expect("session task"));
    }
    // Every session sees every other's writes.
    for i in 0..8u64 {
        assert_eq!(
            done[0].read(0, i * 8, 8, 512).await.expect("read"),
            vec![i as u8 + 1; 4096]
        );
    }
    for s in done {
        s.logout().await.expect("logout");
    }
}

fn chap(user: &str, secret: &str, mutual: Option<(&str, &str)>) -> ChapParams {
    ChapParams {
        initiator: Credentials {
            name: user.into(),
            secret: secret.as_bytes().to_vec(),
        },
        mutual: mutual.map(|(u, s)| Credentials {
            name: u.into(),
            secret: s.as_bytes().to_vec(),
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chap_one_way_mutual_and_refusals() {
    let f1 = secret_file("chap", "initiator-secret-16");
    let f2 = secret_file("mchap", "target-secret-16b");
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec![
            "--chap-user".into(),
            "alice".into(),
            "--chap-secret-file".into(),
            f1.display().to_string(),
            "--mutual-chap-user".into(),
            "slog-a".into(),
            "--mutual-chap-secret-file".into(),
            f2.display().to_string(),
        ],
        ..Default::default()
    });
    let login = |c: Option<ChapParams>| {
        let mut p = LoginParams::normal(INITIATOR, t.target_name());
        p.chap = c;
        Session::login(t.addr(), p)
    };
    let s = login(Some(chap("alice", "initiator-secret-16", None)))
        .await
        .expect("one-way CHAP");
    s.logout().await.expect("logout");
    let s = login(Some(chap(
        "alice",
        "initiator-secret-16",
        Some(("slog-a", "target-secret-16b")),
    )))
    .await
    .expect("mutual CHAP");
    s.logout().await.expect("logout");
    // The target proves itself with the mutual secret; a wrong expectation is caught by the initiator.
    assert!(login(Some(chap(
        "alice",
        "initiator-secret-16",
        Some(("slog-a", "not-the-secret"))
    )))
    .await
    .is_err());
    for bad in [
        Some(chap("alice", "wrong-secret-000", None)),
        Some(chap("mallory", "initiator-secret-16", None)),
        None,
    ] {
        match login(bad).await {
            Err(Error::LoginFailed {
                class: 2,
                detail: 1,
            }) => {}
            other => panic!(
                "expected authentication failure, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    let _ = std::fs::remove_file(f1);
    let _ = std::fs::remove_file(f2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_refuses_and_hides_target() {
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec!["--allow".into(), INITIATOR.into()],
        ..Default::default()
    });
    match Session::login(
        t.addr(),
        LoginParams::normal("iqn.2026-11.org.example:intruder", t.target_name()),
    )
    .await
    {
        Err(Error::LoginFailed {
            class: 2,
            detail: 2,
        }) => {}
        other => panic!(
            "expected authorization failure, got {:?}",
            other.map(|_| ())
        ),
    }
    let seen = discover(t.addr(), "iqn.2026-11.org.example:intruder", None)
        .await
        .expect("discovery");
    assert!(
        seen.is_empty(),
        "an initiator outside the ACL must not see the target: {seen:?}"
    );
    let seen = discover(t.addr(), INITIATOR, None)
        .await
        .expect("discovery");
    assert_eq!(seen.len(), 1);
    open(&t, INITIATOR)
        .await
        .logout()
        .await
        .expect("allowed initiator logs in");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_target_is_not_found() {
    let t = TargetProcess::start();
    match Session::login(
        t.addr(),
        LoginParams::normal(INITIATOR, "iqn.2026-11.org.ramslog:nope"),
    )
    .await
    {
        Err(Error::LoginFailed {
            class: 2,
            detail: 3,
        }) => {}
        other => panic!("expected not found, got {:?}", other.map(|_| ())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_reinstatement_replaces_the_old_session() {
    let t = TargetProcess::start();
    let isid = [0x80, 1, 2, 3, 0, 1];
    let mut p = LoginParams::normal(INITIATOR, t.target_name());
    p.isid = Some(isid);
    let old = Session::login(t.addr(), p.clone())
        .await
        .expect("first login");
    clear_unit_attentions(&old).await;
    let new = Session::login(t.addr(), p)
        .await
        .expect("reinstating login");
    clear_unit_attentions(&new).await;
    tokio::time::sleep(SHORT).await;
    assert!(
        old.test_unit_ready(0).await.is_err(),
        "the old session must be closed"
    );
    assert!(new.test_unit_ready(0).await.expect("TUR").is_good());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crc32c_header_and_data_digests() {
    let t = TargetProcess::start();
    let mut p = LoginParams::normal(INITIATOR, t.target_name());
    p.header_digest = ramslog_initiator::Digest::Crc32c;
    p.data_digest = ramslog_initiator::Digest::Crc32c;
    let s = Session::login(t.addr(), p)
        .await
        .expect("login with digests");
    assert!(s.negotiated().header_digest && s.negotiated().data_digest);
    clear_unit_attentions(&s).await;
    // Sizes that need padding, immediate data, unsolicited Data-Out and R2T.
    for (lba, len) in [
        (0u64, 512usize),
        (64, 3 * 512),
        (4096, 300 * 1024),
        (9000, 2 << 20),
    ] {
        let data = random_bytes(len);
        s.write(0, lba, &data, false)
            .await
            .expect("write with digests");
        assert!(
            s.read(0, lba, (len / 512) as u32, 512)
                .await
                .expect("read with digests")
                == data
        );
    }
    s.logout().await.expect("logout");
}

/// libiscsi's own utilities, as an admin would use them.
#[test]
fn libiscsi_utilities_work() {
    let t = TargetProcess::start();
    let run = |tool: &str, args: &[&str]| {
        let out = std::process::Command::new(tool)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{tool} (apt-get install libiscsi-bin): {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let url = t.url(0);
    let inq = run("iscsi-inq", &[&url]);
    assert!(
        inq.contains("Vendor:RAMSLOG") && inq.contains("DIRECT_ACCESS"),
        "{inq}"
    );
    let cap = run("iscsi-readcapacity16", &[&url]);
    assert!(cap.contains("Total size:268435456"), "{cap}");
    let ls = run("iscsi-ls", &["-s", &format!("iscsi://{}", t.addr())]);
    assert!(ls.contains(t.target_name()) && ls.contains("Lun:0"), "{ls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_4096() {
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec!["--block-size".into(), "4096".into()],
        ..Default::default()
    });
    let s = open(&t, INITIATOR).await;
    assert_eq!(
        s.read_capacity16(0).await.expect("READ CAPACITY 16"),
        ((256 << 20) / 4096 - 1, 4096)
    );
    let data = random_bytes(3 * 4096);
    s.write(0, 10, &data, true).await.expect("write");
    assert!(s.read(0, 10, 3, 4096).await.expect("read") == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_with_several_targets_and_luns() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let port = ramslog_tests::free_port();
    let cfg = dir.join("ramslog.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"listen = ["127.0.0.1:{port}"]

[[target]]
name = "iqn.2026-11.org.ramslog:slog-a"
[[target.lun]]
lun = 0
size = "16M"
[[target.lun]]
lun = 1
size = "32M"
block_size = 4096

[[target]]
name = "iqn.2026-11.org.ramslog:slog-b"
allow = ["{INITIATOR}"]
[[target.lun]]
size = "8M"
"#
        ),
    )
    .expect("write config");
    /// Stops the daemon even when an assertion fails first.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _daemon = KillOnDrop(
        std::process::Command::new(ramslog_tests::target_binary())
            .args(["--ephemeral", "--config"])
            .arg(&cfg)
            .arg("--control-socket")
            .arg(dir.join("control.sock"))
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start ramslog-target"),
    );
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let mut found = Vec::new();
    for _ in 0..100 {
        if let Ok(f) = discover(addr, INITIATOR, None).await {
            found = f;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "iqn.2026-11.org.ramslog:slog-a",
            "iqn.2026-11.org.ramslog:slog-b"
        ]
    );
    let others = discover(addr, "iqn.2026-11.org.example:other", None)
        .await
        .expect("discovery");
    assert_eq!(
        others.len(),
        1,
        "slog-b is hidden from initiators outside its ACL: {others:?}"
    );

    let s = Session::login(
        addr,
        LoginParams::normal(INITIATOR, "iqn.2026-11.org.ramslog:slog-a"),
    )
    .await
    .expect("login");
    clear_unit_attentions(&s).await;
    assert_eq!(s.report_luns().await.expect("REPORT LUNS"), vec![0, 1]);
    // Unit attentions are per logical unit: LUN 1 reports its own power-on UA once.
    let r = s.test_unit_ready(1).await.expect("TUR LUN 1");
    assert_eq!(
        sense(&r).0,
        ramslog_common::scsi_wire::sense_key::UNIT_ATTENTION
    );
    assert!(s.test_unit_ready(1).await.expect("TUR LUN 1").is_good());
    assert_eq!(
        s.read_capacity16(0).await.expect("RC16"),
        ((16 << 20) / 512 - 1, 512)
    );
    assert_eq!(
        s.read_capacity16(1).await.expect("RC16"),
        ((32 << 20) / 4096 - 1, 4096)
    );
    s.logout().await.expect("logout");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--max-connections-per-host 2`: a third logged-in connection from one
/// address is refused while two are open, one from another address is not,
/// and the place comes back when a connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logged_in_connections_are_capped_per_host() {
    use ramslog_initiator::Connection;
    use std::net::{IpAddr, Ipv4Addr};
    let t = TargetProcess::start_with(TargetOptions {
        extra_args: vec!["--max-connections-per-host".into(), "2".into()],
        ..Default::default()
    });
    let params = |n: u8| {
        let mut p = LoginParams::normal(format!("{INITIATOR}-{n}"), t.target_name());
        p.isid = Some([0x80, 0, 0, 0, 0, n]);
        p
    };
    let login_from = |from: Ipv4Addr, n: u8| {
        let (addr, p) = (t.addr(), params(n));
        async move {
            let mut c = Connection::connect_from(IpAddr::V4(from), addr)
                .await
                .expect("connect");
            c.login(&p).await.map(|_| c)
        }
    };
    let one = Ipv4Addr::new(127, 0, 0, 1);
    let a = login_from(one, 1).await.expect("first from 127.0.0.1");
    let _b = login_from(one, 2).await.expect("second from 127.0.0.1");
    // Refused as the cap says (Target Error, Out Of Resources), not for
    // any other reason a login could fail.
    match login_from(one, 3).await {
        Err(ramslog_initiator::Error::LoginFailed {
            class: 0x03,
            detail: 0x02,
        }) => {}
        Err(e) => panic!("the third login failed, but not for the cap: {e}"),
        Ok(_) => panic!("a third logged-in connection from one host was allowed"),
    }
    let _other = login_from(Ipv4Addr::new(127, 0, 0, 2), 4)
        .await
        .expect("another host is not limited by the first one's count");
    drop(a);
    // The daemon frees the place when it sees the connection end.
    let mut again = None;
    for _ in 0..100 {
        if let Ok(c) = login_from(one, 5).await {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(again.is_some(), "the place never came back");
}
