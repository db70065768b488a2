//! The upgrade promise across this release: "install the new package, then
//! `systemctl reload`". From the binary of the commit the release started
//! from (built by tests/upgrade/base-binary.sh), a reload into this one
//! keeps every LUN READY from its kept memory, and a reload back either
//! keeps it too or is refused with a reason, the daemon serving on: never
//! state silently dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use ramslog_tests::fdstore::FdStoreSupervisor;
use ramslog_tests::{TargetOptions, TargetProcess, DEFAULT_TARGET_NAME};

use super::restart::restart_by;
use super::*;

/// The base commit's binary, built (or found in the cache) by the script.
fn base_binary() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("upgrade/base-binary.sh");
    let out = Command::new(&script).output().expect("run base-binary.sh");
    assert!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(path.is_file(), "no base binary at {}", path.display());
    path
}

/// Install `from` as `installed`, as a package does: a new file renamed
/// over the old one (the running daemon keeps its own).
fn install(from: &Path, installed: &Path) {
    let new = installed.with_extension("dpkg-new");
    std::fs::copy(from, &new).expect("copy the binary");
    std::fs::rename(&new, installed).expect("rename over the installed binary");
}

const LUNS: [u64; 2] = [0, 1];

/// Every LUN READY (past its unit attentions) and holding `data[lun]` at
/// LBA 16.
async fn assert_served(t: &TargetProcess, data: &[Vec<u8>], when: &str) {
    let s = open(t, INITIATOR).await;
    for lun in LUNS {
        assert!(
            lun_ready(&s, lun).await,
            "{when}: LUN {lun} not READY\n{}",
            t.output_tail(30)
        );
        let got = s.read(lun, 16, 8, 512).await.expect("READ");
        assert!(
            got == data[lun as usize],
            "{when}: LUN {lun} lost its content"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_from_the_base_binary_keeps_every_lun_ready_and_back() {
    let base = base_binary();
    let dir = scratch_dir("upgrade", "base");
    std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
    let installed = dir.join("bin/ramslog-target");
    install(&base, &installed);
    let state = dir.join("state");
    let config = dir.join("ramslog.toml");
    std::fs::write(
        &config,
        format!(
            "[[target]]\nname = \"{DEFAULT_TARGET_NAME}\"\n\
             [[target.lun]]\nlun = 0\nsize = \"16M\"\n\
             [[target.lun]]\nlun = 1\nsize = \"32M\"\n"
        ),
    )
    .expect("write config");
    let sup = FdStoreSupervisor::new(&dir.join("supervisor"));
    let (options, _passed) = sup.launch(TargetOptions {
        config: Some(config.clone()),
        binary: Some(installed.clone()),
        ..persistent(&state, None, &[])
    });
    let t = TargetProcess::start_with(options);
    let pid = t.pid();
    let mut data: Vec<Vec<u8>> = LUNS.iter().map(|_| random_bytes(4096)).collect();
    {
        let s = open(&t, INITIATOR).await;
        for lun in LUNS {
            clear_lun_attentions(&s, lun).await;
            s.write(lun, 16, &data[lun as usize], true)
                .await
                .expect("WRITE under the base binary");
        }
    }

    // The upgrade: the new package's binary, its ExecReload.
    install(&ramslog_tests::target_binary(), &installed);
    let logged = t.output().len();
    let said = restart_by(&ramslog_tests::target_binary(), &state).unwrap_or_else(|e| {
        panic!(
            "the reload into this release failed: {e}\n{}",
            t.output_tail(30)
        )
    });
    assert_eq!(t.pid(), pid, "a reload is an exec, not a new process");
    assert_served(&t, &data, "after the upgrade").await;
    let since = &t.output()[logged..];
    assert_eq!(
        since.matches("LUN content kept in memory").count(),
        LUNS.len(),
        "every LUN from its kept memory, none from an image: {said}\n{since}"
    );
    {
        let s = open(&t, INITIATOR).await;
        for lun in LUNS {
            clear_lun_attentions(&s, lun).await;
            data[lun as usize] = random_bytes(4096);
            s.write(lun, 16, &data[lun as usize], true)
                .await
                .expect("WRITE under this release");
        }
    }

    // And back: the old package's binary, its ExecReload.
    install(&base, &installed);
    let logged = t.output().len();
    match restart_by(&base, &state) {
        Ok(said) => {
            eprintln!("the downgrade went through: {said}");
            assert_served(&t, &data, "after the downgrade").await;
            let since = &t.output()[logged..];
            assert_eq!(
                since.matches("LUN content kept in memory").count(),
                LUNS.len(),
                "after the downgrade, every LUN from its kept memory\n{since}"
            );
        }
        Err(refused) => {
            eprintln!("the downgrade was refused: {refused}");
            // Refused: it must say why and what to do, and this release
            // serves on with every write.
            assert!(
                refused.contains("refused"),
                "a downgrade that failed without a refusal: {refused}"
            );
            assert_served(&t, &data, "after a refused downgrade").await;
        }
    }
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
