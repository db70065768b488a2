//! Branches of the take-over rules that only a real start shows (the
//! decision itself has a table of unit tests beside it): a state directory
//! put back from a backup, a kill -9 in the middle of accept-empty, a start
//! in another boot, a generation bump the state made durable before the
//! record said it ended, and memory held for a writer that has since ended
//! (`take-over`).

use std::path::Path;
use std::time::{Duration, Instant};

use ramslog_tests::fdstore::FdStoreSupervisor;
use ramslog_tests::TargetProcess;

use super::kept::{is_ready, living_writer, start, stored_naa, wait_paused};
use super::*;

/// The daemon under `sup`, with test-build `env` and `extra` flags.
fn start_with(
    sup: &FdStoreSupervisor,
    state: &Path,
    port: u16,
    env: &[(&str, &Path)],
    extra: &[&str],
) -> TargetProcess {
    let (mut options, _passed) = sup.launch(persistent(state, Some(port), extra));
    options.env.extend(
        env.iter()
            .map(|(k, v)| (k.to_string(), v.display().to_string())),
    );
    TargetProcess::start_with(options)
}

/// The state directory put back from a backup taken before the last run:
/// the kept memory is a generation ahead of it. The LUN is NOT READY
/// naming that, never READY from the older image (which lacks the last
/// run's writes); the current state directory put back, the memory serves
/// every write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_put_back_from_a_backup_serves_no_older_image() {
    let dir = scratch_dir("take-over", "backup");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let (a, b) = (random_bytes(4096), random_bytes(4096));
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &a, true).await.expect("WRITE A");
    }
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let luns = state.join("luns.toml");
    let backup = std::fs::read(&luns).expect("the state to back up");
    // A stop and a start: the store is empty, the image decides.
    sup.clear();
    let mut t = start(&sup, &state, Some(port));
    let _naa = stored_naa(&sup);
    {
        let s = open(&t, INITIATOR).await;
        assert!(s.read(0, 0, 8, 512).await.expect("READ A") == a);
        s.write(0, 8, &b, true).await.expect("WRITE B");
    }
    t.kill();
    let current = std::fs::read(&luns).expect("the current state");
    assert_ne!(current, backup, "the last run bumped no generation");
    std::fs::write(&luns, &backup).expect("put the backup back");
    let t = start(&sup, &state, Some(port));
    assert!(
        !is_ready(&t).await,
        "served after the state directory went back\n{}",
        t.output_tail(20)
    );
    let st = status_text(&state);
    assert!(
        st.contains("the state directory went back") && !st.contains("run accept-empty"),
        "{st}"
    );
    drop(t);
    std::fs::write(&luns, &current).expect("put the current state back");
    let t = start(&sup, &state, Some(port));
    assert!(is_ready(&t).await, "{}", t.output_tail(20));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 0, 8, 512).await.expect("READ A") == a);
    assert!(s.read(0, 8, 8, 512).await.expect("READ B") == b);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kill -9 in the middle of accept-empty, once the store holds the new
/// identity's memory beside a record that says INITIALISING: the next
/// start serves none of the old content, under either identity (the record
/// says the memory is not content yet, and the new generation has no
/// image: NOT READY until accept-empty is asked again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_during_accept_empty_leaves_nothing_of_the_old_content() {
    let dir = scratch_dir("take-over", "accept-empty");
    let state = dir.join("state");
    let pause = dir.join("pause");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let old = vec![0x6b; 4096];
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &old, true).await.expect("WRITE");
    }
    t.kill();
    // Another block size: the memory is held, NOT READY, accept-empty asked.
    let held = ["--block-size", "4096"];
    let mut t = start_with(
        &sup,
        &state,
        port,
        &[("RAMSLOG_TEST_PAUSE_FILE", &pause)],
        &held,
    );
    assert!(!is_ready(&t).await);
    std::fs::write(&pause, "accept-empty").expect("the pause file");
    let mut asked = std::process::Command::new(ramslog_tests::target_binary())
        .args(["accept-empty", t.target_name(), "0", "--state-dir"])
        .arg(&state)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("accept-empty");
    wait_paused(&mut t, "accept-empty");
    // The moment that matters: the store holds the new identity's memory
    // beside a record that says INITIALISING, the old memory is gone.
    let luns = std::fs::read_to_string(state.join("luns.toml")).expect("state");
    assert!(
        !luns.contains(&naa),
        "accept-empty paused before the new identity: {luns}"
    );
    let names = sup.names();
    assert!(
        !names.contains(&format!("lun-{naa}")) && names.iter().any(|n| n.starts_with("lun-")),
        "the store at the pause: {names:?}"
    );
    t.kill();
    let _ = asked.wait();
    // The configuration it was asked under.
    let t = start_with(&sup, &state, port, &[], &held);
    assert!(
        t.output().contains("Initialising"),
        "the record did not say accept-empty was under way\n{}",
        t.output_tail(20)
    );
    if !is_ready(&t).await {
        let out = cli(&["accept-empty", t.target_name(), "0"], &state);
        assert!(
            out.status.success(),
            "accept-empty again: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(is_ready(&t).await, "{}", status_text(&state));
    }
    let s = open(&t, INITIATOR).await;
    let got = s.read(0, 0, 1, 4096).await.expect("READ");
    assert!(got.iter().all(|&b| b == 0), "the old content was served");
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kept memory whose record names another boot (a test build stands in
/// for the reboot): not this boot's memory, so the image decides and the
/// store lets it go; a kill -9 left no clean image, so the LUN is NOT READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_of_another_boot_is_not_served() {
    let dir = scratch_dir("take-over", "boot");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &random_bytes(4096), true)
            .await
            .expect("WRITE");
    }
    t.kill();
    let other = Path::new("00000000-0000-0000-0000-00000000b007");
    let t = start_with(&sup, &state, port, &[("RAMSLOG_TEST_BOOT_ID", other)], &[]);
    assert!(!is_ready(&t).await, "served memory of another boot");
    assert!(
        t.output().contains("it was written before this boot"),
        "{}",
        t.output_tail(20)
    );
    assert!(
        !sup.names().contains(&format!("lun-{naa}")),
        "memory of another boot left in the store: {:?}",
        sup.names()
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kill -9 after the state made a generation bump durable and before the
/// record said it ended (the record names the bump as pending): the next
/// start finishes the bump and serves the memory READY, every acknowledged
/// write present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bump_cut_short_after_the_state_made_it_durable_is_finished() {
    let dir = scratch_dir("take-over", "bump");
    let state = dir.join("state");
    let pause = dir.join("pause");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let acked = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &acked, true).await.expect("WRITE");
    }
    t.kill();
    let mut t = start_with(
        &sup,
        &state,
        port,
        &[("RAMSLOG_TEST_PAUSE_FILE", &pause)],
        &[],
    );
    assert!(is_ready(&t).await, "{}", t.output_tail(20));
    std::fs::write(&pause, "bump").expect("the pause file");
    let s = open(&t, INITIATOR).await;
    let cut = tokio::spawn(async move { s.write(0, 64, &[0x42; 4096], true).await });
    wait_paused(&mut t, "bump");
    // The race is shown to happen: the state holds the bump already.
    let bumped = std::fs::read_to_string(state.join("luns.toml")).expect("state");
    assert!(bumped.contains("generation = 3"), "{bumped}");
    t.kill();
    let cut = cut.await.expect("join");
    assert!(
        cut.is_err(),
        "a write acknowledged mid-bump: {cut:?}\n{}",
        t.output_tail(30)
    );
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "the bump was not finished\n{}\n{bumped}",
        t.output_tail(20)
    );
    assert!(
        t.output().contains("LUN content kept in memory"),
        "not served from the kept memory\n{}",
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 0, 8, 512).await.expect("READ") == acked);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A start that found the kept memory's writer still running is NOT READY
/// and keeps the memory in the store. Once that writer ends, `status` says
/// so (not "still running") and advises `take-over`, never accept-empty:
/// the daemon then ends as after a crash, so that systemd passes its fd
/// store to the next start, which takes the memory over READY with every
/// write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_held_for_a_writer_that_has_since_ended_is_taken_over() {
    let dir = scratch_dir("take-over", "writer-ended");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let _naa = stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, true).await.expect("WRITE");
    }
    t.kill();
    // A writer still alive (a straggler of the old run).
    let mut straggler = living_writer(&sup);
    let mut t = start(&sup, &state, Some(port));
    assert!(!is_ready(&t).await, "served while its writer runs");
    let st = status_text(&state);
    assert!(
        st.contains("is still running")
            && st.contains("let it end or kill it")
            && !st.contains("restart the daemon"),
        "status while the writer runs: {st}"
    );
    straggler.kill().expect("kill the straggler");
    straggler.wait().expect("reap");
    let st = status_text(&state);
    assert!(
        st.contains("has since ended")
            && st.contains("take-over")
            && !st.contains("run accept-empty"),
        "status after the writer ended: {st}"
    );
    let out = cli(&["take-over"], &state);
    assert!(
        out.status.success(),
        "take-over: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon did not end for the take-over"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(exit.signal(), Some(9), "ended as after a crash: {exit:?}");
    // The straggler's pidfd is the store's still: a supervisor drops what
    // ended with the daemon; systemd keeps it, and it now reads ended.
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "not taken over\n{}\n{}",
        status_text(&state),
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
