//! The shipped systemd unit, and the readiness protocol it relies on.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use ramslog_tests::{find_in_path, target_binary, TargetOptions, TargetProcess};

fn unit_text() -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/systemd/ramslog-target.service");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `systemd-analyze verify` accepts the unit (with ExecStart pointing at the
/// binary just built, since verify checks that it exists).
/// `text` as `ramslog-target.service` in a fresh directory of its own:
/// (the directory, the unit file).
fn unit_copy(name: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("ramslog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let copy = dir.join("ramslog-target.service");
    std::fs::write(&copy, text).expect("write unit");
    (dir, copy)
}

/// The unit sets none of `keys` (each `Name=`): such a setting `why`.
fn lacks(unit: &str, keys: &[&str], why: &str) {
    for key in keys {
        assert!(!unit.lines().any(|l| l.starts_with(key)), "{key} {why}");
    }
}

#[test]
fn the_unit_verifies() {
    assert!(
        find_in_path("systemd-analyze").is_some(),
        "systemd-analyze (package systemd) is needed; tests/run-all.sh installs it"
    );
    let unit = unit_text();
    for must in [
        "LimitMEMLOCK=infinity",
        "RequiresMountsFor=/var/lib/ramslog /var/lib/ramslog/images",
        "Type=notify",
        "TimeoutStopSec=",
        "TimeoutStartSec=",
        // A crash comes back at once, with the fd store holding the memory.
        "Restart=on-failure",
        "RestartSec=100ms",
        "StartLimitIntervalSec=0",
        "FileDescriptorStoreMax=",
        "OOMScoreAdjust=-1000",
    ] {
        assert!(unit.contains(must), "the unit must have {must}");
    }
    let hides = [
        "ProtectSystem=",
        "PrivateTmp=",
        "ReadOnlyPaths=",
        "TemporaryFileSystem=",
    ];
    lacks(&unit, &hides, "could hide the state or image directory");
    let bin = target_binary().display().to_string();
    let (dir, copy) = unit_copy("unit", &unit.replace("/usr/bin/ramslog-target", &bin));
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .env("SYSTEMD_LOG_LEVEL", "notice")
        .output()
        .expect("systemd-analyze");
    let err = String::from_utf8_lossy(&out.stderr);
    // Complaints about other units on this machine are not ours.
    let ours: Vec<&str> = err.lines().filter(|l| l.contains("ramslog")).collect();
    assert!(out.status.success() && ours.is_empty(), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The unit confines the daemon without hiding devices or making a mount
/// namespace (those could hide /dev/infiniband or the state directory), and
/// `systemd-analyze security` scores it at or below the threshold: its exit
/// status says so (plain `security` always exits 0).
#[test]
fn the_unit_is_hardened() {
    let unit = unit_text();
    for must in [
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=CAP_IPC_LOCK CAP_NET_BIND_SERVICE",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK AF_IB",
        "LockPersonality=yes",
        "SystemCallArchitectures=native",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "UMask=0077",
    ] {
        assert!(unit.lines().any(|l| l == must), "the unit must have {must}");
    }
    let hides = [
        "PrivateDevices=",
        "DevicePolicy=",
        "DeviceAllow=",
        "ProtectKernelModules=",
        "ProtectKernelTunables=",
        "ProtectControlGroups=",
        "ProtectClock=",
        "ProtectHome=",
        "PrivateMounts=",
    ];
    lacks(&unit, &hides, "hides devices or makes a mount namespace");
    let (dir, copy) = unit_copy("unit-sec", &unit);
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=56"])
        .arg(&copy)
        .output()
        .expect("systemd-analyze security");
    let _ = std::fs::remove_dir_all(&dir);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exposure above 5.6: {}",
        report.lines().last().unwrap_or_default()
    );
}

/// systemd's notification socket, which the test can make full: the
/// daemon's next notification then blocks until the test reads, which pins
/// down what the daemon did before sending it.
struct NotifySocket {
    socket: UnixDatagram,
    path: PathBuf,
}

impl NotifySocket {
    fn bind(path: PathBuf) -> NotifySocket {
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        NotifySocket { socket, path }
    }

    /// Queue fillers until the kernel refuses more: the next sender blocks.
    fn fill(&self) -> usize {
        let filler = UnixDatagram::unbound().expect("socket");
        filler.set_nonblocking(true).expect("nonblocking");
        let mut n = 0;
        while filler.send_to(b"FILLER", &self.path).is_ok() {
            n += 1;
            assert!(n < 100_000, "the notify socket never filled");
        }
        n
    }

    fn recv(&self) -> String {
        self.recv_with_fds().0
    }

    /// A notification and the descriptors it carried (a barrier's pipe end:
    /// the daemon waits until it is dropped).
    fn recv_with_fds(&self) -> (String, Vec<std::os::fd::OwnedFd>) {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let mut buf = [0u8; 512];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &self.socket,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .expect("a notification");
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        (String::from_utf8_lossy(&buf[..msg.bytes]).into_owned(), fds)
    }

    /// Every message queued now, fillers left out.
    fn drain(&self) -> Vec<String> {
        self.socket.set_nonblocking(true).expect("nonblocking");
        let mut seen = Vec::new();
        let mut buf = [0u8; 512];
        while let Ok(n) = self.socket.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            if m != "FILLER" {
                seen.push(m);
            }
        }
        seen
    }

    /// Read until a message containing `what`; the daemon's messages seen.
    fn until(&self, what: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let m = self.recv();
            if m != "FILLER" {
                seen.push(m.clone());
            }
            if m.contains(what) {
                return seen;
            }
        }
    }
}

fn wait_for_log(t: &TargetProcess, what: &str, within: Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if t.output().contains(what) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// READY=1 only once every LUN is restored and the portal listens;
/// STOPPING=1 before the dump. The notification socket is kept full, so the
/// daemon blocks in the notification: what it did before is then visible,
/// and what it would do after cannot happen yet.
#[test]
fn readiness_comes_after_the_restore_and_stopping_before_the_dump() {
    let dir = std::env::temp_dir().join(format!("ramslog-notify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let state = dir.join("state");
    let options = |port: Option<u16>| TargetOptions {
        ephemeral: false,
        state_dir: Some(state.clone()),
        port,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Write `chunks` MiB of a pattern.
    let write = |t: &TargetProcess, chunks: u64| {
        rt.block_on(async {
            let s = ramslog_initiator::Session::login(
                t.addr(),
                ramslog_initiator::LoginParams::normal(
                    "iqn.2026-11.org.ramslog:e2e-initiator",
                    t.target_name(),
                ),
            )
            .await
            .expect("login");
            for _ in 0..8 {
                if s.test_unit_ready(0).await.expect("TUR").is_good() {
                    break;
                }
            }
            for c in 0..chunks {
                s.write(0, c * 2048, &vec![c as u8 + 1; 1 << 20], false)
                    .await
                    .expect("WRITE");
            }
        })
    };
    // An image to restore: 64 MiB of a pattern.
    let mut t = TargetProcess::start_with(options(None));
    let port = t.port();
    write(&t, 64);
    assert!(t.stop().success(), "{}", t.output_tail(20));

    let notify = NotifySocket::bind(dir.join("notify.sock"));
    let queued = notify.fill();
    let mut t = TargetProcess::spawn_with(TargetOptions {
        env: vec![("NOTIFY_SOCKET".into(), notify.path.display().to_string())],
        ..options(Some(port))
    });
    // One slot: STATUS=restoring gets in, the next notification blocks.
    assert_eq!(notify.recv(), "FILLER");
    assert!(
        wait_for_log(&t, "restored and verified", Duration::from_secs(60)),
        "the restore never finished: was a notification before it (READY=1?) blocked?\n{}",
        t.output_tail(20)
    );
    // Then the LUN memory goes into the fd store, confirmed by a barrier;
    // its pipe end is held until the socket is full again, so READY=1 can
    // only block.
    let mut before_ready = Vec::new();
    let barrier = loop {
        let (m, fds) = notify.recv_with_fds();
        assert!(
            !m.contains("READY=1"),
            "READY=1 before the fd store: {before_ready:?}"
        );
        if m == "BARRIER=1" {
            break fds;
        }
        if m != "FILLER" {
            before_ready.push(m);
        }
    };
    assert!(
        before_ready[0].contains("STATUS=restoring")
            && before_ready
                .iter()
                .any(|m| m.starts_with("FDSTORE=1\nFDNAME=lun-"))
            && before_ready
                .iter()
                .any(|m| m.starts_with("FDSTORE=1\nFDNAME=rec-"))
            && before_ready
                .iter()
                .any(|m| m.starts_with("FDSTORE=1\nFDNAME=writer")),
        "STATUS=restoring, then the fd store: {before_ready:?}"
    );
    let queued = queued.max(notify.fill());
    drop(barrier);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(t.addr()).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the portal does not listen before READY=1 is sent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let seen = notify.until("READY=1");
    assert_eq!(seen.len(), 1, "READY=1 next: {seen:?} ({queued} fillers)");

    // Something to dump.
    write(&t, 64);
    notify.fill();
    ramslog_tests::send_signal(t.pid(), ramslog_tests::Signal::TERM);
    assert!(
        wait_for_log(&t, "SIGTERM: stopping", Duration::from_secs(20)),
        "{}",
        t.output_tail(20)
    );
    // Blocked in STOPPING=1: the dump (a second or less for 64 MiB) must
    // not happen while the notification waits.
    assert!(
        !wait_for_log(&t, "dumped to", Duration::from_secs(3)),
        "the dump ran before STOPPING=1 was sent"
    );
    let seen = notify.until("STOPPING=1");
    assert_eq!(seen.len(), 1, "{seen:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no exit after the dump"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{}", t.output_tail(20));
    assert!(t.output().contains("dumped to"), "{}", t.output_tail(20));
    // While the dump makes progress the stop timeout is extended, so a LUN
    // larger than TimeoutStopSec planned for is not killed mid-dump.
    let after = notify.drain();
    assert!(
        after.iter().any(|m| m.contains("EXTEND_TIMEOUT_USEC=")),
        "the dump extended the stop timeout: {after:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stray SIGHUP (a closed terminal, a reload by habit) must not take a
/// log mirror half down: it is logged and ignored, during start-up and
/// while serving.
#[test]
fn a_hangup_is_harmless() {
    let mut t = TargetProcess::start();
    ramslog_tests::send_signal(t.pid(), ramslog_tests::Signal::HUP);
    assert!(
        wait_for_log(&t, "SIGHUP", Duration::from_secs(10)),
        "{}",
        t.output_tail(10)
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        t.is_running(),
        "SIGHUP stopped the daemon: {}",
        t.output_tail(10)
    );
    assert!(
        std::net::TcpStream::connect(t.addr()).is_ok(),
        "still serving after SIGHUP"
    );
    assert!(t.stop().success(), "{}", t.output_tail(10));
}
