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
    ] {
        assert!(unit.contains(must), "the unit must have {must}");
    }
    for hides in [
        "ProtectSystem=",
        "PrivateTmp=",
        "ReadOnlyPaths=",
        "TemporaryFileSystem=",
    ] {
        assert!(
            !unit.lines().any(|l| l.starts_with(hides)),
            "{hides} could hide the state or image directory"
        );
    }
    let dir = std::env::temp_dir().join(format!("ramslog-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let copy = dir.join("ramslog-target.service");
    let bin = target_binary();
    std::fs::write(
        &copy,
        unit.replace("/usr/bin/ramslog-target", &bin.display().to_string()),
    )
    .expect("write unit");
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

/// With `$NOTIFY_SOCKET` set, READY=1 comes once the portal listens and
/// STOPPING=1 when a stop begins.
#[test]
fn readiness_and_stopping_are_notified() {
    let dir = std::env::temp_dir().join(format!("ramslog-notify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut t = TargetProcess::start_with(TargetOptions {
        env: vec![("NOTIFY_SOCKET".into(), path.display().to_string())],
        ..Default::default()
    });
    let mut seen = String::new();
    let mut buf = [0u8; 512];
    while !seen.contains("READY=1") {
        let n = socket.recv(&mut buf).expect("a notification");
        seen += &String::from_utf8_lossy(&buf[..n]);
        seen.push('\n');
    }
    assert!(
        std::net::TcpStream::connect(t.addr()).is_ok(),
        "listening when READY=1 came"
    );
    assert!(t.stop().success());
    while !seen.contains("STOPPING=1") {
        let n = socket.recv(&mut buf).expect("STOPPING=1");
        seen += &String::from_utf8_lossy(&buf[..n]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
