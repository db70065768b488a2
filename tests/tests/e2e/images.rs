//! Images that must never be loaded: each is refused, the LUN answers NOT
//! READY under its old identity, and `status` says why. And dumps that fail
//! (disk full, an unwritable directory) leave the generation unclean and
//! the daemon exits non-zero.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use ramslog_tests::{find_in_path, target_binary, TargetOptions, TargetProcess};

use super::*;

const CHUNK: u64 = 1 << 20;
const BLOCK: u64 = 4096;
/// One chunk's record in the image: its 4 KiB prefix and its data.
const RECORD: u64 = BLOCK + CHUNK;
/// Chunks the golden image holds, in the order they are written.
const CHUNKS: [u64; 3] = [0, 5, 9];

fn scratch(name: &str) -> PathBuf {
    scratch_dir("img", name)
}

/// `--size` in `extra` replaces the harness's size.
fn options(state_dir: &Path, extra: &[&str]) -> TargetOptions {
    let mut o = persistent(state_dir, None, &[]);
    let mut args = extra.iter();
    while let Some(a) = args.next() {
        match (*a, args.clone().next()) {
            ("--size", Some(v)) => {
                o.size = v.to_string();
                args.next();
            }
            _ => o.extra_args.push(a.to_string()),
        }
    }
    o
}

/// A state directory whose LUN was written (three chunks) and cleanly
/// stopped: its one image.
async fn golden(dir: &Path) -> PathBuf {
    let mut t = TargetProcess::start_with(options(dir, &[]));
    let s = open(&t, INITIATOR).await;
    for c in CHUNKS {
        s.write(0, c * CHUNK / 512, &vec![c as u8 + 1; CHUNK as usize], true)
            .await
            .expect("WRITE");
    }
    drop(s);
    assert!(t.stop().success(), "{}", t.output_tail(20));
    image_of(dir)
}

fn image_of(dir: &Path) -> PathBuf {
    let mut imgs: Vec<PathBuf> = std::fs::read_dir(dir.join("images"))
        .expect("image dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    assert_eq!(imgs.len(), 1, "one image: {imgs:?}");
    imgs.remove(0)
}

fn copy_dir(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(st.success());
}

fn flip_bit(path: &Path, offset: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open image");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).expect("read");
    b[0] ^= 0x10;
    f.write_all_at(&b, offset).expect("write");
}

fn record(path: &Path, i: u64) -> Vec<u8> {
    let f = std::fs::File::open(path).expect("open image");
    let mut v = vec![0u8; RECORD as usize];
    f.read_exact_at(&mut v, BLOCK + i * RECORD)
        .expect("read record");
    v
}

fn put_record(path: &Path, i: u64, data: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open image");
    f.write_all_at(data, BLOCK + i * RECORD)
        .expect("write record");
}

/// Rewrite a little-endian u64 of the header and seal it again, so only the
/// field itself is wrong.
fn set_header_u64(path: &Path, at: u64, value: u64) {
    set_header_bytes(path, at, &value.to_le_bytes());
}

/// Overwrite header bytes at `at` (a text field: same length) and seal the
/// header again, so only the field itself is wrong.
fn set_header_bytes(path: &Path, at: u64, bytes: &[u8]) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open image");
    let mut h = vec![0u8; BLOCK as usize];
    f.read_exact_at(&mut h, 0).expect("read header");
    h[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    let crc = crc32c::crc32c(&h[..BLOCK as usize - 4]);
    h[BLOCK as usize - 4..].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&h, 0).expect("write header");
}

fn edit_state(dir: &Path, edit: impl Fn(String) -> String) {
    let p = dir.join("luns.toml");
    let s = std::fs::read_to_string(&p).expect("luns.toml");
    std::fs::write(&p, edit(s)).expect("write luns.toml");
}

fn state_field(dir: &Path, key: &str) -> String {
    let s = std::fs::read_to_string(dir.join("luns.toml")).expect("luns.toml");
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("{key} in {s}"))
        .trim_matches('"')
        .to_string()
}

/// Start on `dir` (with `extra` arguments), expect NOT READY with `why` in
/// the status, and nothing of the image in memory after accept-empty.
async fn refused(dir: &Path, extra: &[&str], why: &str) {
    let failed_stop =
        std::fs::read_to_string(dir.join("luns.toml")).is_ok_and(|s| s.contains("failed_stop"));
    let t = TargetProcess::start_with(options(dir, extra));
    if failed_stop {
        let st = status_text(dir);
        assert!(
            st.contains("last stop: its dump failed at unix time"),
            "status names the failed stop: {st}"
        );
        assert!(
            t.output().contains("the last stop's dump failed"),
            "{}",
            t.output_tail(10)
        );
    }
    let s = Session::login(t.addr(), LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("login");
    let mut not_ready = false;
    for _ in 0..4 {
        let r = s.test_unit_ready(0).await.expect("TUR");
        if r.status == 2 && sense(&r) == (2, 0x04, 0x03) {
            not_ready = true;
            break;
        }
    }
    let st = status_text(dir);
    assert!(not_ready, "{why}: the LUN must be NOT READY; status: {st}");
    assert!(
        st.contains("NOT READY") && st.contains(why),
        "status should say {why:?}: {st}\n{}",
        t.output_tail(10)
    );
    // A refused restore may have loaded chunks before it found the damage
    // (chunk 0 before a bad chunk 5): none of them may be readable once the
    // admin accepts the empty device.
    let out = cli(&["accept-empty", t.target_name(), "0"], dir);
    assert!(out.status.success(), "{why}: accept-empty: {out:?}");
    clear_unit_attentions(&s).await;
    for c in CHUNKS {
        let got = s
            .read(0, c * CHUNK / 512, (CHUNK / 512) as u32, 512)
            .await
            .expect("READ");
        assert!(
            got.iter().all(|&b| b == 0),
            "{why}: chunk {c} of the refused image is readable after accept-empty"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_or_foreign_images_are_never_loaded() {
    let base = scratch("golden");
    let img = golden(&base).await;
    let name = img.file_name().expect("name").to_owned();
    let len = std::fs::metadata(&img).expect("stat").len();
    assert_eq!(len, 2 * BLOCK + CHUNKS.len() as u64 * RECORD);
    let generation: u64 = state_field(&base, "generation")
        .parse()
        .expect("generation");
    let naa = state_field(&base, "naa");

    type Mutation = Box<dyn Fn(&Path, &Path)>;
    let cases: Vec<(&str, Mutation, &[&str], &str)> = vec![
        (
            "trunc-mid-chunk",
            Box::new(|_, i| {
                OpenOptions::new()
                    .write(true)
                    .open(i)
                    .unwrap()
                    .set_len(BLOCK + RECORD + 1000)
                    .unwrap()
            }),
            &[],
            "truncated",
        ),
        (
            "trunc-at-chunk",
            Box::new(|_, i| {
                OpenOptions::new()
                    .write(true)
                    .open(i)
                    .unwrap()
                    .set_len(BLOCK + 2 * RECORD)
                    .unwrap()
            }),
            &[],
            "truncated",
        ),
        (
            "trunc-before-commit",
            Box::new(|_, i| {
                OpenOptions::new()
                    .write(true)
                    .open(i)
                    .unwrap()
                    .set_len(BLOCK + 3 * RECORD)
                    .unwrap()
            }),
            &[],
            "truncated",
        ),
        (
            "flip-header",
            Box::new(|_, i| flip_bit(i, 20)),
            &[],
            "header",
        ),
        (
            "flip-chunk-data",
            Box::new(|_, i| flip_bit(i, BLOCK + RECORD + BLOCK + 777)),
            &[],
            "checksum",
        ),
        (
            "flip-chunk-prefix",
            Box::new(|_, i| flip_bit(i, BLOCK + 9)),
            &[],
            "chunk",
        ),
        (
            "flip-commit",
            Box::new(move |_, i| flip_bit(i, len - BLOCK + 17)),
            &[],
            "commit record",
        ),
        (
            "swapped",
            Box::new(|_, i| {
                let (a, b) = (record(i, 0), record(i, 1));
                put_record(i, 0, &b);
                put_record(i, 1, &a);
            }),
            &[],
            "out of order",
        ),
        (
            "duplicated",
            Box::new(|_, i| put_record(i, 1, &record(i, 0))),
            &[],
            "out of order or repeated",
        ),
        (
            "trailing-bytes",
            Box::new(move |_, i| {
                let f = OpenOptions::new().append(true).open(i).unwrap();
                f.write_all_at(&[0u8; 4096], len).unwrap();
            }),
            &[],
            "records end",
        ),
        (
            "other-lun",
            Box::new(|_, i| set_header_u64(i, 48, 1)),
            &[],
            "LUN 1",
        ),
        (
            // The header's target name (after the 64-byte serial field at
            // 74 and its length): one letter of "iqn" changed.
            "other-target-name",
            Box::new(|_, i| set_header_bytes(i, 74 + 64 + 2, b"IQN")),
            &[],
            "it is IQN.2026-11.org.ramslog:test LUN 0",
        ),
        (
            // The header's serial: its first character changed.
            "other-serial",
            Box::new(|_, i| {
                let f = std::fs::File::open(i).unwrap();
                let mut c = [0u8; 1];
                f.read_exact_at(&mut c, 74).unwrap();
                set_header_bytes(i, 74, &[if c[0] == b'0' { b'1' } else { b'0' }]);
            }),
            &[],
            "its identity is naa.",
        ),
        (
            "other-naa",
            Box::new(move |d, i| {
                let other = "3123456789abcdef";
                edit_state(d, |s| s.replace(&naa, other));
                let name = i
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .replace(&naa, other);
                std::fs::rename(i, i.with_file_name(name)).unwrap();
            }),
            &[],
            "identity is naa.",
        ),
        (
            "other-size",
            Box::new(|_, _| {}),
            &["--size", "128M"],
            "bytes of",
        ),
        (
            "other-block-size",
            Box::new(|_, _| {}),
            &["--block-size", "4096"],
            "4096-byte blocks",
        ),
        (
            "older-generation",
            Box::new(move |d, i| {
                let next = generation + 1;
                edit_state(d, |s| {
                    s.replace(
                        &format!("generation = {generation}"),
                        &format!("generation = {next}"),
                    )
                    .replace(&format!("clean = {generation}"), &format!("clean = {next}"))
                });
                let name = i
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .replace(&format!("-g{generation}."), &format!("-g{next}."));
                std::fs::rename(i, i.with_file_name(name)).unwrap();
            }),
            &[],
            "the state's is",
        ),
        (
            "unclean-generation",
            Box::new(move |d, _| {
                edit_state(d, |s| s.replace(&format!("clean = {generation}\n"), ""))
            }),
            &[],
            "no clean image",
        ),
        (
            "unreadable",
            Box::new(|_, i| {
                std::fs::remove_file(i).unwrap();
                std::fs::create_dir(i).unwrap();
            }),
            &[],
            "refused",
        ),
        (
            "missing",
            Box::new(|_, i| std::fs::remove_file(i).unwrap()),
            &[],
            "missing",
        ),
    ];
    for (case, mutate, extra, why) in cases {
        let dir = scratch(case);
        copy_dir(&base, &dir);
        let image = dir.join("images").join(&name);
        mutate(&dir, &image);
        refused(&dir, extra, why).await;
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// A dump into a filesystem too small for it fails, says so, exits non-zero
/// and leaves the generation unclean: the next start is NOT READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_into_a_full_filesystem_fails_cleanly() {
    let dir = scratch("full");
    let images = dir.join("images");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let full = LoopFilesystem::mount(&dir.join("small.ext4"), &images, "48M", &[]);
    let mut t = TargetProcess::start_with(options(&dir, &[]));
    let s = open(&t, INITIATOR).await;
    for c in 0..64u64 {
        s.write(0, c * CHUNK / 512, &vec![0x77; CHUNK as usize], false)
            .await
            .expect("WRITE");
    }
    drop(s);
    let st = t.stop();
    let log = t.output();
    assert_eq!(
        st.code(),
        Some(74),
        "a stop whose dump failed exits 74 (EX_IOERR, which the unit keeps from restarting): {log}"
    );
    assert!(log.contains("not enough space"), "{log}");
    let leftovers: Vec<_> = std::fs::read_dir(&images)
        .expect("list")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".img"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no partial image stays: {leftovers:?}"
    );
    refused(&dir, &[], "no clean image").await;
    // The state directory remembered the failed stop; the next start said
    // so, `status` said so, and the clean stop inside `refused` cleared it.
    let record = std::fs::read_to_string(dir.join("luns.toml")).expect("state");
    assert!(!record.contains("failed_stop"), "{record}");
    drop(full);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The image directory turns unwritable while the daemon runs (root without
/// CAP_DAC_OVERRIDE, as CI runs as root): the dump fails, the daemon exits
/// non-zero, the generation stays unclean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_into_an_unwritable_directory_fails_cleanly() {
    assert!(
        is_root(),
        "this test drops CAP_DAC_OVERRIDE from root: run it as root (CI does)"
    );
    assert!(
        find_in_path("setpriv").is_some(),
        "setpriv (util-linux) is needed"
    );
    let dir = scratch("unwritable");
    let mut t = TargetProcess::start_with(TargetOptions {
        wrapper: [
            "setpriv",
            "--inh-caps=-dac_override,-dac_read_search,-fowner",
            "--bounding-set=-dac_override,-dac_read_search,-fowner",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        ..options(&dir, &[])
    });
    let s = open(&t, INITIATOR).await;
    s.write(0, 0, &vec![0x33; CHUNK as usize], true)
        .await
        .expect("WRITE");
    drop(s);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("images"), std::fs::Permissions::from_mode(0o500))
        .expect("chmod");
    let st = t.stop();
    let log = t.output();
    assert_eq!(st.code(), Some(74), "a failed dump exits 74: {log}");
    assert!(
        log.contains("dump failed") && log.contains("Permission denied"),
        "{log}"
    );
    std::fs::set_permissions(dir.join("images"), std::fs::Permissions::from_mode(0o700))
        .expect("chmod");
    refused(&dir, &[], "no clean image").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A daemon with two targets, three LUNs, started on a config file.
struct ConfigDaemon {
    child: std::process::Child,
    addr: std::net::SocketAddr,
}

impl ConfigDaemon {
    const X: &'static str = "iqn.2026-11.org.ramslog:swap-x";
    const Y: &'static str = "iqn.2026-11.org.ramslog:swap-y";
    /// (target, LUN) of every volume, and the byte each is filled with.
    const VOLUMES: [(&'static str, u64, u8); 3] =
        [(Self::X, 0, 0x0a), (Self::X, 1, 0x1a), (Self::Y, 0, 0x2a)];

    fn start(dir: &Path, port: u16) -> ConfigDaemon {
        let cfg = dir.join("ramslog.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = [\"127.0.0.1:{port}\"]\n\
                 [[target]]\nname = \"{x}\"\n\
                 [[target.lun]]\nlun = 0\nsize = \"8M\"\n\
                 [[target.lun]]\nlun = 1\nsize = \"8M\"\n\
                 [[target]]\nname = \"{y}\"\n\
                 [[target.lun]]\nlun = 0\nsize = \"8M\"\n",
                x = Self::X,
                y = Self::Y
            ),
        )
        .expect("write config");
        let child = Command::new(target_binary())
            .arg("--config")
            .arg(&cfg)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start ramslog-target");
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        ConfigDaemon { child, addr }
    }

    async fn session(&self, target: &str) -> Session {
        Session::login(self.addr, LoginParams::normal(INITIATOR, target))
            .await
            .expect("login")
    }

    fn stop(mut self) {
        ramslog_tests::send_signal(self.child.id(), ramslog_tests::Signal::TERM);
        let st = self.child.wait().expect("wait");
        assert!(st.success(), "a clean stop: {st:?}");
    }
}

impl Drop for ConfigDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Images moved between the LUNs of one target and between two targets
/// (each file put under the name of another volume's current image): every
/// volume refuses what it finds and answers NOT READY, and none serves the
/// bytes of another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_swapped_between_luns_and_targets_are_refused() {
    let dir = scratch("swap");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let port = ramslog_tests::free_port();
    let d = ConfigDaemon::start(&dir, port);
    for (target, lun, fill) in ConfigDaemon::VOLUMES {
        let s = d.session(target).await;
        for _ in 0..8 {
            if s.test_unit_ready(lun).await.expect("TUR").is_good() {
                break;
            }
        }
        s.write(lun, 0, &vec![fill; CHUNK as usize], true)
            .await
            .expect("WRITE");
    }
    d.stop();
    let images = dir.join("state").join("images");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&images)
        .expect("images")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "one image per volume: {names:?}");
    // Rotate the contents: each name now holds the next volume's image.
    let held = names
        .iter()
        .map(|n| std::fs::read(n).expect("read"))
        .collect::<Vec<_>>();
    for (i, n) in names.iter().enumerate() {
        std::fs::write(n, &held[(i + 1) % held.len()]).expect("write");
    }

    let d = ConfigDaemon::start(&dir, port);
    for (target, lun, _) in ConfigDaemon::VOLUMES {
        let s = d.session(target).await;
        let mut not_ready = false;
        for _ in 0..4 {
            let r = s.test_unit_ready(lun).await.expect("TUR");
            if r.status == 2 && sense(&r) == (2, 0x04, 0x03) {
                not_ready = true;
                break;
            }
        }
        assert!(
            not_ready,
            "{target} LUN {lun} must be NOT READY with another volume's image"
        );
        let r = s
            .command(lun, &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0], None, 4096)
            .await
            .expect("READ");
        assert_eq!(sense(&r), (2, 0x04, 0x03), "{target} LUN {lun}: no READ");
    }
    let st = status_text(&dir.join("state"));
    assert_eq!(
        st.matches("NOT READY").count(),
        3,
        "every volume NOT READY: {st}"
    );
    assert!(
        st.contains(&format!("it is {} LUN 1", ConfigDaemon::X))
            && st.contains(&format!("it is {} LUN 0", ConfigDaemon::Y))
            && st.contains(&format!("it is {} LUN 0", ConfigDaemon::X)),
        "each names the volume the image belongs to: {st}"
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Start on `dir` and expect a refusal naming `needles`, before any portal.
fn start_refused(dir: &Path, needles: &[&str]) {
    let mut t = TargetProcess::spawn_with(options(dir, &[]));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(s) = t.try_exit_status() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "should have refused to start: {}",
            t.output_tail(20)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let out = t.output();
    assert_eq!(status.code(), Some(1), "a clean refusal: {out}");
    assert!(!out.contains("panicked"), "{out}");
    for n in needles {
        assert!(out.contains(n), "the refusal should say {n:?}: {out}");
    }
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The state and image directories hold the NAA, serial and generation an
/// image forger needs, and the content: the daemon keeps them to itself and
/// refuses to start on anything another user could have placed or changed
/// there, naming the fix. Each refusal leaves the files as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_and_image_directories_are_private() {
    let dir = scratch("private");
    let image = golden(&dir).await;
    let (state_file, images) = (dir.join("luns.toml"), dir.join("images"));
    assert_eq!(mode_of(&state_file), 0o600, "luns.toml shows the NAA");
    assert_eq!(mode_of(&dir), 0o700, "state directory");
    assert_eq!(mode_of(&images), 0o700, "image directory");
    assert_eq!(mode_of(&image), 0o600, "image");

    // Readable by others only: tightened at start, with nothing refused.
    chmod(&state_file, 0o644);
    chmod(&dir, 0o755);
    let mut t = TargetProcess::start_with(options(&dir, &[]));
    assert!(t.stop().success(), "{}", t.output_tail(20));
    assert_eq!(mode_of(&state_file), 0o600, "tightened at start");
    assert_eq!(mode_of(&dir), 0o700, "tightened at start");
    let state_before = std::fs::read(&state_file).expect("luns.toml");

    // Writable by others: refused, whoever may have changed what.
    for (path, mode) in [(&dir, 0o770), (&images, 0o777), (&state_file, 0o622)] {
        chmod(path, mode);
        start_refused(&dir, &["writable by group or others", "chmod go-w"]);
        assert_eq!(mode_of(path), mode, "a refusal changes nothing");
        chmod(path, if path.is_dir() { 0o700 } else { 0o600 });
    }

    // Owned by another user (root can hand a file to nobody).
    if is_root() {
        std::os::unix::fs::chown(&state_file, Some(65534), None).expect("chown");
        start_refused(&dir, &["owned by uid 65534", "chown"]);
        std::os::unix::fs::chown(&state_file, Some(0), None).expect("chown back");
    }

    // Links and FIFOs where the daemon expects its own files: an image that
    // is a link could load another file's bytes or let a dump overwrite it,
    // and a FIFO would hang the restore.
    let elsewhere = dir.join("elsewhere.img");
    std::fs::rename(&image, &elsewhere).expect("move the image");
    std::os::unix::fs::symlink(&elsewhere, &image).expect("symlink");
    start_refused(&dir, &["symbolic link", "remove it"]);
    std::fs::remove_file(&image).expect("rm link");
    let made = Command::new("mkfifo").arg(&image).status().expect("mkfifo");
    assert!(made.success(), "mkfifo {}", image.display());
    start_refused(&dir, &["FIFO", "remove it"]);
    std::fs::remove_file(&image).expect("rm fifo");
    std::fs::rename(&elsewhere, &image).expect("put the image back");
    assert_eq!(std::fs::read(&state_file).expect("luns.toml"), state_before);

    // And after all that the content is back.
    let t = TargetProcess::start_with(options(&dir, &[]));
    let s = open(&t, INITIATOR).await;
    clear_unit_attentions(&s).await;
    let got = s.read(0, 0, (CHUNK / 512) as u32, 512).await.expect("READ");
    assert!(got.iter().all(|&b| b == 1), "the image came back");
    drop(s);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
