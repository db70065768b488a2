//! The generation rule (docs/persistence.md): the first command of a run
//! that changes the medium bumps the LUN's generation, durably, before it is
//! acknowledged. A command that changes the medium and is followed by a
//! crash must leave the LUN NOT READY; a command that does not must leave
//! the image current. And a bump that cannot be made durable acknowledges
//! nothing and takes the LUN NOT READY.

use std::path::{Path, PathBuf};

use ramslog_common::scsi_wire::{sense_key, status};
use ramslog_tests::{TargetOptions, TargetProcess};

use super::*;

const BLOCK: usize = 512;
/// Where the commands act: inside the restored pattern.
const LBA: u64 = 64;

fn scratch(name: &str) -> PathBuf {
    scratch_dir("gen", name)
}

fn options(state_dir: &Path, port: Option<u16>, extra: &[&str]) -> TargetOptions {
    TargetOptions {
        size: "16M".into(),
        ..persistent(state_dir, port, extra)
    }
}

fn generation_in(state_dir: &Path) -> String {
    let s = std::fs::read_to_string(state_dir.join("luns.toml")).expect("luns.toml");
    s.lines()
        .find(|l| l.starts_with("generation = "))
        .unwrap_or_else(|| panic!("no generation in {s}"))
        .to_string()
}

/// The 16 blocks at `LBA` that every restored LUN holds.
fn restored_pattern() -> Vec<u8> {
    (0..16 * BLOCK).map(|i| (i % 251) as u8 + 1).collect()
}

/// A state directory whose LUN holds `restored_pattern` in a clean image,
/// and the daemon restarted from it: READY, restored, nothing written yet.
async fn restored(dir: &Path) -> (TargetProcess, Session) {
    restored_with(dir, &[]).await
}

/// [`restored`], the daemons started with `extra` flags.
async fn restored_with(dir: &Path, extra: &[&str]) -> (TargetProcess, Session) {
    let mut t = TargetProcess::start_with(options(dir, None, extra));
    let port = t.port();
    let s = open(&t, INITIATOR).await;
    s.write(0, LBA, &restored_pattern(), true)
        .await
        .expect("WRITE");
    drop(s);
    let st = t.stop();
    assert!(st.success(), "{}", t.output_tail(20));
    let t = TargetProcess::start_with(options(dir, Some(port), extra));
    let s = open(&t, INITIATOR).await;
    assert!(
        status_text(dir).contains("restored from"),
        "{}",
        status_text(dir)
    );
    (t, s)
}

/// After a kill -9 and a restart on the same state: is the LUN READY (its
/// image was still current) or NOT READY 04h/03h (a newer generation was
/// opened)?
async fn ready_after_a_crash(dir: &Path, mut t: TargetProcess) -> bool {
    let port = t.port();
    t.kill();
    let t = TargetProcess::start_with(options(dir, Some(port), &[]));
    let s = Session::login(t.addr(), LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("login");
    for _ in 0..4 {
        let r = s.test_unit_ready(0).await.expect("TUR");
        if r.is_good() {
            assert_eq!(
                s.read(0, LBA, 16, 512).await.expect("READ"),
                restored_pattern(),
                "READY means the restored bytes"
            );
            return true;
        }
        if r.status == status::CHECK_CONDITION && sense(&r) == (sense_key::NOT_READY, 0x04, 0x03) {
            return false;
        }
    }
    panic!("neither READY nor NOT READY: {}", status_text(dir));
}

fn cdb16(op: u8, flags: u8, lba: u64, blocks: u32) -> Vec<u8> {
    let mut c = vec![op, flags];
    c.extend_from_slice(&lba.to_be_bytes());
    c.extend_from_slice(&blocks.to_be_bytes());
    c.extend_from_slice(&[0, 0]);
    c
}

fn cdb10(op: u8, flags: u8, lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![op, flags];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&blocks.to_be_bytes());
    c.push(0);
    c
}

struct Case {
    name: &'static str,
    cdb: Vec<u8>,
    data_out: Vec<u8>,
    /// The status it must get on a restored LUN.
    good: bool,
    changes_medium: bool,
}

fn cases() -> Vec<Case> {
    let old = restored_pattern();
    let block = |b: u8| vec![b; BLOCK];
    let mut caw_match = old[..2 * BLOCK].to_vec();
    caw_match.extend_from_slice(&[0xc3; 2 * BLOCK]);
    let mut caw_miss = vec![0xee; 2 * BLOCK];
    caw_miss.extend_from_slice(&[0xc3; 2 * BLOCK]);
    let mut caw = cdb16(0x89, 0, LBA, 0);
    caw[13] = 2;
    vec![
        Case {
            name: "WRITE SAME (16) of a pattern",
            cdb: cdb16(0x93, 0, LBA, 8),
            data_out: block(0xa5),
            good: true,
            changes_medium: true,
        },
        Case {
            name: "WRITE SAME (16) of zeros (how Linux zeroes a range)",
            cdb: cdb16(0x93, 0, LBA, 8),
            data_out: block(0),
            good: true,
            changes_medium: true,
        },
        Case {
            name: "WRITE SAME (16) with NDOB",
            cdb: cdb16(0x93, 0x01, LBA, 8),
            data_out: Vec::new(),
            good: true,
            changes_medium: true,
        },
        Case {
            name: "WRITE SAME (10)",
            cdb: cdb10(0x41, 0, LBA as u32, 4),
            data_out: block(0x5a),
            good: true,
            changes_medium: true,
        },
        Case {
            name: "COMPARE AND WRITE that matches",
            cdb: caw.clone(),
            data_out: caw_match,
            good: true,
            changes_medium: true,
        },
        Case {
            name: "WRITE AND VERIFY (10)",
            cdb: cdb10(0x2e, 0x02, LBA as u32, 2),
            data_out: vec![0x3c; 2 * BLOCK],
            good: true,
            changes_medium: true,
        },
        Case {
            name: "WRITE AND VERIFY (16)",
            cdb: cdb16(0x8e, 0x02, LBA, 2),
            data_out: vec![0x3d; 2 * BLOCK],
            good: true,
            changes_medium: true,
        },
        // Controls: the same machinery, no change to the medium, so the
        // image must stay current and a crash must not cost it.
        Case {
            name: "COMPARE AND WRITE that miscompares",
            cdb: caw,
            data_out: caw_miss,
            good: false,
            changes_medium: false,
        },
        Case {
            name: "VERIFY (16) with BYTCHK",
            cdb: cdb16(0x8f, 0x02, LBA, 2),
            data_out: old[..2 * BLOCK].to_vec(),
            good: true,
            changes_medium: false,
        },
        Case {
            name: "SYNCHRONIZE CACHE (10)",
            cdb: cdb10(0x35, 0, 0, 0),
            data_out: Vec::new(),
            good: true,
            changes_medium: false,
        },
    ]
}

/// restore → command → kill -9 → restart: NOT READY exactly after the
/// commands that change the medium.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_medium_changing_command_opens_a_new_generation() {
    for (i, c) in cases().into_iter().enumerate() {
        let dir = scratch(&format!("cmd{i}"));
        let (t, s) = restored(&dir).await;
        let before = generation_in(&dir);
        let data = (!c.data_out.is_empty()).then_some(&c.data_out[..]);
        let r = s.command(0, &c.cdb, data, 0).await.expect(c.name);
        assert_eq!(r.is_good(), c.good, "{}: {r:?}", c.name);
        let after = generation_in(&dir);
        assert_eq!(
            before != after,
            c.changes_medium,
            "{}: the generation in luns.toml went from {before:?} to {after:?}",
            c.name
        );
        drop(s);
        assert_eq!(
            ready_after_a_crash(&dir, t).await,
            !c.changes_medium,
            "{}: after kill -9 the LUN must be {}; status: {}",
            c.name,
            if c.changes_medium {
                "NOT READY"
            } else {
                "READY"
            },
            status_text(&dir)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The first write after a restore meets a bump that cannot be made durable:
/// it gets NOT READY instead of GOOD, every later command too, `status`
/// names the reason, and luns.toml is unchanged.
async fn a_failed_bump_acknowledges_nothing(dir: &Path, t: TargetProcess, s: Session, why: &str) {
    let before = std::fs::read_to_string(dir.join("luns.toml")).expect("luns.toml");
    let r = s
        .command(0, &cdb10(0x2a, 0, LBA as u32, 1), Some(&[0x99; BLOCK]), 0)
        .await
        .expect("WRITE");
    assert_eq!(
        (r.status, sense(&r)),
        (status::CHECK_CONDITION, (sense_key::NOT_READY, 0x04, 0x03)),
        "{why}: the write must not be acknowledged"
    );
    let r = s.test_unit_ready(0).await.expect("TUR");
    assert_eq!(sense(&r), (sense_key::NOT_READY, 0x04, 0x03), "{why}");
    let r = s
        .command(0, &cdb10(0x28, 0, LBA as u32, 1), None, BLOCK as u32)
        .await
        .expect("READ");
    assert_eq!(
        sense(&r),
        (sense_key::NOT_READY, 0x04, 0x03),
        "{why}: no read"
    );
    let st = status_text(dir);
    assert!(
        st.contains("NOT READY") && st.contains("could not be made durable"),
        "{why}: {st}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("luns.toml")).expect("luns.toml"),
        before,
        "{why}: luns.toml is unchanged"
    );
    drop(s);
    drop(t);
}

/// The state file cannot be replaced: its temporary name is taken by a
/// directory, so creating it fails (EISDIR), for root as for anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bump_that_cannot_be_written_acknowledges_nothing() {
    let dir = scratch("eisdir");
    let (t, s) = restored(&dir).await;
    std::fs::create_dir(dir.join("luns.toml.tmp")).expect("mkdir luns.toml.tmp");
    a_failed_bump_acknowledges_nothing(&dir, t, s, "luns.toml.tmp is a directory").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The state directory's filesystem is full (ENOSPC on the write or the
/// fsync of luns.toml).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bump_into_a_full_filesystem_acknowledges_nothing() {
    let dir = scratch("full");
    let state = dir.join("state");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let _full = LoopFilesystem::mount(&dir.join("small.ext4"), &state, "2M", &["-N", "64"]);
    let images = dir.join("images");
    let image_dir = ["--image-dir", images.to_str().expect("utf-8 path")];
    let (t, s) = restored_with(&state, &image_dir).await;
    // Fill every free block, then every byte the last block leaves.
    {
        use std::io::Write;
        let mut f = std::fs::File::create(state.join("filler")).expect("filler");
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&[0]).is_ok() {}
        let _ = f.sync_all();
    }
    a_failed_bump_acknowledges_nothing(&state, t, s, "the state filesystem is full").await;
    drop(_full);
    let _ = std::fs::remove_dir_all(&dir);
}
