//! Golden outputs: what `status`, `status --json` and `/metrics` print for
//! a fixed configuration after a scripted sequence of I/O, a planned
//! restart and a crash, pinned byte for byte. Moving the code behind them
//! (one core under two front ends) must change nothing an operator, a
//! script or a scraper sees.
//!
//! Only what differs from run to run is masked before the comparison, each
//! by a rule in [`mask`] that names it: the LUN identities, the state
//! directory's path, ports and process ids, unix times, service times and
//! resident memory. The words around them, the labels, the counts and the
//! order are compared as printed.
//!
//! An intended difference is made on purpose: `RAMSLOG_BLESS=1` writes the
//! new outputs over `tests/tests/e2e/golden/`, and the commit says why.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use ramslog_initiator::{LoginParams, Session};
use ramslog_tests::{free_port, TargetOptions, TargetProcess};

use super::metrics::http_get;
use super::*;

const TARGET: &str = "iqn.2026-12.org.ramslog:golden";
/// A fixed ISID: the session line names it.
const ISID: [u8; 6] = [0x80, 0x12, 0x34, 0x56, 0x78, 0x9a];

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/golden")
}

/// `actual` (masked) against the file `name`, or written over it under
/// `RAMSLOG_BLESS=1`. On a difference, the first differing line.
fn compare(name: &str, actual: &str) -> Result<(), String> {
    let path = golden_dir().join(name);
    if std::env::var_os("RAMSLOG_BLESS").is_some() {
        std::fs::create_dir_all(golden_dir()).expect("golden directory");
        std::fs::write(&path, actual).expect("write a golden file");
        return Ok(());
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (RAMSLOG_BLESS=1 writes it)", path.display()));
    if expected == actual {
        return Ok(());
    }
    let (line, (want, got)) = expected
        .lines()
        .chain(std::iter::repeat("<end>"))
        .zip(actual.lines().chain(std::iter::repeat("<end>")))
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .unwrap_or((0, ("<same lines>", "<trailing newline differs>")));
    Err(format!(
        "{name} differs at line {}:\n  golden: {want}\n  now:    {got}\n--- now, whole:\n{actual}",
        line + 1
    ))
}

/// Every run of characters `part` accepts right after `marker`, replaced by
/// `with`.
fn mask_after(text: &str, marker: &str, part: fn(char) -> bool, with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(marker) {
        let after = i + marker.len();
        out.push_str(&rest[..after]);
        let tail = &rest[after..];
        let end = tail.find(|c: char| !part(c)).unwrap_or(tail.len());
        if end > 0 {
            out.push_str(with);
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn hex(c: char) -> bool {
    c.is_ascii_hexdigit()
}
fn uuid(c: char) -> bool {
    c.is_ascii_hexdigit() || c == '-'
}
fn digit(c: char) -> bool {
    c.is_ascii_digit()
}
fn number(c: char) -> bool {
    c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+')
}

/// A value that differs from run to run: the characters `part` accepts
/// right after `marker` become `with`.
type Mask = (&'static str, fn(char) -> bool, &'static str);

const MASKS: &[Mask] = &[
    // Process ids, and the random number each executed program draws.
    ("process ", digit, "<pid>"),
    ("\"pid\": ", digit, "<pid>"),
    ("\"incarnation\": ", digit, "<incarnation>"),
    // The LUN identities (each start of a fresh state directory draws new
    // ones), also in image file names.
    ("naa.", hex, "<naa>"),
    ("\"naa\": \"", hex, "<naa>"),
    ("images/", hex, "<naa>"),
    ("serial ", uuid, "<serial>"),
    ("\"serial\": \"", uuid, "<serial>"),
    // Ports the kernel picks (the initiator's source port, the listeners').
    ("127.0.0.1:", digit, "<port>"),
    // Times: when memory was taken over, how long commands took.
    ("unix time ", digit, "<unix>"),
    ("\"restored_taken_unix\": ", digit, "<unix>"),
    ("≤", digit, "<µs>"),
    ("\"service_time_sum_seconds\": ", number, "<time>"),
    ("\"service_time_p50_micros_at_most\": ", number, "<time>"),
    ("\"service_time_p99_micros_at_most\": ", number, "<time>"),
    // Resident memory moves with the allocator.
    ("resident ", digit, "<bytes>"),
    ("\"resident_bytes\": ", digit, "<bytes>"),
];

/// What differs from run to run, masked; `state` is this run's state
/// directory.
fn mask(text: &str, state: &Path) -> String {
    let mut t = text.replace(&state.display().to_string(), "<state-dir>");
    for (marker, part, with) in MASKS {
        t = mask_after(&t, marker, *part, with);
    }
    // In the exposition: service-time sums and finite buckets (the +Inf
    // bucket is the count, kept), resident memory.
    t.lines()
        .map(|l| {
            let volatile = l.starts_with("ramslog_lun_service_time_seconds_sum{")
                || (l.starts_with("ramslog_lun_service_time_seconds_bucket{")
                    && !l.contains("le=\"+Inf\""))
                || l.starts_with("ramslog_process_resident_memory_bytes ");
            match l.rsplit_once(' ') {
                Some((head, _)) if volatile => format!("{head} <masked>\n"),
                _ => format!("{l}\n"),
            }
        })
        .collect()
}

fn config(dir: &Path) -> PathBuf {
    let file = dir.join("golden.toml");
    std::fs::write(
        &file,
        format!(
            "[[target]]\nname = \"{TARGET}\"\n\n\
             [[target.lun]]\nlun = 0\nsize = \"8M\"\n\n\
             [[target.lun]]\nlun = 1\nsize = \"4M\"\nblock_size = 4096\n"
        ),
    )
    .expect("write the configuration");
    file
}

fn start(config: &Path, state: &Path, port: u16, metrics: SocketAddr) -> TargetProcess {
    TargetProcess::start_with(TargetOptions {
        target_name: TARGET.into(),
        config: Some(config.into()),
        extra_args: vec![
            "--metrics".into(),
            metrics.to_string(),
            "--hugepages".into(),
            "off".into(),
        ],
        ..persistent(state, Some(port), &[])
    })
}

async fn login(t: &TargetProcess) -> Session {
    let mut p = LoginParams::normal(INITIATOR, TARGET);
    p.isid = Some(ISID);
    Session::login(t.addr(), p).await.expect("login")
}

/// `status`, `status --json` and `/metrics` now, masked, each against its
/// golden file `<step>.status.txt`, `.status.json`, `.metrics.txt`.
fn outputs(step: &str, state: &Path, metrics: SocketAddr) -> Vec<String> {
    let text = status_text(state);
    let json = String::from_utf8_lossy(&cli(&["status", "--json"], state).stdout).into_owned();
    let (head, page) = http_get(metrics, "/metrics");
    assert_eq!(head, "HTTP/1.1 200 OK", "{page}");
    [
        (format!("{step}.status.txt"), text),
        (format!("{step}.status.json"), json),
        (format!("{step}.metrics.txt"), page),
    ]
    .into_iter()
    .filter_map(|(name, out)| compare(&name, &mask(&out, state)).err())
    .collect()
}

/// The fixed sequence: one session's writes, flushes, reads, a READ past
/// the end and a registration on LUN 0, writes and a read on LUN 1 (4 KiB
/// blocks), a login to a target that does not exist; then a planned
/// restart; a write to LUN 0; then a kill -9 (no fd store: LUN 0's
/// content is lost, LUN 1's image is current) and a start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_print_what_they_printed() {
    let dir = scratch_dir("golden", "outputs");
    let state = dir.join("state");
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let config = config(&dir);
    let port = free_port();
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut t = start(&config, &state, port, metrics);

    let s = login(&t).await;
    clear_lun_attentions(&s, 0).await;
    clear_lun_attentions(&s, 1).await;
    let data = vec![0x5au8; 4096];
    for i in 0..16u64 {
        s.write(0, i * 8, &data, false).await.expect("WRITE");
    }
    for _ in 0..4 {
        s.sync_cache(0).await.expect("SYNCHRONIZE CACHE");
    }
    for i in 0..8u64 {
        s.read(0, i * 8, 8, 512).await.expect("READ");
    }
    let past_end = [0x28, 0, 0xff, 0xff, 0xff, 0xf0, 0, 0, 1, 0];
    let r = s
        .command(0, &past_end, None, 512)
        .await
        .expect("READ past the end");
    assert_eq!(sense(&r).0, sense_key::ILLEGAL_REQUEST);
    let (cdb, params) = ramslog_common::cdb::persistent_reserve_out(0, 0, 0xabc);
    let r = s
        .command(0, &cdb, Some(&params), 0)
        .await
        .expect("REGISTER");
    assert!(r.is_good(), "{r:?}");
    for i in 0..2u64 {
        s.write(1, i, &data, true).await.expect("WRITE, LUN 1");
    }
    s.read(1, 0, 1, 4096).await.expect("READ, LUN 1");
    let refused = Session::login(
        t.addr(),
        LoginParams::normal(INITIATOR, "iqn.2026-12.org.ramslog:no-such"),
    )
    .await;
    assert!(refused.is_err(), "a login to a target that does not exist");
    let mut differences = outputs("1-serving", &state, metrics);
    s.logout().await.expect("logout");

    restart::restart_by(&ramslog_tests::target_binary(), &state).expect("restart --wait");
    differences.extend(outputs("2-after-restart", &state, metrics));

    // A write opens a new generation of LUN 0: its image is stale from
    // then on, and the crash loses LUN 0 (NOT READY) while LUN 1 comes
    // back from its image.
    let s = login(&t).await;
    clear_lun_attentions(&s, 0).await;
    s.write(0, 0, &data, true)
        .await
        .expect("WRITE after the restart");
    s.logout().await.expect("logout");
    t.kill();
    let t2 = start(&config, &state, port, metrics);
    differences.extend(outputs("3-after-crash", &state, metrics));
    drop(t2);
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}
