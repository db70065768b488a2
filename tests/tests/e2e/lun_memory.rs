//! LUN memory the daemon cannot or must not take at start. A LUN that
//! answers NOT READY serves no byte, so it takes no memory until
//! accept-empty makes it a device again: a LUN whose kept memory is held
//! back for a doubt never costs a second copy. A LUN whose memory cannot be
//! had (no huge pages under `--hugepages require`, a memory lock limit) is
//! NOT READY on its own, the other LUNs and the control socket serve on,
//! and its image (or kept memory) decides again at the next start.

use std::path::Path;

use ramslog_tests::fdstore::FdStoreSupervisor;
use ramslog_tests::{find_in_path, TargetOptions, TargetProcess, DEFAULT_TARGET_NAME};

use super::kept::{is_ready, stored_naa};
use super::*;

/// Bytes of process `pid` locked in RAM (`VmLck`).
fn locked_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmLck in {status}"));
    kib << 10
}

const LUN_BYTES: u64 = 256 << 20;

/// A start given kept memory it holds back (the block size changed, so the
/// memory is kept for the configuration put back) answers NOT READY and
/// locks no second copy of the LUN: with `--hugepages require` and a pool
/// sized for one copy, a second would fail the start. accept-empty takes
/// the memory, and only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lun_whose_kept_memory_is_held_back_takes_no_second_copy() {
    let dir = scratch_dir("lun-memory", "held");
    let state = dir.join("state");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let launch = |extra: &[&str], port| {
        let mut args = vec!["--hugepages", "off"];
        args.extend_from_slice(extra);
        sup.launch(persistent(&state, port, &args))
    };
    let (options, _inherited) = launch(&[], None);
    let mut t = TargetProcess::start_with(options);
    let port = t.port();
    let _naa = stored_naa(&sup);
    {
        let s = open(&t, INITIATOR).await;
        s.write(0, 0, &random_bytes(4096), false)
            .await
            .expect("WRITE");
    }
    t.kill();
    let (options, _inherited) = launch(&["--block-size", "4096"], Some(port));
    let mut t = TargetProcess::start_with(options);
    assert!(!is_ready(&t).await, "served memory of another block size");
    let locked = locked_bytes(t.pid());
    assert!(
        locked < LUN_BYTES / 4,
        "a NOT READY LUN whose kept memory is held locked {locked} bytes: a second copy\n{}",
        t.output_tail(20)
    );
    let out = cli(&["accept-empty", t.target_name(), "0"], &state);
    assert!(
        out.status.success(),
        "accept-empty: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(is_ready(&t).await, "accept-empty left it NOT READY");
    let locked = locked_bytes(t.pid());
    assert!(
        locked >= LUN_BYTES,
        "accept-empty served a LUN of {LUN_BYTES} bytes with {locked} locked"
    );
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The daemon of `config` under `state`, on `port`; `wrapper` runs it.
fn start_config(config: &Path, state: &Path, port: u16, wrapper: &[&str]) -> TargetProcess {
    TargetProcess::start_with(TargetOptions {
        config: Some(config.into()),
        wrapper: wrapper.iter().map(|s| s.to_string()).collect(),
        extra_args: vec!["--hugepages".into(), "off".into()],
        ..persistent(state, Some(port), &[])
    })
}

/// Two LUNs (1 and 16 MiB), the second too large for the memory lock limit (root without
/// CAP_IPC_LOCK, as a unit without LimitMEMLOCK=infinity runs): LUN 0
/// serves its content, LUN 1 is NOT READY saying why, the control socket
/// answers, accept-empty (which would throw LUN 1's intact image away) is
/// refused, and a stop leaves the image as it was: the next start with the
/// memory to spare serves both LUNs' content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lun_that_cannot_get_memory_is_not_ready_alone_and_keeps_its_image() {
    assert!(
        is_root(),
        "this test drops CAP_IPC_LOCK from root: run it as root (CI does)"
    );
    for tool in ["setpriv", "prlimit"] {
        assert!(
            find_in_path(tool).is_some(),
            "{tool} (util-linux) is needed"
        );
    }
    let dir = scratch_dir("lun-memory", "memlock");
    let state = dir.join("state");
    let config = dir.join("ramslog.toml");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        &config,
        format!(
            "[[target]]\nname = \"{DEFAULT_TARGET_NAME}\"\n\
             [[target.lun]]\nlun = 0\nsize = \"1M\"\n\
             [[target.lun]]\nlun = 1\nsize = \"16M\"\n"
        ),
    )
    .expect("write config");
    let port = ramslog_tests::free_port();
    let (zero, one) = (random_bytes(8192), random_bytes(8192));
    let mut t = start_config(&config, &state, port, &[]);
    {
        let s = open(&t, INITIATOR).await;
        assert!(lun_ready(&s, 0).await && lun_ready(&s, 1).await);
        s.write(0, 8, &zero, true).await.expect("WRITE LUN 0");
        s.write(1, 8, &one, true).await.expect("WRITE LUN 1");
    }
    assert!(t.stop().success(), "{}", t.output_tail(20));

    // Between the two LUNs' sizes, and no higher than the hard limit this
    // process has (only CAP_SYS_RESOURCE raises it).
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock)
        .maximum
        .unwrap_or(u64::MAX)
        .min(8 << 20);
    assert!(
        limit >= 2 << 20,
        "the memory lock hard limit {limit} is below the 2 MiB this test needs"
    );
    let limit = limit.to_string();
    let mut t = start_config(
        &config,
        &state,
        port,
        &[
            "prlimit",
            &format!("--memlock={limit}:{limit}"),
            "setpriv",
            "--inh-caps=-ipc_lock",
            "--bounding-set=-ipc_lock",
        ],
    );
    {
        let s = open(&t, INITIATOR).await;
        assert!(lun_ready(&s, 0).await, "LUN 0 fits the limit");
        assert!(s.read(0, 8, 16, 512).await.expect("READ") == zero);
        assert!(!lun_ready(&s, 1).await, "LUN 1 READY beyond the limit");
    }
    let st = status_text(&state);
    assert!(
        st.contains("cannot lock") && st.contains("free memory"),
        "status names the cause and the fix: {st}"
    );
    assert!(
        !st.contains("run accept-empty"),
        "advice that throws an intact image away: {st}"
    );
    let out = cli(&["accept-empty", t.target_name(), "1"], &state);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && said.contains("its content is intact"),
        "accept-empty on a LUN without memory: {said}"
    );
    assert!(t.stop().success(), "{}", t.output_tail(20));

    let t = start_config(&config, &state, port, &[]);
    let s = open(&t, INITIATOR).await;
    assert!(
        lun_ready(&s, 0).await && lun_ready(&s, 1).await,
        "the image did not decide again\n{}",
        t.output_tail(20)
    );
    assert!(s.read(1, 8, 16, 512).await.expect("READ LUN 1") == one);
    assert!(s.read(0, 8, 16, 512).await.expect("READ LUN 0") == zero);
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A first start with `--hugepages require` and no free huge pages: the
/// LUN gets no identity and answers NOT READY naming the pool to reserve,
/// the control socket answers, and the first start that has memory gives
/// the LUN its identity and serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_without_its_huge_pages_serves_the_control_socket() {
    let free: u64 = std::fs::read_to_string("/proc/meminfo")
        .expect("meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("HugePages_Free");
    // One huge page more than the pool has free: refused before any is
    // taken, whatever this machine reserved.
    let size = format!("{}M", (free + 1) * 2);
    let dir = scratch_dir("lun-memory", "require");
    let state = dir.join("state");
    let mut t = TargetProcess::start_with(TargetOptions {
        size: size.clone(),
        ..persistent(&state, None, &["--hugepages", "require"])
    });
    let port = t.port();
    {
        let s = open(&t, INITIATOR).await;
        assert!(!lun_ready(&s, 0).await, "READY without its huge pages");
        // Memory not taken is never touched: a touch of a huge page the
        // pool does not have would kill the daemon (SIGBUS).
        assert!(s.read(0, 0, 8, 512).await.is_err(), "a READ served");
        assert!(
            s.write(0, 0, &[7; 4096], true).await.is_err(),
            "a WRITE served"
        );
    }
    let st = status_text(&state);
    assert!(
        st.contains("huge pages") && st.contains("nr_hugepages") && !st.contains("accept-empty,"),
        "status names the pool to reserve: {st}"
    );
    assert!(t.stop().success(), "{}", t.output_tail(20));
    let luns = std::fs::read_to_string(state.join("luns.toml")).unwrap_or_default();
    assert!(
        !luns.contains("naa"),
        "an identity recorded for a LUN that never served: {luns}"
    );
    let t = TargetProcess::start_with(TargetOptions {
        size,
        ..persistent(&state, Some(port), &["--hugepages", "auto"])
    });
    assert!(
        lun_ready(&open(&t, INITIATOR).await, 0).await,
        "{}",
        t.output_tail(20)
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
