//! A planned restart (`ramslog-target restart`): the binary on disk is
//! checked, the daemon fences, dumps and executes it in the same process,
//! and the new program serves the memory it was handed under the same
//! identity, without reading the image. Refused, nothing changes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_initiator::{LoginParams, Session};
use ramslog_tests::{target_binary, TargetProcess};

use super::*;

const LANES: u64 = 32;
/// 4 KiB blocks of the default 256 MiB LUN.
const BLOCKS: u64 = (256 << 20) / 4096;

fn scratch(name: &str) -> PathBuf {
    scratch_dir("restart", name)
}

/// `ramslog-target restart --wait` against the daemon of `state_dir`: its
/// output, or the failure's.
pub(super) fn restart(state_dir: &Path) -> Result<String, String> {
    restart_by(&target_binary(), state_dir)
}

/// [`restart`] run by `cli_binary` (a package's ExecReload runs the binary
/// that package installed).
pub(super) fn restart_by(cli_binary: &Path, state_dir: &Path) -> Result<String, String> {
    let out = restart_wait_command(cli_binary, state_dir)
        .output()
        .expect("run restart --wait");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// `cli_binary restart --wait` against the daemon of `state_dir`.
fn restart_wait_command(cli_binary: &Path, state_dir: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(cli_binary);
    c.args(["restart", "--wait", "--state-dir"]).arg(state_dir);
    c
}

/// `restart --wait` started, its output piped, for a test that acts while
/// it waits.
fn spawn_restart_wait(state_dir: &Path) -> std::process::Child {
    restart_wait_command(&target_binary(), state_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("restart --wait")
}

/// A block's content for round `round`: its number, then a fill.
fn block(lba4k: u64, round: u64) -> Vec<u8> {
    let mut data = vec![(lba4k as u8) ^ (round as u8).wrapping_mul(37) ^ 0x5a; 4096];
    data[..8].copy_from_slice(&lba4k.to_be_bytes());
    data[8..16].copy_from_slice(&round.to_be_bytes());
    data
}

/// 32 lanes of random-order 4 KiB writes until the session breaks: the
/// blocks each got an acknowledgement for, with their content.
pub(super) async fn write_until_cut(
    s: Arc<Session>,
    round: u64,
    progress: Arc<AtomicUsize>,
) -> Vec<(u64, Vec<u8>)> {
    let mut lanes = Vec::new();
    for lane in 0..LANES {
        let (s, progress) = (s.clone(), progress.clone());
        lanes.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut lba4k = (lane * 7919 + round * 104_729) % BLOCKS;
            loop {
                let data = block(lba4k, round);
                match s.write(0, lba4k * 8, &data, false).await {
                    Ok(()) => {}
                    // The restart (or the crash) cut the connection: this
                    // write got no status, so it may or may not be there.
                    Err(ramslog_initiator::Error::Closed | ramslog_initiator::Error::Io(_)) => {
                        return acked
                    }
                    // A status (CHECK CONDITION, BUSY, TASK SET FULL), a
                    // Reject or a protocol error is an answer the host
                    // would act on: a restart or a crash must give none.
                    Err(e) => panic!("lane {lane}: write at block {lba4k} answered with {e}"),
                }
                acked.push((lba4k, data));
                progress.fetch_add(1, Ordering::Relaxed);
                lba4k = (lba4k + LANES * 13 + 1) % BLOCKS;
            }
        }));
    }
    let mut acked = Vec::new();
    for l in lanes {
        acked.extend(l.await.expect("lane"));
    }
    acked
}

/// Every acknowledged write is in place (the last acknowledged content of
/// each block).
pub(super) async fn assert_present(
    s: &Session,
    expected: &std::collections::HashMap<u64, Vec<u8>>,
    when: &str,
) {
    for (lba4k, data) in expected {
        let got = s.read(0, lba4k * 8, 8, 512).await.expect("READ");
        assert!(got == *data, "acknowledged block {lba4k} lost {when}");
    }
}

/// Ten restarts, each under 32 writers: the same process, the same identity,
/// the memory taken over (never the image read), every acknowledged write
/// present after each; then a stop and a start through the image, with
/// every acknowledged write of all rounds present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_restarts_under_load_keep_every_acknowledged_write() {
    const ROUNDS: u64 = 10;
    let dir = scratch("load");
    let mut t = TargetProcess::start_with(persistent(&dir, None, &[]));
    let port = t.port();
    let pid = t.pid();
    let mut expected = std::collections::HashMap::new();
    let mut id = None;
    for round in 0..ROUNDS {
        let s = Arc::new(open(&t, INITIATOR).await);
        let now = (
            s.inquiry(0, true, 0x80, 255).await.expect("VPD 80h"),
            s.inquiry(0, true, 0x83, 255).await.expect("VPD 83h"),
        );
        assert_eq!(
            id.get_or_insert(now.clone()),
            &now,
            "identity after restart {round}"
        );
        assert_present(&s, &expected, &format!("in restart {round}")).await;
        let progress = Arc::new(AtomicUsize::new(0));
        let writers = tokio::spawn(write_until_cut(s.clone(), round, progress.clone()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while progress.load(Ordering::Relaxed) < 300 {
            assert!(Instant::now() < deadline, "the writers are stuck");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let restarted = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || restart(&dir))
                .await
                .expect("restart")
        };
        let acked = writers.await.expect("writers");
        let out =
            restarted.unwrap_or_else(|e| panic!("restart {round}: {e}\n{}", t.output_tail(30)));
        assert!(
            out.contains("1 of 1 LUNs ready, 1 kept in memory"),
            "restart {round}: {out}"
        );
        assert!(!acked.is_empty(), "round {round} wrote nothing");
        expected.extend(acked);
        assert!(t.is_running(), "the daemon exited in restart {round}");
        assert_eq!(t.pid(), pid, "a restart keeps the process");
        eprintln!("restart {round}: {}", out.trim());
    }
    let log = t.output();
    assert_eq!(
        log.matches("LUN content kept in memory").count(),
        ROUNDS as usize,
        "{}",
        t.output_tail(40)
    );
    assert!(
        !log.contains("restoring LUN content"),
        "no restart read the image"
    );
    let st = status_text(&dir);
    assert!(
        st.contains("restored from the memory kept from the previous run")
            && st.contains(&format!(
                "its writer, process {}, handed it over in a planned restart",
                t.pid()
            )),
        "{st}"
    );

    let stopped = t.stop();
    assert!(stopped.success(), "{stopped:?}\n{}", t.output_tail(20));
    let t = TargetProcess::start_with(persistent(&dir, Some(port), &[]));
    assert!(
        t.output().contains("restoring LUN content"),
        "the image path after a stop"
    );
    let s = open(&t, INITIATOR).await;
    assert_present(&s, &expected, "after stop and start").await;
    eprintln!(
        "{} blocks written under {ROUNDS} restarts, all present",
        expected.len()
    );
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of the daemon's binary in `dir`, which the test then replaces.
fn binary_copy(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).expect("mkdir");
    let copy = dir.join("ramslog-target");
    std::fs::copy(target_binary(), &copy).expect("copy the binary");
    copy
}

/// Replace `path` with an executable script (as an upgrade replaces the
/// installed binary: a new file renamed over the old name).
fn replace_with_script(path: &Path, script: &str) {
    use std::os::unix::fs::PermissionsExt;
    let new = path.with_extension("new");
    std::fs::write(&new, script).expect("write the script");
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&new, path).expect("rename over the binary");
}

/// A new binary that does not start, and a new configuration that would
/// change the LUN's size, are both refused before anything is fenced: the
/// daemon keeps serving, same program, same content. Put right, the
/// restart goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_the_new_binary_cannot_take_is_refused_and_changes_nothing() {
    let dir = scratch("refused");
    let bin = binary_copy(&dir.join("bin"));
    let state = dir.join("state");
    let t = TargetProcess::start_with(ramslog_tests::TargetOptions {
        binary: Some(bin.clone()),
        ..persistent(&state, None, &[])
    });
    let s = open(&t, INITIATOR).await;
    let data = random_bytes(4096);
    s.write(0, 800, &data, false).await.expect("WRITE");

    replace_with_script(
        &bin,
        "#!/bin/sh\necho 'error while loading shared libraries: libwhatever.so' >&2\nexit 127\n",
    );
    let refused = restart(&state).expect_err("a broken binary must be refused");
    assert!(
        refused.contains("restart refused, still serving")
            && refused.contains("--handover-check failed")
            && refused.contains("libwhatever.so"),
        "{refused}"
    );
    let real = target_binary();
    replace_with_script(
        &bin,
        &format!(
            "#!/bin/bash\nargs=()\nfor a in \"$@\"; do [ \"$a\" = 256M ] && a=512M; args+=(\"$a\"); done\nexec {} \"${{args[@]}}\"\n",
            real.display()
        ),
    );
    let refused = restart(&state).expect_err("a new LUN size must be refused");
    assert!(
        refused.contains("restart refused, still serving") && refused.contains("536870912 bytes"),
        "{refused}"
    );
    // Still the same program, serving the same content.
    assert_eq!(s.read(0, 800, 8, 512).await.expect("READ"), data);
    s.write(0, 900, &data, false)
        .await
        .expect("WRITE after the refusals");
    // Both refusals are in the log, and no fence is.
    assert_eq!(
        t.output().matches("restart refused, still serving").count(),
        2,
        "{}",
        t.output_tail(20)
    );
    assert!(!t.output().contains("fenced"), "{}", t.output_tail(20));

    std::fs::remove_file(&bin).expect("rm");
    std::fs::copy(&real, &bin).expect("the real binary back");
    let out = restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(30)));
    assert!(out.contains("1 kept in memory"), "{out}");
    let s = open(&t, INITIATOR).await;
    assert_eq!(s.read(0, 800, 8, 512).await.expect("READ"), data);
    assert_eq!(s.read(0, 900, 8, 512).await.expect("READ"), data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a state directory nothing is kept, so nothing is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ephemeral_target_refuses_a_restart() {
    let t = TargetProcess::start();
    let socket = t
        .control_socket()
        .expect("own control socket")
        .to_path_buf();
    let out = std::process::Command::new(target_binary())
        .args(["restart", "--control-socket"])
        .arg(&socket)
        .output()
        .expect("restart");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--ephemeral target keeps nothing"),
        "{err}"
    );
    let s = Session::login(t.addr(), LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("still serving");
    drop(s);
}

/// `restart --wait` (the unit's `ExecReload=`) must not wait out its bound
/// for a daemon that is gone: systemd does nothing about a dead main process
/// while ExecReload runs, so a reload whose new program died at once would
/// keep the half down that long. It fails as soon as the daemon's process
/// ends, naming it.
#[test]
fn a_restart_wait_fails_at_once_when_the_daemon_dies() {
    let dir = scratch("dies");
    let state = dir.join("state");
    let bin = binary_copy(&dir.join("bin"));
    let mut t = TargetProcess::start_with(ramslog_tests::TargetOptions {
        binary: Some(bin.clone()),
        ..persistent(&state, None, &[])
    });
    // The new binary passes the check, then dies as soon as it runs.
    replace_with_script(
        &bin,
        &format!(
            "#!/bin/bash\ncase \"$*\" in *--handover-check*) exec {} \"$@\";; esac\nexit 3\n",
            target_binary().display()
        ),
    );
    let mut wait = spawn_restart_wait(&state);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = wait.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = wait.kill();
            let _ = wait.wait();
            panic!(
                "restart --wait still waiting 20 s after the daemon died ({:?})\n{}",
                t.try_exit_status(),
                t.output_tail(10)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = wait.wait_with_output().expect("output");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!status.success(), "{said}");
    assert!(said.contains("ended"), "{said}");
    assert!(t.try_exit_status().is_some(), "the daemon is gone");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `stop` on the control socket while a restart is under way (here: its
/// handover check, which a slow new binary makes last) must not be lost:
/// the daemon ends with its content dumped, whether the stop is answered
/// at once or taken by the program the restart executes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_stop_during_a_restart_is_not_lost() {
    let dir = scratch("stop-in-restart");
    let state = dir.join("state");
    let bin = binary_copy(&dir.join("bin"));
    let mut t = TargetProcess::start_with(ramslog_tests::TargetOptions {
        binary: Some(bin.clone()),
        ..persistent(&state, None, &[])
    });
    let port = t.port();
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 640, &data, false).await.expect("WRITE");
    }
    // A new binary whose handover check takes a while, saying when it began.
    let checking = dir.join("checking");
    replace_with_script(
        &bin,
        &format!(
            "#!/bin/bash\ncase \"$*\" in *--handover-check*) touch {}; sleep 2;; esac\nexec {} \"$@\"\n",
            checking.display(),
            target_binary().display()
        ),
    );
    let restarting = {
        let state = state.clone();
        std::thread::spawn(move || cli(&["restart", "--wait"], &state))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !checking.exists() {
        assert!(
            Instant::now() < deadline,
            "no handover check began\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop = cli(&["stop"], &state);
    let said =
        String::from_utf8_lossy(&stop.stdout).into_owned() + &String::from_utf8_lossy(&stop.stderr);
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        if Instant::now() > deadline {
            let st = status_text(&state);
            t.kill();
            panic!("the stop ({said}) was lost: the daemon is still serving\n{st}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?} ({said})\n{}", t.output_tail(20));
    assert!(
        !stop.status.success() && said.contains("a restart is under way"),
        "the stop's answer names the restart it was passed on to: {said}"
    );
    let _ = restarting.join();
    // The content was dumped: a start without any kept memory is READY.
    let t = TargetProcess::start_with(persistent(&state, Some(port), &[]));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 640, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The binary a restart checked is the one it executes: a package that
/// renames another file over the path between the check and the exec (a
/// second upgrade, a half-written file) must not be run unchecked. Test
/// builds pause the daemon right after the check; the path then gets a
/// program that cannot start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_replaced_after_its_check_is_not_executed() {
    let dir = scratch("replaced-after-check");
    let bin = binary_copy(&dir.join("bin"));
    let state = dir.join("state");
    let pause = dir.join("pause");
    let mut t = TargetProcess::start_with(ramslog_tests::TargetOptions {
        binary: Some(bin.clone()),
        env: vec![(
            "RAMSLOG_TEST_PAUSE_FILE".into(),
            pause.display().to_string(),
        )],
        ..persistent(&state, None, &[])
    });
    let pid = t.pid();
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, true).await.expect("WRITE");
    }
    std::fs::write(&pause, "checked").expect("the pause file");
    let asked = spawn_restart_wait(&state);
    super::kept::wait_paused(&mut t, "checked");
    replace_with_script(
        &bin,
        "#!/bin/sh\necho 'unchecked program: cannot start' >&2\nexit 70\n",
    );
    ramslog_tests::send_signal(pid, ramslog_tests::Signal::CONT);
    let out = tokio::task::spawn_blocking(move || asked.wait_with_output())
        .await
        .expect("join")
        .expect("restart --wait");
    assert!(
        !t.output().contains("unchecked program"),
        "the restart executed a binary it never checked\n{}",
        t.output_tail(20)
    );
    assert!(
        out.status.success() && t.is_running(),
        "restart --wait: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    let _ = s.test_unit_ready(0).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
