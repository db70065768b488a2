//! The identity rule: a restart that lost the content (a crash, kill -9)
//! keeps the identity but answers NOT READY (04h/03h) until `accept-empty`,
//! which makes the LUN ready under a new identity.

use std::process::Command;

use ramslog_common::scsi_wire::{sense_key, status};
use ramslog_initiator::cdb;
use ramslog_tests::{target_binary, TargetOptions, TargetProcess};

use super::*;

async fn vpd(s: &Session, page: u8) -> Vec<u8> {
    s.inquiry(0, true, page, 255).await.expect("INQUIRY VPD")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_is_not_ready_until_accept_empty() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-identity-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = TargetOptions {
        ephemeral: false,
        state_dir: Some(dir.clone()),
        ..Default::default()
    };

    let mut t = TargetProcess::start_with(opts.clone());
    let s = open(&t, INITIATOR).await;
    let (serial, naa) = (vpd(&s, 0x80).await, vpd(&s, 0x83).await);
    s.write(0, 0, &[0xa5; 4096], true)
        .await
        .expect("write before restart");
    drop(s);
    // A crash: no dump, so the acknowledged write is gone.
    t.kill();

    let t = TargetProcess::start_with(TargetOptions {
        port: Some(t.port()),
        ..opts.clone()
    });
    let s = Session::login(t.addr(), LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("login");
    // A second host, logged in before the admin acts: it must learn of the
    // new identity as well.
    let other = Session::login(
        t.addr(),
        LoginParams::normal(format!("{INITIATOR}-other"), t.target_name()),
    )
    .await
    .expect("login of the other host");
    // Same identity, so the host recognises the device it wrote to ...
    assert_eq!(vpd(&s, 0x80).await, serial);
    assert_eq!(vpd(&s, 0x83).await, naa);
    // ... and every media access says the content is gone.
    let mut saw_not_ready = false;
    for _ in 0..4 {
        let r = s.test_unit_ready(0).await.expect("TUR");
        if r.status == status::CHECK_CONDITION && sense(&r) == (sense_key::NOT_READY, 0x04, 0x03) {
            saw_not_ready = true;
            break;
        }
    }
    assert!(saw_not_ready, "TEST UNIT READY must report 04h/03h");
    for (cdb, out, inlen) in [
        (cdb::read16(0, 8).to_vec(), None, 4096u32),
        (cdb::write16(8, 8, false).to_vec(), Some(vec![1u8; 4096]), 0),
        (cdb::sync_cache10().to_vec(), None, 0),
    ] {
        let r = s
            .command(0, &cdb, out.as_deref(), inlen)
            .await
            .expect("command");
        assert_eq!(r.status, status::CHECK_CONDITION);
        assert_eq!(
            sense(&r),
            (sense_key::NOT_READY, 0x04, 0x03),
            "opcode {:#x}",
            cdb[0]
        );
        assert!(
            r.data.is_empty(),
            "no data may come back from a LUN that lost its content"
        );
    }
    let st = cli(&["status"], &dir);
    assert!(
        String::from_utf8_lossy(&st.stdout).contains("NOT READY"),
        "status: {st:?}"
    );

    let out = cli(&["accept-empty", t.target_name(), "0"], &dir);
    assert!(
        out.status.success(),
        "accept-empty failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = cli(&["accept-empty", "iqn.2026-11.org.ramslog:none", "0"], &dir);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no target named"));

    // Every host is told, once each, that the inquiry data and the reported
    // LUNs changed (3Fh/03h, 3Fh/0Eh), then the LUN is ready and empty. The
    // other host never saw a command before: its power-on unit attention
    // (29h/00h) comes first.
    for (host, session, expect) in [
        ("the writing host", &s, vec![(0x3f, 0x03), (0x3f, 0x0e)]),
        (
            "the other host",
            &other,
            vec![(0x29, 0x00), (0x3f, 0x03), (0x3f, 0x0e)],
        ),
    ] {
        let mut seen = Vec::new();
        loop {
            let r = session.test_unit_ready(0).await.expect("TUR");
            if r.is_good() {
                break;
            }
            let (key, asc, ascq) = sense(&r);
            assert_eq!(key, sense_key::UNIT_ATTENTION, "{host}: {r:?}");
            seen.push((asc, ascq));
            assert!(
                seen.len() <= 4,
                "{host}: unit attentions never end: {seen:?}"
            );
        }
        assert_eq!(seen, expect, "{host}'s unit attentions");
    }
    assert!(s.test_unit_ready(0).await.expect("TUR").is_good());
    assert_ne!(vpd(&s, 0x80).await, serial, "new serial after accept-empty");
    assert_ne!(vpd(&s, 0x83).await, naa, "new NAA after accept-empty");
    assert_eq!(s.read(0, 0, 8, 512).await.expect("read"), vec![0u8; 4096]);
    let st = cli(&["status"], &dir);
    assert!(!String::from_utf8_lossy(&st.stdout).contains("NOT READY"));
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_without_a_daemon_names_the_fix() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-nodaemon-{}", std::process::id()));
    let out = cli(&["status"], &dir);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is it running?"));
}

/// The quick start runs `--ephemeral` without a state directory; `status`,
/// with no flags, must still find it (issue 13, item 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_finds_an_ephemeral_daemon_without_flags() {
    let t = TargetProcess::start_with(TargetOptions {
        default_control_socket: true,
        ..Default::default()
    });
    let out = Command::new(target_binary())
        .arg("status")
        .output()
        .expect("run ramslog-target status");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "status without flags failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("(none: --ephemeral)"), "{stdout}");
    assert!(stdout.contains(t.target_name()), "{stdout}");
    // A second ephemeral daemon on the same default socket is told how to
    // coexist instead of taking the socket over.
    let second = Command::new(target_binary())
        .args(["--ephemeral", "--size", "16M", "--listen"])
        .arg(format!("127.0.0.1:{}", ramslog_tests::free_port()))
        .output()
        .expect("run a second ramslog-target");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "second daemon started: {stderr}");
    assert!(stderr.contains("--control-socket"), "{stderr}");
    drop(t);
    // A clean stop removes the socket, so the next `status` says nothing runs.
    let after = Command::new(target_binary())
        .arg("status")
        .output()
        .expect("run ramslog-target status");
    let stderr = String::from_utf8_lossy(&after.stderr);
    assert!(!after.status.success());
    assert!(stderr.contains("is the daemon running?"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_into_a_closed_pipe_is_not_a_crash() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-pipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let t = TargetProcess::start_with(TargetOptions {
        ephemeral: false,
        state_dir: Some(dir.clone()),
        ..Default::default()
    });
    // `status | grep -q ready`: the reader is gone before the status is written.
    let mut child = Command::new(target_binary())
        .args(["status", "--state-dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ramslog-target status");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status failed: {stderr}");
    assert!(!stderr.contains("panicked"), "status panicked: {stderr}");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The control socket's path may hold something else (a file left by an
/// admin, a symlink): the daemon refuses to start instead of deleting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_socket_at_the_control_path_is_not_removed() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-ctl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("control.sock");
    std::fs::write(&path, "precious").expect("write");
    let mut child = Command::new(target_binary())
        .args(["--size", "1M", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&dir)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    // A daemon that started anyway is stopped after a while.
    let started = std::time::Instant::now();
    while child.try_wait().ok().flatten().is_none() && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().expect("wait");
    assert_eq!(
        std::fs::read_to_string(&path).ok().as_deref(),
        Some("precious"),
        "defect 11: the file at the control socket path was removed"
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request line longer than 64 KiB gets an error and the connection ends;
/// the daemon keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_requests_are_bounded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-ctl-long-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let t = TargetProcess::start_with(TargetOptions {
        ephemeral: false,
        state_dir: Some(dir.clone()),
        ..Default::default()
    });
    let mut s = tokio::net::UnixStream::connect(dir.join("control.sock"))
        .await
        .expect("connect");
    let junk = vec![b'x'; 1 << 20];
    let _ = tokio::time::timeout(Duration::from_secs(5), s.write_all(&junk)).await;
    let mut reply = Vec::new();
    // The reply, then the end of the connection (a reset: our unread junk).
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply)).await;
    assert!(
        read.is_ok() && String::from_utf8_lossy(&reply).contains("64 KiB"),
        "defect 11: an endless request line was neither refused nor closed: {read:?} {:?}",
        String::from_utf8_lossy(&reply)
    );
    let st = cli(&["status"], &dir);
    assert!(st.status.success(), "status still works");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The socket's credentials check holds even when an admin loosened the
/// socket's mode: another user's `accept-empty` is refused with a reason and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_is_refused_by_the_control_socket() {
    use std::os::unix::fs::PermissionsExt;
    assert!(
        ramslog_tests::find_in_path("setpriv").is_some(),
        "setpriv (util-linux) is needed; tests/run-all.sh installs it"
    );
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-peercred-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let options = |port: Option<u16>| TargetOptions {
        ephemeral: false,
        state_dir: Some(dir.clone()),
        port,
        ..Default::default()
    };
    // A LUN that lost its content: accept-empty would change it, stop
    // would end the daemon. Neither may be another user's to do.
    let mut t = TargetProcess::start_with(options(None));
    let port = t.port();
    let s = open(&t, INITIATOR).await;
    s.write(0, 0, &[0x42; 4096], true).await.expect("WRITE");
    drop(s);
    t.kill();
    let mut t = TargetProcess::start_with(options(Some(port)));
    // The daemon makes its state directory 0700 at start; opened up here so
    // that another user reaches the socket at all.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let socket = dir.join("control.sock");
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(&socket)
        .expect("stat control.sock")
        .mode()
        & 0o7777;
    assert_eq!(
        mode, 0o600,
        "the control socket is the daemon's user's only: mode {mode:o}"
    );
    // Opened up on purpose: the peer's credentials must refuse by themselves.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    // The targets and LUNs (identity, readiness, generation): the process's
    // memory in the same report moves on its own.
    let targets = |out: &std::process::Output| -> serde_json::Value {
        let st: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json");
        st["targets"].clone()
    };
    let before = cli(&["status", "--json"], &dir);
    assert!(before.status.success(), "status as the daemon's user");
    assert!(
        String::from_utf8_lossy(&before.stdout).contains("no clean image"),
        "the LUN must be NOT READY for accept-empty to mean anything"
    );

    let (uid, gid) = ("65534", "65534");
    let as_other = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid", uid, "--regid", gid, "--clear-groups"])
            .arg(target_binary())
            .args(args)
            .arg("--control-socket")
            .arg(&socket)
            .output()
            .expect("run as another user")
    };
    for request in [vec!["accept-empty", t.target_name(), "0"], vec!["stop"]] {
        let other = as_other(&request);
        let err = String::from_utf8_lossy(&other.stderr);
        assert!(
            !other.status.success(),
            "another user's {request:?} ran: {err}"
        );
        assert!(
            err.contains("refused") && err.contains(uid),
            "defect 11: the refusal of {request:?} does not say why: {err}"
        );
    }
    // A stop is answered only once the daemon has stopped, and logged when
    // it begins: a refused one left no trace but its refusal (one per
    // request) and the daemon still serves.
    assert_eq!(
        t.output()
            .matches("control socket: refusing a client of another user")
            .count(),
        2,
        "each refusal is logged\n{}",
        t.output_tail(10)
    );
    assert!(
        !t.output().contains("stop requested"),
        "another user's stop began a shutdown: {}",
        t.output_tail(10)
    );
    let after = cli(&["status", "--json"], &dir);
    assert!(after.status.success(), "the daemon still answers");
    assert_eq!(
        targets(&before),
        targets(&after),
        "another user's request changed the daemon"
    );
    assert!(t.is_running());
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
