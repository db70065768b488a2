//! End-to-end tests: the real `ramslog-target` binary on 127.0.0.1, driven by
//! ramslog-initiator. One test binary, one module per area.

mod generations;
mod golden;
mod identity;
mod images;
mod integrity;
mod kept;
mod lun_memory;
mod metrics;
mod persistence;
mod restart;
mod sessions;
mod startup;
mod systemd;
mod take_over;
mod upgrade;

use std::time::Duration;

use ramslog_common::scsi_wire::{sense_key, Sense};
use ramslog_initiator::{LoginParams, ScsiResult, Session};
use ramslog_tests::TargetProcess;

pub const INITIATOR: &str = "iqn.2026-11.org.ramslog:e2e-initiator";

/// Log in and consume the power-on unit attention, as real initiators do.
pub async fn open(t: &TargetProcess, initiator: &str) -> Session {
    let s = Session::login(t.addr(), LoginParams::normal(initiator, t.target_name()))
        .await
        .unwrap_or_else(|e| panic!("login to {}: {e}", t.addr()));
    clear_unit_attentions(&s).await;
    s
}

pub async fn clear_unit_attentions(s: &Session) {
    clear_lun_attentions(s, 0).await;
}

/// Read `lun`'s unit attentions (a new nexus has some for each LUN).
pub async fn clear_lun_attentions(s: &Session, lun: u64) {
    for _ in 0..8 {
        let r = s.test_unit_ready(lun).await.expect("TEST UNIT READY");
        if r.sense.is_none_or(|x| x.key != sense_key::UNIT_ATTENTION) {
            return;
        }
    }
    panic!("LUN {lun}: unit attentions never cleared");
}

/// Whether `lun` is READY, or NOT READY 04h/03h (manual intervention), as
/// session `s` sees it once its unit attentions are read; anything else
/// fails the test.
pub async fn lun_ready(s: &Session, lun: u64) -> bool {
    clear_lun_attentions(s, lun).await;
    let r = s.test_unit_ready(lun).await.expect("TEST UNIT READY");
    if r.is_good() {
        return true;
    }
    assert_eq!(
        (r.status, sense(&r)),
        (
            ramslog_common::scsi_wire::status::CHECK_CONDITION,
            (sense_key::NOT_READY, 0x04, 0x03)
        ),
        "LUN {lun}: neither READY nor NOT READY"
    );
    false
}

pub fn sense(r: &ScsiResult) -> (u8, u8, u8) {
    let s: Sense = r
        .sense
        .unwrap_or_else(|| panic!("expected sense, got status {:#x}", r.status));
    (s.key, s.asc, s.ascq)
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random::<u8>()).collect()
}

/// Run a `ramslog-target` subcommand against the daemon of `state_dir`.
pub fn cli(args: &[&str], state_dir: &std::path::Path) -> std::process::Output {
    std::process::Command::new(ramslog_tests::target_binary())
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        .output()
        .expect("run ramslog-target subcommand")
}

/// A scratch directory for test `name` of `suite`, emptied.
pub fn scratch_dir(suite: &str, name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ramslog-e2e-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A target that keeps its LUNs across restarts in `state_dir`.
pub fn persistent(
    state_dir: &std::path::Path,
    port: Option<u16>,
    extra: &[&str],
) -> ramslog_tests::TargetOptions {
    ramslog_tests::TargetOptions {
        ephemeral: false,
        state_dir: Some(state_dir.into()),
        port,
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// What `ramslog-target status` prints for the daemon of `state_dir`
/// (whether or not it runs).
pub fn status_text(state_dir: &std::path::Path) -> String {
    String::from_utf8_lossy(&cli(&["status"], state_dir).stdout).into_owned()
}

/// Whether the tests run as root (CI does; some mount or drop capabilities).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A small ext4 filesystem of `size` (mkfs.ext4's form, e.g. `2M`) made in
/// `image` and loop-mounted on `at`: a disk that fills up. Unmounted when
/// dropped. Needs root and e2fsprogs; says so if either is missing.
pub struct LoopFilesystem(std::path::PathBuf);

impl LoopFilesystem {
    pub fn mount(image: &std::path::Path, at: &std::path::Path, size: &str, mkfs: &[&str]) -> Self {
        assert!(
            is_root(),
            "this test mounts a loop filesystem: run it as root (CI does)"
        );
        assert!(
            ramslog_tests::find_in_path("mkfs.ext4").is_some(),
            "mkfs.ext4 (e2fsprogs) is needed"
        );
        std::fs::create_dir_all(at).expect("mkdir");
        let mk = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .args(mkfs)
            .arg(image)
            .arg(size)
            .status()
            .expect("mkfs.ext4");
        assert!(mk.success());
        let mount = std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(image)
            .arg(at)
            .status();
        assert!(mount.is_ok_and(|s| s.success()), "mount -o loop");
        LoopFilesystem(at.into())
    }
}

impl Drop for LoopFilesystem {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// `out` is a start that was refused with a clean exit (1, no panic) and a
/// message naming each of `needles`.
pub fn refused(out: &std::process::Output, needles: &[&str]) {
    refused_with(1, out, needles)
}

/// [`refused`] with exit status `code` (2: a flag clap could not parse).
pub fn refused_with(code: i32, out: &std::process::Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "should have refused to start; stderr: {err}"
    );
    assert_eq!(
        out.status.code(),
        Some(code),
        "a clean exit code, not a panic (101) or signal: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}: {err}");
    }
}

/// `ramslog-target ARGS`, run to its end.
pub fn run_target(args: &[&str]) -> std::process::Output {
    std::process::Command::new(ramslog_tests::target_binary())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run ramslog-target")
}

pub const SHORT: Duration = Duration::from_millis(500);
