//! Kept memory across a crash: under a holder (systemd's fd store, here a
//! supervisor speaking its protocol) each LUN's memory and its record
//! outlive the daemon. The next start serves them when every rule holds,
//! and answers NOT READY naming the rule when one does not, keeping the
//! memory for a later start that finds the doubt gone.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::scsi_wire::{sense_key, status};
use ramslog_tests::fdstore::FdStoreSupervisor;
use ramslog_tests::TargetProcess;

use super::restart::{assert_present, restart, write_until_cut};
use super::*;

/// The daemon under `sup`, on `port` (or a free one), with what `sup` holds.
pub(super) fn start(sup: &FdStoreSupervisor, state: &Path, port: Option<u16>) -> TargetProcess {
    let (options, _inherited) = sup.launch(persistent(state, port, &[]));
    TargetProcess::start_with(options)
}

/// The NAA the store holds the LUN's memory under.
pub(super) fn stored_naa(sup: &FdStoreSupervisor) -> String {
    assert!(
        sup.wait_for("writer", Duration::from_secs(10)),
        "no writer pidfd stored: {:?}",
        sup.names()
    );
    let names = sup.names();
    let naa = names
        .iter()
        .find_map(|n| n.strip_prefix("lun-"))
        .unwrap_or_else(|| panic!("no LUN memory stored: {names:?}"))
        .to_string();
    assert!(names.contains(&format!("rec-{naa}")), "{names:?}");
    naa
}

/// LUN 0 READY or NOT READY 04h/03h, seen from a new session.
pub(super) async fn is_ready(t: &TargetProcess) -> bool {
    lun_ready(&open(t, INITIATOR).await, 0).await
}

/// Three kill -9s under 32 writers, each followed by a start that takes the
/// memory from the store (never the image): the same identity, every
/// acknowledged write present. Then SIGTERM with the store kept (what
/// `systemctl restart` does): the memory is used, the restore skipped.
/// Then a stop and a start with the store dropped: the image has it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_under_a_holder_keeps_every_acknowledged_write() {
    const CRASHES: u64 = 3;
    let dir = scratch_dir("kept", "crash");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let mut expected = HashMap::new();
    let mut id = None;
    for round in 0..CRASHES {
        let s = Arc::new(open(&t, INITIATOR).await);
        let vpd = s.inquiry(0, true, 0x83, 255).await.expect("VPD 83h");
        assert_eq!(
            id.get_or_insert(vpd.clone()),
            &vpd,
            "identity, round {round}"
        );
        assert_present(&s, &expected, &format!("after crash {round}")).await;
        let progress = Arc::new(AtomicUsize::new(0));
        let writers = tokio::spawn(write_until_cut(s.clone(), round, progress.clone()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while progress.load(Ordering::Relaxed) < 300 {
            assert!(Instant::now() < deadline, "the writers are stuck");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let killed = t.pid();
        t.kill();
        let acked = writers.await.expect("writers");
        assert!(!acked.is_empty(), "round {round} wrote nothing");
        expected.extend(acked);
        t = start(&sup, &state, Some(port));
        let log = t.output();
        assert!(
            log.contains("LUN content kept in memory") && !log.contains("restoring LUN content"),
            "crash {round}: {}",
            t.output_tail(30)
        );
        assert!(is_ready(&t).await, "crash {round}: {}", status_text(&state));
        // `status` names the killed writer and how it ended.
        let st: serde_json::Value =
            serde_json::from_slice(&cli(&["status", "--json"], &state).stdout)
                .expect("status --json");
        let writer = &st["targets"][0]["luns"][0]["previous_writer"];
        assert_eq!(writer["pid"], u64::from(killed), "crash {round}: {st}");
        assert!(
            writer["ended"]
                .as_str()
                .is_some_and(|e| e.contains("without handing it over")),
            "crash {round}: {st}"
        );
        // Held once, under the same NAA, by the new writer.
        let names = sup.names();
        assert_eq!(
            names.iter().filter(|n| **n == format!("lun-{naa}")).count(),
            1,
            "{names:?}"
        );
    }
    let s = open(&t, INITIATOR).await;
    assert_present(&s, &expected, "after the last crash").await;
    drop(s);

    // A planned restart under the store skips the dump, and writes its
    // records where the store holds them: a crash after it keeps the
    // memory too.
    let out = restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(30)));
    assert!(out.contains("1 kept in memory"), "{out}");
    assert!(
        t.output()
            .contains("restart: no dump, systemd's fd store holds the LUN memory")
            && !t.output().contains("dumped to"),
        "{}",
        t.output_tail(30)
    );
    {
        let s = open(&t, INITIATOR).await;
        let data = random_bytes(4096);
        s.write(0, 16, &data, false)
            .await
            .expect("WRITE after the restart");
        expected.insert(2, data);
    }
    t.kill();
    t = start(&sup, &state, Some(port));
    assert!(
        t.output().contains("LUN content kept in memory"),
        "a crash after a restart: {}",
        t.output_tail(30)
    );
    let s = open(&t, INITIATOR).await;
    assert_present(&s, &expected, "after a restart and a crash").await;
    drop(s);

    // SIGTERM dumps; the store keeps the memory, which the next start uses.
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let t2 = start(&sup, &state, Some(port));
    let log = t2.output();
    assert!(
        log.contains("LUN content kept in memory") && !log.contains("restoring LUN content"),
        "{}",
        t2.output_tail(30)
    );
    let s = open(&t2, INITIATOR).await;
    assert_present(&s, &expected, "after a stop with the store kept").await;
    drop(s);
    let mut t2 = t2;
    assert!(t2.stop().success(), "{}", t2.output_tail(20));

    // A stop and a start (systemd 252 drops the store): the image path.
    sup.clear();
    let t3 = start(&sup, &state, Some(port));
    assert!(
        t3.output().contains("restoring LUN content"),
        "{}",
        t3.output_tail(30)
    );
    let s = open(&t3, INITIATOR).await;
    assert_present(&s, &expected, "after a stop and a start").await;
    eprintln!(
        "{} blocks written under {CRASHES} crashes, all present",
        expected.len()
    );
    drop(s);
    drop(t3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The orders systemd or an admin can produce that must not serve the kept
/// memory: a writer still alive, a second memory under the LUN's name, a
/// memory that is not the recorded one, a torn record. Each start is NOT
/// READY naming the rule and keeps the memory in the store; put right, the
/// next start is READY with the content. With the store dropped, a crash
/// is NOT READY as without a holder (never an older image).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_orders_in_the_store_are_not_ready_until_put_right() {
    let dir = scratch_dir("kept", "orders");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    t.kill();
    let (memory, record) = (format!("lun-{naa}"), format!("rec-{naa}"));
    let real_memory = sup.get(&memory).expect("memory");
    let real_record = sup.get(&record).expect("record");

    // Start under the store as it is now: NOT READY naming `why`, or READY
    // with the content.
    let check = |expect_ready: bool, why: &'static str| {
        let (sup, state) = (&sup, &state);
        let data = data.clone();
        async move {
            let mut t = start(sup, state, Some(port));
            let ready = is_ready(&t).await;
            let st = status_text(state);
            assert_eq!(ready, expect_ready, "{why}: {st}\n{}", t.output_tail(20));
            if ready {
                let s = open(&t, INITIATOR).await;
                assert_eq!(s.read(0, 800, 8, 512).await.expect("READ"), data, "{why}");
            } else {
                assert!(st.contains(why), "status must say {why:?}: {st}");
            }
            t.kill();
        }
    };

    // A writer still alive (a forked holder, a straggler).
    let mut straggler = living_writer(&sup);
    check(false, "is still running").await;
    check(false, "accept-empty would discard that memory").await;
    check(false, "is still running").await;
    straggler.kill().expect("kill the straggler");
    straggler.wait().expect("reap");
    check(true, "the writer is gone").await;

    // A second memory under the LUN's name.
    let other = rustix::fs::memfd_create("ramslog intruder", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd");
    rustix::fs::ftruncate(&other, 256 << 20).expect("size");
    sup.put(&memory, other.as_fd());
    check(false, "never pick one").await;
    sup.remove(&memory);
    sup.put(&memory, real_memory.as_fd());
    check(true, "one memory again").await;

    // Not the memory the record names (an unsealed one of the same size):
    // the record's inode rule refuses it before its seals are looked at
    // (Store::adopt's seal and size checks are store/'s unit test
    // adopted_memory_is_the_predecessors_and_nothing_else).
    sup.remove(&memory);
    sup.put(&memory, other.as_fd());
    check(false, "memfd inode").await;
    sup.remove(&memory);
    sup.put(&memory, real_memory.as_fd());
    check(true, "the recorded memory again").await;

    // A memory of another size, sealed as the daemon seals its own: again
    // not the recorded inode, whatever its size.
    let smaller = rustix::fs::memfd_create(
        "ramslog smaller",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .expect("memfd");
    rustix::fs::ftruncate(&smaller, 128 << 20).expect("size");
    rustix::fs::fcntl_add_seals(
        &smaller,
        rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW | rustix::fs::SealFlags::SEAL,
    )
    .expect("seal");
    sup.remove(&memory);
    sup.put(&memory, smaller.as_fd());
    check(false, "memfd inode").await;
    sup.remove(&memory);
    sup.put(&memory, real_memory.as_fd());
    check(true, "the recorded memory once more").await;

    // A torn record: both slots unreadable.
    let torn =
        rustix::fs::memfd_create("ramslog torn", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    let mut bytes = vec![0u8; 256 << 10];
    rustix::io::pread(&real_record, &mut bytes, 0).expect("read the record");
    for slot in [0usize, 128 << 10] {
        bytes[slot + 30] ^= 0xff;
    }
    rustix::io::write(&torn, &bytes).expect("write the torn record");
    sup.remove(&record);
    sup.put(&record, torn.as_fd());
    check(false, "unreadable").await;
    sup.remove(&record);
    sup.put(&record, real_record.as_fd());
    check(true, "the record put back").await;

    // The store dropped: a crash is what it is without a holder.
    drop((real_memory, real_record));
    sup.clear();
    check(false, "no clean image").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restart under the store does not dump; if the new program dies before
/// it takes over (a broken upgrade that passed the check), the memory is in
/// the store, marked handed over, and the next start serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_program_that_dies_after_the_handover_loses_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch_dir("kept", "dies");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
    let bin = dir.join("bin/ramslog-target");
    std::fs::copy(ramslog_tests::target_binary(), &bin).expect("copy the binary");
    let (options, _inherited) = sup.launch(ramslog_tests::TargetOptions {
        binary: Some(bin.clone()),
        ..persistent(&state, None, &[])
    });
    let mut t = TargetProcess::start_with(options);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    // The upgrade: passes the check, dies when it runs for real.
    let new = bin.with_extension("new");
    std::fs::write(
        &new,
        format!(
            "#!/bin/bash\nfor a in \"$@\"; do [ \"$a\" = --handover-check ] && exec {} \"$@\"; done\necho 'new program: cannot start' >&2\nexit 70\n",
            ramslog_tests::target_binary().display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&new, &bin).expect("rename over the binary");
    let logged = t.output().len();
    let out = cli(&["restart"], &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the broken new program did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(exit.code(), Some(70), "{}", t.output_tail(20));
    assert!(
        !t.output()[logged..].contains("dumped to"),
        "{}",
        t.output_tail(20)
    );
    // systemd starts the unit again (Restart=on-failure): the real binary.
    let t = start(&sup, &state, Some(port));
    assert!(
        t.output().contains("LUN content kept in memory"),
        "{}",
        t.output_tail(30)
    );
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert_eq!(s.read(0, 800, 8, 512).await.expect("READ"), data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stop during start-up, after the kept memory was taken (the only copy:
/// a kill -9 left no clean image): the daemon finishes the start-up's
/// checks, dumps that memory and exits 0, so a start without the store
/// (systemd 252 empties it at a stop) is READY with the content. The
/// supervisor holds the start-up's fd-store barrier unanswered: the
/// daemon waits there, past the take-over, when the SIGTERM comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_start_up_dumps_the_kept_memory() {
    let dir = scratch_dir("kept", "stop-in-start");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    t.kill();
    sup.hold_barriers(true);
    let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
    let mut t = TargetProcess::spawn_with(options);
    let deadline = Instant::now() + Duration::from_secs(30);
    while sup.barriers_held() == 0 {
        assert!(
            Instant::now() < deadline,
            "no barrier: {}",
            t.output_tail(20)
        );
        assert!(t.is_running(), "{}", t.output_tail(20));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        t.output().contains("LUN content kept in memory") && !t.output().contains("listening on"),
        "the daemon waits in start-up, the memory taken: {}",
        t.output_tail(20)
    );
    ramslog_tests::send_signal(t.pid(), ramslog_tests::Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "no exit after SIGTERM in start-up"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    sup.hold_barriers(false);
    assert!(exit.success(), "{exit:?}: {}", t.output_tail(20));
    // systemctl stop, then start: the store is empty.
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "a stop during start-up lost the kept memory: {}\n{}",
        status_text(&state),
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert_eq!(s.read(0, 800, 8, 512).await.expect("READ"), data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restart without a dump tells each logged-in host, before its
/// connection drops, to log in again at once (an Async Message, AsyncEvent
/// 3, Time2Wait 0): the listening socket passes to the new program, so the
/// login waits in its queue. Without it open-iscsi waits DefaultTime2Wait
/// (2 s) first. A discovery session is only closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_a_dump_asks_hosts_back_at_once() {
    use ramslog_common::iscsi::Opcode;
    use ramslog_initiator::Connection;
    let dir = scratch_dir("kept", "notice");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let t = start(&sup, &state, None);
    stored_naa(&sup);
    let mut normal = Connection::connect(t.addr()).await.expect("connect");
    normal
        .login(&LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("login");
    let mut discovery = Connection::connect(t.addr()).await.expect("connect");
    discovery
        .login(&LoginParams::discovery(INITIATOR))
        .await
        .expect("discovery login");
    let expected_statsn = normal.exp_statsn();
    let restarted = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || restart(&state))
    };
    let notice = normal
        .recv_pdu_timeout(Duration::from_secs(20))
        .await
        .expect("the notice, not an error")
        .expect("a PDU before the connection drops");
    assert_eq!(notice.bhs.opcode(), Some(Opcode::AsyncMessage));
    assert_eq!(notice.bhs.async_event(), (3, 0), "dropping all connections");
    let (_, time2wait, time2retain) = notice.bhs.async_parameters();
    assert_eq!(time2wait, 0, "log in again at once");
    assert_eq!(
        time2retain, 180,
        "the window the illumos initiator keeps trying in"
    );
    assert_eq!(
        notice.bhs.statsn(),
        expected_statsn,
        "the notice takes the next StatSN"
    );
    for (what, c) in [
        ("the notice", &mut normal),
        ("a discovery session", &mut discovery),
    ] {
        match c.recv_pdu_timeout(Duration::from_secs(20)).await {
            Err(_) => {}
            Ok(None) => panic!("after {what} the connection stayed open"),
            Ok(Some(p)) => panic!("after {what} came {:?}, not the close", p.bhs.opcode()),
        }
    }
    let out = restarted
        .await
        .expect("restart")
        .unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(30)));
    assert!(out.contains("1 kept in memory"), "{out}");
    assert!(
        t.output().contains("restart: no dump"),
        "{}",
        t.output_tail(30)
    );
    // The host's immediate reconnect is served by the new program.
    let s = open(&t, INITIATOR).await;
    s.test_unit_ready(0).await.expect("TUR");
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A start whose configuration no longer names a LUN whose memory the
/// store kept (here: the target renamed by mistake) serves nothing of it
/// and releases nothing: the memory stays in the store, `status` lists it,
/// a restart is refused while it is held (the new program could not list
/// it), `discard-kept` refuses a configured LUN's NAA and an unknown one,
/// and releases it. Put back, the configuration would have found it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_memory_no_lun_claims_waits_for_discard_kept() {
    let dir = scratch_dir("kept", "unclaimed");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 64, &random_bytes(4096), false)
            .await
            .expect("WRITE");
    }
    t.kill();
    let renamed = "iqn.2026-11.org.ramslog:e2e-renamed";
    let (options, _inherited) = sup.launch(ramslog_tests::TargetOptions {
        target_name: renamed.into(),
        ..persistent(&state, Some(port), &[])
    });
    let mut t = TargetProcess::start_with(options);
    assert!(
        t.output()
            .contains(&format!("kept memory naa.{naa} (target ")),
        "{}",
        t.output_tail(30)
    );
    let st = status_text(&state);
    assert!(
        st.contains(&format!(
            "kept memory naa.{naa} claimed by no configured LUN"
        )) && st.contains("discard-kept"),
        "{st}"
    );
    assert!(
        st.contains("kept memory: held in systemd's fd store")
            && st.contains("next start: this memory after a restart or a crash"),
        "{st}"
    );
    assert!(
        sup.names().contains(&format!("lun-{naa}")),
        "left in the store: {:?}",
        sup.names()
    );
    let refused = restart(&state).expect_err("a restart while unclaimed memory is held");
    assert!(refused.contains(&format!("naa.{naa}")), "{refused}");
    assert!(t.is_running());

    let configured = status_text(&state)
        .lines()
        .find_map(|l| {
            l.split("naa.")
                .nth(1)
                .map(|r| r.split_whitespace().next().unwrap_or("").to_string())
        })
        .filter(|n| *n != naa)
        .expect("the renamed target's own LUN");
    let out = cli(&["discard-kept", &configured], &state);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("accept-empty"),
        "a configured LUN's NAA: {err}"
    );
    let out = cli(&["discard-kept", "naa.6001405000000000"], &state);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains(&format!("naa.{naa}")),
        "an unknown NAA is refused, naming the unclaimed ones: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = cli(&["discard-kept", &format!("naa.{naa}")], &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("released"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for name in [format!("lun-{naa}"), format!("rec-{naa}")] {
        assert!(
            sup.wait_gone(&name, Duration::from_secs(5)),
            "{name} still held: {:?}",
            sup.names()
        );
    }
    assert!(!status_text(&state).contains("claimed by no configured LUN"));
    let again = cli(&["discard-kept", &naa], &state);
    assert!(!again.status.success(), "discarded once only");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--kept-memory off`: memory the store kept from a run with it on is
/// released at start (the LUN then comes from its image: NOT READY here,
/// since a kill -9 left none current), nothing is pushed into the store,
/// `status` says so, and a restart dumps first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_memory_off_keeps_nothing_and_releases_what_was_kept() {
    let dir = scratch_dir("kept", "off");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 64, &random_bytes(4096), false)
            .await
            .expect("WRITE");
    }
    t.kill();
    let (options, _inherited) =
        sup.launch(persistent(&state, Some(port), &["--kept-memory", "off"]));
    let t = TargetProcess::start_with(options);
    for name in [format!("lun-{naa}"), format!("rec-{naa}"), "writer".into()] {
        assert!(
            sup.wait_gone(&name, Duration::from_secs(5)),
            "{name} still held: {:?}",
            sup.names()
        );
    }
    assert!(
        t.output().contains("--kept-memory=off: released"),
        "{}",
        t.output_tail(30)
    );
    assert!(!is_ready(&t).await, "a kill -9 left no current image");
    assert!(
        status_text(&state).contains("kept memory: off"),
        "{}",
        status_text(&state)
    );
    let out = cli(&["accept-empty", t.target_name(), "0"], &state);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = status_text(&state);
    assert!(
        st.contains("next start: this memory after a restart (handed over in the process), the image after a stop; a crash loses the content"),
        "{st}"
    );
    let out = restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(30)));
    assert!(out.contains("1 of 1 LUNs ready"), "{out}");
    assert!(
        t.output()
            .contains("restart: dumping first (--kept-memory=off)"),
        "{}",
        t.output_tail(30)
    );
    assert!(
        !sup.names()
            .iter()
            .any(|n| n.starts_with("lun-") || n == "writer"),
        "nothing pushed with kept memory off: {:?}",
        sup.names()
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// After a crash, a start whose configuration changed the LUN's size or
/// block size answers NOT READY and leaves the kept memory in the store
/// (it is this identity's content, in a shape the configuration no longer
/// has); the configuration put back, the next start serves it, READY with
/// every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_lun_shape_is_not_ready_and_reverted_serves_the_kept_memory() {
    let dir = scratch_dir("kept", "shape");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let mut t = start(&sup, &state, None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 4096, &data, false).await.expect("WRITE");
    }
    t.kill();
    for (what, changed) in [
        (
            "a size of 128M",
            ramslog_tests::TargetOptions {
                size: "128M".into(),
                ..persistent(&state, Some(port), &[])
            },
        ),
        (
            "4096-byte blocks",
            persistent(&state, Some(port), &["--block-size", "4096"]),
        ),
    ] {
        let (options, _inherited) = sup.launch(changed);
        let mut t = TargetProcess::start_with(options);
        assert!(
            !is_ready(&t).await,
            "{what}: served memory of another shape\n{}",
            t.output_tail(20)
        );
        assert!(
            t.output().contains("kept memory not used"),
            "{what}: {}",
            t.output_tail(20)
        );
        let stopped = t.stop();
        assert!(
            stopped.success(),
            "{what}: {stopped:?}\n{}",
            t.output_tail(20)
        );
        assert!(
            sup.names().contains(&format!("lun-{naa}")),
            "{what}: the memory left the store: {:?}",
            sup.names()
        );
    }
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "the configuration put back: not READY\n{}",
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    let got = s.read(0, 4096, 8, 512).await.expect("READ");
    assert!(got == data, "the acknowledged write after the revert");
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Send `signal` to the daemon and wait for it to die of it.
fn die_of(t: &mut TargetProcess, signal: rustix::process::Signal) {
    use std::os::unix::process::ExitStatusExt;
    ramslog_tests::send_signal(t.pid(), signal);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = t.try_exit_status() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{signal:?} did not end the daemon"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.signal(),
        Some(signal.as_raw()),
        "{status:?}\n{}",
        t.output_tail(10)
    );
}

/// A writer that died of a fault signal may have written anywhere: the next
/// start does not serve its memory. Where no image holds the generation the
/// LUN is NOT READY naming the fault, at every later start too, and the
/// memory stays in the store; where a stop dumped the generation and no
/// write followed, that image is restored instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_died_of_a_fault_signal_is_not_served_from_memory() {
    use rustix::process::Signal;
    let dir = scratch_dir("kept", "fault");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    // Without page checksums (with them, memory that checks is served).
    let start = |port| {
        let options = ramslog_tests::TargetOptions {
            page_checksums: false,
            ..persistent(&state, port, &[])
        };
        TargetProcess::start_with(sup.launch(options).0)
    };
    let mut t = start(None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 64, &data, false).await.expect("WRITE");
    }
    die_of(&mut t, Signal::SEGV);
    assert!(t.output().contains("fatal signal"), "{}", t.output_tail(10));
    for start_after in ["the SIGSEGV", "a start after it"] {
        let mut t = start(Some(port));
        assert!(
            !is_ready(&t).await,
            "{start_after}: served the memory of a faulted writer\n{}",
            t.output_tail(20)
        );
        let st = status_text(&state);
        assert!(st.contains("SIGSEGV"), "{start_after}: {st}");
        assert!(
            sup.names().contains(&format!("lun-{naa}")),
            "{start_after}: the memory left the store: {:?}",
            sup.names()
        );
        t.kill();
    }

    // accept-empty starts the LUN afresh; a stop dumps this generation,
    // the next start takes the kept memory, and a SIGBUS before any write
    // leaves the image as current as the memory: it is restored.
    let t = start(Some(port));
    let out = cli(&["accept-empty", t.target_name(), "0"], &state);
    assert!(out.status.success(), "{out:?}");
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 64, &data, false).await.expect("WRITE");
    }
    let mut t = t;
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let mut t = start(Some(port));
    assert!(
        t.output().contains("LUN content kept in memory"),
        "{}",
        t.output_tail(20)
    );
    die_of(&mut t, Signal::BUS);
    let t = start(Some(port));
    assert!(
        t.output().contains("SIGBUS") && t.output().contains("restoring LUN content"),
        "{}",
        t.output_tail(20)
    );
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert!(
        s.read(0, 64, 8, 512).await.expect("READ") == data,
        "the image's content"
    );
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every signal that means the writer may have stored anywhere marks the
/// kept memory, like SIGSEGV: SIGABRT (glibc's heap-corruption checks and
/// Rust's allocation failure call abort(3) in the process itself: the
/// test build's SIGHUP trigger does that), SIGFPE and SIGSYS. The next
/// start does not serve the memory and names the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_fpe_or_sys_is_a_fault_and_its_memory_is_not_served() {
    use rustix::process::Signal;
    use std::os::unix::process::ExitStatusExt;
    let dir = scratch_dir("kept", "abort");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let start = |port| {
        let options = ramslog_tests::TargetOptions {
            page_checksums: false,
            env: vec![("RAMSLOG_TEST_ABORT_ON_HANGUP".into(), "1".into())],
            ..persistent(&state, port, &[])
        };
        TargetProcess::start_with(sup.launch(options).0)
    };
    let mut port = None;
    for (name, signal) in [
        ("SIGABRT", Signal::ABORT),
        ("SIGFPE", Signal::FPE),
        ("SIGSYS", Signal::SYS),
    ] {
        let mut t = start(port);
        port = Some(t.port());
        if !is_ready(&t).await {
            let out = cli(&["accept-empty", t.target_name(), "0"], &state);
            assert!(out.status.success(), "{out:?}");
        }
        // After the write the memory is the only copy of this generation.
        let s = open(&t, INITIATOR).await;
        s.write(0, 64, &random_bytes(4096), false)
            .await
            .expect("WRITE");
        drop(s);
        if signal == Signal::ABORT {
            ramslog_tests::send_signal(t.pid(), Signal::HUP);
        } else {
            ramslog_tests::send_signal(t.pid(), signal);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = t.try_exit_status() {
                break s;
            }
            assert!(Instant::now() < deadline, "{name} did not end the daemon");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.signal(), Some(signal.as_raw()), "{name}: {status:?}");
        let t = start(port);
        assert!(
            !is_ready(&t).await,
            "after {name}: served the memory of a faulted writer\n{}",
            t.output_tail(20)
        );
        let st = status_text(&state);
        assert!(st.contains(name), "after {name}: {st}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--verify-kept-memory`, the memory of a writer that died of a
/// fault is served when every page matches the checksum kept beside it
/// (and the checksums go on across a planned restart); a byte changed
/// behind the daemon's back (a wild write into a page no command was
/// writing) keeps it NOT READY, naming the pages that differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faulted_writer_is_served_only_when_every_page_matches_its_checksum() {
    use rustix::process::Signal;
    let dir = scratch_dir("kept", "verify");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let launch = |port| {
        let (options, _inherited) = sup.launch(persistent(&state, port, &[]));
        TargetProcess::start_with(options)
    };
    let mut t = launch(None);
    let port = t.port();
    let naa = stored_naa(&sup);
    let (small, large) = (random_bytes(512), random_bytes(64 << 10));
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 7, &small, false).await.expect("WRITE");
        s.write(0, 4096, &large, false).await.expect("WRITE");
    }
    die_of(&mut t, Signal::SEGV);
    let t = launch(Some(port));
    assert!(
        t.output().contains("every page matches its checksum") && is_ready(&t).await,
        "{}",
        t.output_tail(20)
    );
    restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(20)));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 7, 1, 512).await.expect("READ") == small);
    assert!(s.read(0, 4096, 128, 512).await.expect("READ") == large);
    s.write(0, 8, &small, false).await.expect("WRITE");
    drop(s);
    let mut t = t;
    die_of(&mut t, Signal::SEGV);
    let t = launch(Some(port));
    assert!(
        is_ready(&t).await,
        "after the restart\n{}",
        t.output_tail(20)
    );
    let mut t = t;

    // A wild write into a page no command was writing.
    let memory = sup.get(&format!("lun-{naa}")).expect("the LUN memory");
    rustix::io::pwrite(&memory, &[0xa5], 3 << 20).expect("a byte behind its back");
    die_of(&mut t, Signal::SEGV);
    let t = launch(Some(port));
    assert!(!is_ready(&t).await, "{}", t.output_tail(20));
    let st = status_text(&state);
    assert!(
        st.contains("1 of its") && st.contains("differ from their checksums"),
        "{st}"
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--verify-kept-memory`, a write the target refused after planning
/// it (its Expected Data Transfer Length does not match its blocks) must
/// not leave its page unchecked: a wild write there later, then a fault,
/// and the memory is NOT READY, never served with the stray byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_leaves_its_page_checked_after_a_fault() {
    use rustix::process::Signal;
    let dir = scratch_dir("kept", "verify-refused");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let launch = |port| {
        let (options, _inherited) = sup.launch(persistent(&state, port, &[]));
        TargetProcess::start_with(options)
    };
    let mut t = launch(None);
    let port = t.port();
    let naa = stored_naa(&sup);
    // The refused write's page: LBA 6144 (3 MiB).
    const PAGE_AT: u64 = 3 << 20;
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &random_bytes(4096), false)
            .await
            .expect("WRITE");
        let cdb = ramslog_common::cdb::write10(PAGE_AT / 512, 8, false).expect("CDB");
        let r = s
            .command(0, &cdb, Some(&[0x11; 2048]), 0)
            .await
            .expect("the refused WRITE's answer");
        assert_eq!(
            (r.status, sense(&r)),
            (
                status::CHECK_CONDITION,
                (sense_key::ILLEGAL_REQUEST, 0x0e, 0x03)
            ),
            "an EDTL of half the blocks is refused whole"
        );
    }
    let memory = sup.get(&format!("lun-{naa}")).expect("the LUN memory");
    rustix::io::pwrite(&memory, &[0xa5], PAGE_AT + 100).expect("a byte behind its back");
    die_of(&mut t, Signal::SEGV);
    let t = launch(Some(port));
    assert!(
        !is_ready(&t).await,
        "kept memory with a stray byte in the refused write's page was served READY\n{}",
        t.output_tail(20)
    );
    let st = status_text(&state);
    assert!(
        st.contains("1 of its") && st.contains("differ from their checksums"),
        "{st}"
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A start whose image is missing (a disk not mounted yet, a file moved)
/// is NOT READY, but its empty memory is not content: it must not go into
/// the store, where every later start (a crash, `systemctl restart`) would
/// find it "discarded" and stay NOT READY after the admin put the image
/// back. Put back, the image decides again and the LUN is READY with every
/// byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_put_back_serves_again_after_a_crash() {
    let dir = scratch_dir("kept", "image-back");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    // Before a reboot: the image is all there is (no store holds memory).
    let t = TargetProcess::start_with(persistent(&state, None, &[]));
    let port = t.port();
    let data = random_bytes(8192);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 100, &data, false).await.expect("WRITE");
    }
    let mut t = t;
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let images = state.join("images");
    let moved = dir.join("moved-images");
    std::fs::rename(&images, &moved).expect("move the images away");
    std::fs::create_dir(&images).expect("an empty image directory");
    let mut t = start(&sup, &state, Some(port));
    assert!(!is_ready(&t).await, "READY without its image");
    // The advice keeps the content: put the image back, not accept-empty.
    let st = status_text(&state);
    assert!(
        st.contains("is missing") && st.contains("put the image back"),
        "{st}"
    );
    t.kill();
    std::fs::remove_dir(&images).expect("remove the empty directory");
    std::fs::rename(&moved, &images).expect("put the images back");
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "NOT READY after the image was put back\n{}\n{}",
        status_text(&state),
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 100, 16, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A planned restart under a holder does not dump: the memory, handed
/// over with its record, is the only current copy. When a LUN's record
/// cannot be written as handed over (test builds fail it on request, as a
/// record too large for its slot would), that LUN is dumped first and the
/// new program restores it: READY with every byte, never NOT READY for a
/// memory without a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lun_whose_record_cannot_be_handed_over_is_dumped_first() {
    let dir = scratch_dir("kept", "handover-record");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let options = ramslog_tests::TargetOptions {
        env: vec![("RAMSLOG_TEST_HANDED_OVER_RECORD_FAILS".into(), "1".into())],
        ..persistent(&state, None, &[])
    };
    let t = TargetProcess::start_with(sup.launch(options).0);
    stored_naa(&sup);
    let data = random_bytes(8192);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 300, &data, false).await.expect("WRITE");
    }
    let said = restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(20)));
    assert!(
        is_ready(&t).await,
        "NOT READY: the LUN was handed over without its record ({said})\n{}\n{}",
        status_text(&state),
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 300, 16, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Memory a planned restart hands over must be in the fd store afterwards,
/// whatever the program before did: from a run with kept memory off (the
/// config file turns it on for the new program), a crash after the
/// restart keeps every write, and until the store holds it `status` does
/// not say it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_handed_over_from_a_run_without_kept_memory_is_kept_after_a_crash() {
    let dir = scratch_dir("kept", "off-to-on");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let config = dir.join("ramslog.toml");
    std::fs::write(&config, "kept_memory = false\n").expect("config");
    let config_arg = config.display().to_string();
    let launch = |port| {
        let (options, passed) = sup.launch(persistent(&state, port, &["--config", &config_arg]));
        (TargetProcess::start_with(options), passed)
    };
    let (mut t, _passed) = launch(None);
    let port = t.port();
    let (first, second) = (random_bytes(4096), random_bytes(4096));
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 100, &first, false).await.expect("WRITE");
    }
    assert!(status_text(&state).contains("--kept-memory=off"));
    std::fs::write(&config, "kept_memory = true\n").expect("config");
    restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(20)));
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 200, &second, false).await.expect("WRITE");
    }
    let said = status_text(&state);
    t.kill();
    let (t, _passed) = launch(Some(port));
    assert!(
        is_ready(&t).await,
        "the content is lost: the memory handed over was not in the store (status said: {said})\n{}",
        t.output_tail(20)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 100, 8, 512).await.expect("READ") == first);
    assert!(s.read(0, 200, 8, 512).await.expect("READ") == second);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restart whose new program passes the check but cannot be executed
/// (its interpreter vanished in between) changes nothing for the data: the daemon takes its
/// LUNs back and serves on, `restart --wait` and `status` say why, writes
/// after it are kept (under the store, in memory across a kill -9;
/// without one, the image the restart dumped is stale at once, so a kill -9
/// is NOT READY, never that image), and a restart with the binary put back
/// hands everything over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_whose_exec_fails_serves_on() {
    use std::os::unix::fs::PermissionsExt;
    for holder in [true, false] {
        let dir = scratch_dir("kept", if holder { "exec-held" } else { "exec-bare" });
        let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
        let state = dir.join("state");
        std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
        let bin = dir.join("bin/ramslog-target");
        std::fs::copy(ramslog_tests::target_binary(), &bin).expect("copy the binary");
        let options = |port| ramslog_tests::TargetOptions {
            binary: Some(bin.clone()),
            ..persistent(&state, port, &[])
        };
        let launch = |port| {
            if holder {
                TargetProcess::start_with(sup.launch(options(port)).0)
            } else {
                TargetProcess::start_with(options(port))
            }
        };
        let mut t = launch(None);
        let port = t.port();
        let first = random_bytes(4096);
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &first, false).await.expect("WRITE");
        drop(s);
        // The new program passes the check, then cannot be executed when
        // the exec comes: its interpreter (a copy of bash) is gone. (The
        // file itself vanishing no longer fails the exec: the restart runs
        // the very file it checked, opened once.)
        let interpreter = dir.join("bin/interpreter");
        let vanish = || {
            std::fs::copy("/bin/bash", &interpreter).expect("copy bash");
            let vanishing = bin.with_extension("new");
            std::fs::write(
                &vanishing,
                format!(
                    "#!{}\nrm -f {}\nexec {} \"$@\"\n",
                    interpreter.display(),
                    interpreter.display(),
                    ramslog_tests::target_binary().display()
                ),
            )
            .expect("write");
            std::fs::set_permissions(&vanishing, std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            std::fs::rename(&vanishing, &bin).expect("rename over the binary");
        };
        vanish();
        let out = cli(&["restart"], &state);
        assert!(out.status.success(), "holder {holder}: {out:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !status_text(&state).contains("last restart: failed") {
            assert!(
                t.is_running() && Instant::now() < deadline,
                "holder {holder}: no failed restart in the status\n{}",
                t.output_tail(20)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Again, as `systemctl reload` runs it: it says why.
        vanish();
        let failed = restart(&state).expect_err("a restart without a binary succeeded");
        assert!(
            failed.contains("the restart failed") && failed.contains("cannot execute"),
            "holder {holder}: {failed}\n{}",
            t.output_tail(20)
        );
        assert!(t.is_running(), "holder {holder}: {}", t.output_tail(20));
        assert!(
            is_ready(&t).await,
            "holder {holder}: {}",
            status_text(&state)
        );
        let second = random_bytes(4096);
        {
            let s = open(&t, INITIATOR).await;
            assert!(s.read(0, 800, 8, 512).await.expect("READ") == first);
            s.write(0, 1600, &second, false)
                .await
                .expect("WRITE after the failed restart");
        }
        std::fs::copy(ramslog_tests::target_binary(), &bin).expect("put the binary back");
        if holder {
            // The next restart hands over, in memory.
            let out = restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(30)));
            assert!(out.contains("1 kept in memory"), "{out}");
            let s = open(&t, INITIATOR).await;
            assert!(s.read(0, 1600, 8, 512).await.expect("READ") == second);
            drop(s);
            t.kill();
            let t = launch(Some(port));
            assert!(is_ready(&t).await, "{}", status_text(&state));
            let s = open(&t, INITIATOR).await;
            assert!(s.read(0, 800, 8, 512).await.expect("READ") == first);
            assert!(s.read(0, 1600, 8, 512).await.expect("READ") == second);
        } else {
            // The image the restart dumped does not hold `second`.
            t.kill();
            let t = launch(Some(port));
            assert!(
                !is_ready(&t).await,
                "the restart's image came back after later writes\n{}",
                t.output_tail(20)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A stop requested while a restart hands over (systemd's stop job right
/// after a reload) is not lost across the exec, and does not kill the new
/// program before it can read it: the stop signals are blocked in every
/// thread and read from a signalfd, so one not read yet stays pending
/// across `execve`, and the new program stops at once, dumping, with exit
/// status 0. The next start,
/// without the store, is READY with the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_a_restart_is_honoured_by_the_new_program() {
    let dir = scratch_dir("kept", "stop-in-restart");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    let out = cli(&["restart"], &state);
    assert!(out.status.success(), "{out:?}");
    ramslog_tests::send_signal(t.pid(), rustix::process::Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the stop was lost across the restart\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}\n{}", t.output_tail(20));
    // The race this test is about: the new program started, then read the
    // stop that crossed the exec.
    let log = t.output();
    let started = log
        .find("started by a restart")
        .unwrap_or_else(|| panic!("the new program never started\n{}", t.output_tail(20)));
    let stopping = log
        .rfind("SIGTERM")
        .unwrap_or_else(|| panic!("no SIGTERM was read\n{}", t.output_tail(20)));
    assert!(
        started < stopping,
        "the SIGTERM was read before the exec, not by the new program\n{}",
        t.output_tail(20)
    );
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The host a reservation fences.
const HOST_B: &str = "iqn.2026-11.org.ramslog:e2e-fenced-host";

/// The status of one WRITE(10) from host B.
async fn b_writes(t: &TargetProcess) -> u8 {
    let b = Session::login(t.addr(), LoginParams::normal(HOST_B, t.target_name()))
        .await
        .expect("login B");
    clear_unit_attentions(&b).await;
    let cdb = ramslog_common::cdb::write10(100, 1, false).expect("WRITE(10)");
    let r = b
        .command(0, &cdb, Some(&[0x5a; 512]), 0)
        .await
        .expect("B's WRITE");
    r.status
}

/// PERSISTENT RESERVE IN from host A: the registered keys.
async fn read_keys(t: &TargetProcess) -> Vec<u64> {
    let a = open(t, INITIATOR).await;
    let r = a
        .command(0, &[0x5e, 0, 0, 0, 0, 0, 0, 0, 255, 0], None, 255)
        .await
        .expect("PERSISTENT RESERVE IN, READ KEYS");
    assert!(r.is_good(), "{r:?}");
    let len = u32::from_be_bytes(r.data[4..8].try_into().expect("length")) as usize;
    r.data[8..8 + len]
        .chunks(8)
        .map(|k| u64::from_be_bytes(k.try_into().expect("key")))
        .collect()
}

/// PERSISTENT RESERVE IN, REPORT CAPABILITIES: (PTPL_C, PTPL_A).
async fn ptpl(t: &TargetProcess) -> (bool, bool) {
    let a = open(t, INITIATOR).await;
    let r = a
        .command(0, &[0x5e, 2, 0, 0, 0, 0, 0, 0, 8, 0], None, 8)
        .await
        .expect("PERSISTENT RESERVE IN, REPORT CAPABILITIES");
    assert!(r.is_good() && r.data.len() == 8, "{r:?}");
    (r.data[2] & 1 != 0, r.data[3] & 1 != 0)
}

/// PERSISTENT RESERVE OUT (type WRITE EXCLUSIVE), GOOD expected.
async fn pr_out(s: &Session, sa: u8, key: u64, sa_key: u64, aptpl: bool) {
    let (cdb, mut params) = ramslog_common::cdb::persistent_reserve_out(sa, key, sa_key);
    params[20] = u8::from(aptpl);
    let r = s
        .command(0, &cdb, Some(&params), 0)
        .await
        .expect("PERSISTENT RESERVE OUT");
    assert!(r.is_good(), "service action {sa}: {r:?}");
}

/// A holds WRITE EXCLUSIVE and preempted B (as fence_scsi fences a node),
/// every REGISTER with `aptpl`.
async fn fence_b(t: &TargetProcess, aptpl: bool) {
    let a = open(t, INITIATOR).await;
    let b = open(t, HOST_B).await;
    pr_out(&a, 0, 0, 0xaa, aptpl).await;
    pr_out(&b, 0, 0, 0xbb, aptpl).await;
    pr_out(&a, 1, 0xaa, 0, false).await;
    pr_out(&a, 4, 0xaa, 0xbb, false).await;
}

/// Host A holds a WRITE EXCLUSIVE reservation and has preempted host B (as
/// fence_scsi fences a node). A planned restart and a crash whose memory is
/// served again keep that: B's write still conflicts, and the keys read
/// back are A's alone. A stop and a start through the image drop
/// persistent reservations without APTPL: B writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_survive_a_restart_and_a_crash_but_not_a_stop() {
    let dir = scratch_dir("kept", "reservations");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    fence_b(&t, false).await;
    assert_eq!(b_writes(&t).await, status::RESERVATION_CONFLICT, "fenced");
    assert_eq!(ptpl(&t).await, (true, false));
    restart(&state).unwrap_or_else(|e| panic!("{e}\n{}", t.output_tail(20)));
    assert_eq!(
        b_writes(&t).await,
        status::RESERVATION_CONFLICT,
        "after a restart\n{}",
        t.output_tail(20)
    );
    assert_eq!(read_keys(&t).await, vec![0xaa], "after a restart");
    t.kill();
    let mut t = start(&sup, &state, Some(port));
    assert!(
        t.output().contains("LUN content kept in memory"),
        "{}",
        t.output_tail(20)
    );
    assert_eq!(
        b_writes(&t).await,
        status::RESERVATION_CONFLICT,
        "after a crash\n{}",
        t.output_tail(20)
    );
    assert_eq!(read_keys(&t).await, vec![0xaa], "after a crash");
    assert!(t.stop().success(), "{}", t.output_tail(20));
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert_eq!(b_writes(&t).await, status::GOOD, "after a stop and a start");
    assert_eq!(
        read_keys(&t).await,
        Vec::<u64>::new(),
        "after a stop and a start"
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With APTPL (fence_scsi's --aptpl, Windows failover clusters), the
/// reservations are content: REPORT CAPABILITIES says PTPL_C and PTPL_A, a
/// stop and a start through the image keep them (B still conflicts, the
/// keys are A's, `status` says so). A PR OUT that changes them makes the
/// image stale before its GOOD, so a kill -9 with the store dropped
/// answers NOT READY instead of bringing the older reservations back; and
/// accept-empty clears them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aptpl_reservations_survive_a_stop_and_a_start_until_accept_empty() {
    let dir = scratch_dir("kept", "aptpl");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    fence_b(&t, true).await;
    assert_eq!(ptpl(&t).await, (true, true));
    assert!(t.stop().success(), "{}", t.output_tail(20));
    sup.clear();
    let mut t = start(&sup, &state, Some(port));
    assert!(
        t.output().contains("LUN content restored"),
        "{}",
        t.output_tail(20)
    );
    assert_eq!(
        b_writes(&t).await,
        status::RESERVATION_CONFLICT,
        "after a stop and a start\n{}",
        t.output_tail(20)
    );
    assert_eq!(read_keys(&t).await, vec![0xaa]);
    assert_eq!(ptpl(&t).await, (true, true));
    let shown = cli(&["status"], &state);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("persistent reservations: 1 registration(s), type 1 held; APTPL"),
        "{shown}"
    );
    // A new key for A, no data written: the image of this generation is
    // no longer current before the GOOD.
    pr_out(&open(&t, INITIATOR).await, 6, 0, 0xab, true).await;
    t.kill();
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert!(
        !is_ready(&t).await,
        "the older image came back\n{}",
        t.output_tail(20)
    );
    let out = cli(&["accept-empty", t.target_name(), "0"], &state);
    assert!(out.status.success(), "accept-empty: {out:?}");
    assert_eq!(read_keys(&t).await, Vec::<u64>::new());
    assert_eq!(ptpl(&t).await, (true, false));
    assert_eq!(b_writes(&t).await, status::GOOD, "after accept-empty");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// After a crash, the start systemd makes may find the state directory
/// still locked by a process of the previous run (a leader still ending, a
/// straggler): it waits for the lock instead of exiting (which would end
/// the unit and lose the store), and once the lock is free takes the kept
/// memory over, READY with every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_after_a_crash_waits_for_the_state_directory_lock() {
    let dir = scratch_dir("kept", "lock-wait");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    t.kill();
    // The straggler: this test holds the directory's lock.
    let straggler = std::fs::File::open(&state).expect("open the state directory");
    straggler.lock().expect("lock it");
    let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
    let mut t = TargetProcess::spawn_with(options);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.output().contains("waiting for it") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "the start did not wait for the lock\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(t.is_running(), "{}", t.output_tail(20));
    assert!(
        !t.output().contains("listening on"),
        "{}",
        t.output_tail(20)
    );
    drop(straggler);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !t.output().contains("listening on") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "no start once the lock was free\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        t.output().contains("LUN content kept in memory"),
        "{}",
        t.output_tail(20)
    );
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);

    // A stop while it waits is honoured once the lock is had: the kept
    // memory is taken over and dumped (exit 0), so a start without the
    // store has the content.
    let mut t = t;
    t.kill();
    let straggler = std::fs::File::open(&state).expect("open the state directory");
    straggler.lock().expect("lock it");
    let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
    let mut t = TargetProcess::spawn_with(options);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.output().contains("waiting for it") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    ramslog_tests::send_signal(t.pid(), rustix::process::Signal::TERM);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        t.is_running(),
        "exited without the lock\n{}",
        t.output_tail(20)
    );
    drop(straggler);
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(Instant::now() < deadline, "{}", t.output_tail(20));
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}\n{}", t.output_tail(20));
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The straggler is the last writer itself, stopped (SIGSTOP) with the
/// lock: a start with the store waits, a SIGTERM reaches it while it
/// waits, then the old writer is killed and the lock is free. The rules
/// must be judged on what holds once the lock is had (the writer is gone):
/// the memory is taken over and dumped, the exit is clean, and a start
/// without the store (systemd 252 empties it on that exit) has every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_waiting_for_a_stopped_writer_keeps_the_content() {
    use rustix::process::Signal;
    let dir = scratch_dir("kept", "lock-writer");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut old = start(&sup, &state, None);
    let port = old.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&old, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    ramslog_tests::send_signal(old.pid(), Signal::STOP);
    let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
    let mut t = TargetProcess::spawn_with(options);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.output().contains("waiting for it") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "the start did not wait for the lock\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    ramslog_tests::send_signal(t.pid(), Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t
        .output()
        .contains("stopping once the state directory's lock is had")
    {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "the waiting start did not take the SIGTERM\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    old.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(st) = t.try_exit_status() {
            break st;
        }
        assert!(Instant::now() < deadline, "{}", t.output_tail(20));
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}\n{}", t.output_tail(20));
    let said = t.output();
    sup.clear();
    let t = start(&sup, &state, Some(port));
    assert!(
        is_ready(&t).await,
        "the content is lost: every byte was to be dumped\n{}\n{said}",
        status_text(&state)
    );
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM at every step of a start-up, after a kill -9 (the memory in
/// the store is the only copy) and after a planned restart (the new
/// program's start): whatever the step, the daemon exits 0 having saved the
/// content, and a start with the store dropped (systemd 252 empties it at a
/// stop) is READY with every acknowledged write. The test build stops the
/// daemon at the step named in its pause file (`pause_here_for_tests`):
/// the SIGTERM is sent while it is stopped there, so each round signals at
/// the step it names, not after a delay that falls anywhere. Each round
/// first writes a block of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_at_any_moment_of_a_start_up_keeps_the_content() {
    // In start-up order: the stop signals read, the state directory's lock
    // had, the kept memory taken over, the memory in the store, listening.
    const STEPS: [&str; 5] = ["signals", "locked", "kept", "stored", "listening"];
    let dir = scratch_dir("kept", "stop-anywhere");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let pause_file = dir.join("pause-at");
    let launch = |port| {
        let options = ramslog_tests::TargetOptions {
            env: vec![(
                "RAMSLOG_TEST_PAUSE_FILE".into(),
                pause_file.display().to_string(),
            )],
            ..persistent(&state, port, &[])
        };
        sup.launch(options)
    };
    // What the supervisor passes stays open until each daemon has started.
    let (options, _passed) = launch(None);
    let mut t = TargetProcess::start_with(options);
    let port = t.port();
    stored_naa(&sup);
    let mut expected = HashMap::new();
    let mut round = 0u64;
    for after_restart in [false, true] {
        for step in STEPS {
            let how = if after_restart {
                "a restart"
            } else {
                "a kill -9"
            };
            let when = format!("SIGTERM at step {step} of the start after {how}");
            {
                let s = open(&t, INITIATOR).await;
                let data = random_bytes(4096);
                s.write(0, round * 8, &data, false)
                    .await
                    .unwrap_or_else(|e| panic!("WRITE before {when}: {e}"));
                expected.insert(round, data);
            }
            round += 1;
            std::fs::write(&pause_file, step).expect("the pause file");
            if after_restart {
                // Returns once the handover has begun; the exec follows.
                let out = cli(&["restart"], &state);
                assert!(
                    out.status.success(),
                    "restart before {when}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let mut _passed = Vec::new();
            if !after_restart {
                t.kill();
                let (options, passed) = launch(Some(port));
                _passed = passed;
                t = TargetProcess::spawn_with(options);
            }
            wait_paused(&mut t, step);
            ramslog_tests::send_signal(t.pid(), ramslog_tests::Signal::TERM);
            ramslog_tests::send_signal(t.pid(), ramslog_tests::Signal::CONT);
            let deadline = Instant::now() + Duration::from_secs(60);
            let exit = loop {
                if let Some(st) = t.try_exit_status() {
                    break st;
                }
                assert!(Instant::now() < deadline, "no exit after {when}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            assert!(exit.success(), "{when}: {exit:?}\n{}", t.output_tail(30));
            assert!(
                t.output().contains(&format!("step=\"{step}\"")),
                "{when}: the daemon did not say it paused there\n{}",
                t.output_tail(30)
            );
            // A stop and a start: the store is empty, the image decides.
            sup.clear();
            let (options, _passed) = launch(Some(port));
            t = TargetProcess::start_with(options);
            assert!(
                is_ready(&t).await,
                "after {when}: {}\n{}",
                status_text(&state),
                t.output_tail(30)
            );
            let s = open(&t, INITIATOR).await;
            assert_present(&s, &expected, &format!("after {when}")).await;
        }
    }
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two successors given the same kept memory at once (a supervisor's bad
/// order: systemd never starts two, a hand-made holder might): one takes
/// the state directory's lock and serves, the other waits for it, neither
/// serving nor exiting. When the first dies (kill -9), the second takes
/// the memory over with every write of both runs, READY: it judges the
/// record as the first left it, not as it was before it waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_successors_given_the_same_memory_serve_one_at_a_time() {
    let dir = scratch_dir("kept", "two-successors");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let before = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &before, false).await.expect("WRITE");
    }
    t.kill();
    let launch = || {
        let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
        TargetProcess::spawn_with(options)
    };
    let mut both = [launch(), launch()];
    let deadline = Instant::now() + Duration::from_secs(30);
    let (serving, waiting) = loop {
        let listening = |t: &TargetProcess| t.output().contains("listening on");
        let waits = |t: &TargetProcess| t.output().contains("waiting for it");
        match (listening(&both[0]), listening(&both[1])) {
            (true, true) => panic!(
                "two daemons serve one memory:\n{}\n---\n{}",
                both[0].output_tail(20),
                both[1].output_tail(20)
            ),
            (true, false) if waits(&both[1]) => break (0, 1),
            (false, true) if waits(&both[0]) => break (1, 0),
            _ => {}
        }
        for t in &mut both {
            assert!(t.is_running(), "a successor exited: {}", t.output_tail(20));
        }
        assert!(
            Instant::now() < deadline,
            "not one serving and one waiting:\n{}\n---\n{}",
            both[0].output_tail(20),
            both[1].output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let [a, b] = both;
    let (mut first, mut second) = if serving == 0 { (a, b) } else { (b, a) };
    let _ = waiting;
    assert!(is_ready(&first).await, "{}", first.output_tail(20));
    let during = random_bytes(4096);
    {
        let s = open(&first, INITIATOR).await;
        assert!(s.read(0, 800, 8, 512).await.expect("READ") == before);
        s.write(0, 1600, &during, false).await.expect("WRITE");
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        second.is_running() && !second.output().contains("listening on"),
        "the second must wait while the first serves: {}",
        second.output_tail(20)
    );
    first.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !second.output().contains("listening on") {
        assert!(
            second.is_running() && Instant::now() < deadline,
            "the second did not take over once the first died\n{}",
            second.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        second.output().contains("LUN content kept in memory"),
        "the second did not take the LUN content kept in memory over: {}",
        second.output_tail(20)
    );
    assert!(is_ready(&second).await, "{}", status_text(&state));
    let s = open(&second, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == before);
    assert!(s.read(0, 1600, 8, 512).await.expect("READ") == during);
    drop(s);
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The state field of /proc/PID/stat ('Z' for a zombie), if PID exists.
pub(super) fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Wait until the daemon stopped itself at its test-build pause `step`
/// (state T); fails if it ends or does not get there in 20 s.
pub(super) fn wait_paused(t: &mut TargetProcess, step: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while process_state(t.pid()) != Some('T') {
        assert!(
            Instant::now() < deadline && t.is_running(),
            "the daemon never paused at {step}\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A process standing in for a writer of the old run that still lives (a
/// forked holder, a straggler): its pidfd goes into `sup` as the stored
/// `writer`. Kill and reap it to let the memory go.
pub(super) fn living_writer(sup: &FdStoreSupervisor) -> std::process::Child {
    let straggler = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("sleep");
    let pid = rustix::process::Pid::from_raw(straggler.id() as i32).expect("pid");
    let pidfd =
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).expect("pidfd_open");
    sup.put("writer", pidfd.as_fd());
    straggler
}

/// A supervisor that has not yet reaped the killed daemon (a zombie: every
/// thread ended, its memory and descriptors released, only its pid left)
/// does not hold the memory back: the next start serves it. A writer whose
/// leader exited while another thread lives is still a writer: NOT READY
/// until that thread ends too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreaped_writer_is_gone_and_a_leader_with_a_live_thread_is_not() {
    let dir = scratch_dir("kept", "zombie");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    // SIGKILL, and no wait(): the daemon stays a zombie while the next starts.
    // The leader turns 'Z' as soon as its own thread ends; the rest of the
    // group ends after it, so wait for the pidfd (all threads gone).
    let zombie = t.pid();
    let zombie_fd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(zombie as i32).expect("pid"),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("pidfd_open");
    ramslog_tests::send_signal(zombie, rustix::process::Signal::KILL);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut fds = [rustix::event::PollFd::new(
            &zombie_fd,
            rustix::event::PollFlags::IN,
        )];
        if rustix::event::poll(
            &mut fds,
            Some(&rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            }),
        )
        .expect("poll")
            > 0
        {
            break;
        }
        assert!(Instant::now() < deadline, "the daemon did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(process_state(zombie), Some('Z'), "not a zombie");
    let next = start(&sup, &state, Some(port));
    let ready = is_ready(&next).await;
    assert_eq!(process_state(zombie), Some('Z'), "reaped too early");
    assert!(
        ready,
        "a zombie writer holds the memory back: {}",
        status_text(&state)
    );
    let s = open(&next, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(next);
    t.kill();

    // A writer whose main thread called exit(2) (not exit_group) while a
    // second thread sleeps: a zombie leader, its thread group alive.
    let mut leader_gone = std::process::Command::new("python3")
        .args([
            "-c",
            "import ctypes, threading, time\n\
             threading.Thread(target=time.sleep, args=(60,)).start()\n\
             ctypes.CDLL(None).syscall(60, 0)",
        ])
        .spawn()
        .expect("python3");
    let pid = leader_gone.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    while process_state(pid) != Some('Z') {
        assert!(Instant::now() < deadline, "the leader did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
    let live_thread = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(live_thread >= 1, "no thread left in {pid}");
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).expect("pid"),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("pidfd_open");
    sup.remove("writer");
    sup.put("writer", pidfd.as_fd());
    let next = start(&sup, &state, Some(port));
    assert!(!is_ready(&next).await, "served while a writer thread lives");
    let st = status_text(&state);
    assert!(st.contains("is still running"), "{st}");
    drop(next);
    leader_gone.kill().expect("kill");
    leader_gone.wait().expect("reap");
    let next = start(&sup, &state, Some(port));
    assert!(is_ready(&next).await, "{}", status_text(&state));
    let s = open(&next, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(next);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child forked by the daemon would share the state directory's lock
/// (one open file description) and could outlive it. The test takes the
/// daemon's own lock descriptor (pidfd_getfd: what a fork inherits), the
/// daemon is killed, and the next start waits for the lock, serving
/// nothing, until that holder lets it go; then it serves the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forked_holder_of_the_lock_keeps_the_next_start_waiting() {
    let dir = scratch_dir("kept", "forked-holder");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let state = dir.join("state");
    let mut t = start(&sup, &state, None);
    let port = t.port();
    stored_naa(&sup);
    let data = random_bytes(4096);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 800, &data, false).await.expect("WRITE");
    }
    let state_path = std::fs::canonicalize(&state).expect("state path");
    let lock_fd: i32 = std::fs::read_dir(format!("/proc/{}/fd", t.pid()))
        .expect("the daemon's descriptors")
        .filter_map(Result::ok)
        .find(|e| std::fs::read_link(e.path()).ok().as_deref() == Some(state_path.as_path()))
        .and_then(|e| e.file_name().to_str()?.parse().ok())
        .expect("the daemon holds the state directory open");
    let daemon = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(t.pid() as i32).expect("pid"),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("pidfd_open");
    let holder =
        rustix::process::pidfd_getfd(&daemon, lock_fd, rustix::process::PidfdGetfdFlags::empty())
            .expect("pidfd_getfd: the daemon's lock");
    t.kill();

    let (options, _inherited) = sup.launch(persistent(&state, Some(port), &[]));
    let mut t = TargetProcess::spawn_with(options);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.output().contains("waiting for it") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "the start did not wait for the lock the holder shares\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        t.is_running() && !t.output().contains("listening on"),
        "a second server beside the holder\n{}",
        t.output_tail(20)
    );
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.output().contains("listening on") {
        assert!(
            t.is_running() && Instant::now() < deadline,
            "no start once the holder let the lock go\n{}",
            t.output_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(is_ready(&t).await, "{}", status_text(&state));
    let s = open(&t, INITIATOR).await;
    assert!(s.read(0, 800, 8, 512).await.expect("READ") == data);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
