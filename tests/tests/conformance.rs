//! libiscsi `iscsi-test-cu` conformance run against a fresh `ramslog-target`.
//!
//! `cargo test -p ramslog-tests --test conformance -- --nocapture`
//!
//! Every suite of `iscsi-test-cu --list` runs in its own process (`-d -v -t FAMILY.Suite`), then
//! once more all together (`-t ALL`). Results are compared with the lists in
//! `tests/conformance/`: `not-applicable.txt`, `expected-failures.txt`, `deviations.txt` and
//! `skips.txt` (every test libiscsi skips), and the number of tests passing in every run with
//! `EXPECTED_PASSES` (see the README there).
//! Logs and `summary.json` / `summary.txt` go to `build/conformance/`.
//!
//! Environment:
//! - `RAMSLOG_CONFORMANCE_URL=iscsi://host:port/iqn/lun`: test that target instead of starting
//!   `ramslog-target` (useful to score peers such as tgt or LIO).
//! - `RAMSLOG_CONFORMANCE_MPATH_URL=...`: second URL for the MultipathIO tests (our own target
//!   gets a second portal and uses it by default).
//! - `RAMSLOG_CONFORMANCE_SUITES=Read10,iSCSIdatasn`: only these suites (and no `-t ALL` run).
//! - `RAMSLOG_CONFORMANCE_NO_ALL=1`: skip the `-t ALL` run.
//! - `RAMSLOG_CONFORMANCE_VERBOSE_SCSI=1`: add `-V` (explains failed asserts; note that some
//!   verbose-only lines then also say `[SKIPPED]`, e.g. "LUN too small. Skipping assert").
//! - `RAMSLOG_CONFORMANCE_EXTRA_ARGS="-S"`: more iscsi-test-cu options.
//! - `RAMSLOG_CONFORMANCE_SUITE_TIMEOUT` / `RAMSLOG_CONFORMANCE_ALL_TIMEOUT`: seconds
//!   (default 300 / 1800).
//!
//! A missing `iscsi-test-cu` fails the test (nothing would have been checked).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ramslog_tests::testcu::{self, Outcome, RunOutcome, Suite, TestResult};
use ramslog_tests::{artefact_dir, find_in_path, TargetOptions, TargetProcess};
use serde_json::json;

/// Suites whose tests can never be "not applicable": the foundation issue requires them
/// (PERSISTENT RESERVE, COMPARE AND WRITE, VERIFY with BYTCHK, WRITE SAME, TMF, residuals, DataSN).
const REQUIRED_SUITE_PREFIXES: &[&str] = &[
    "Prin",
    "Prout",
    "CompareAndWrite",
    "Verify",
    "WriteSame",
    "iSCSITMF",
    "iSCSIResiduals",
    "iSCSIdatasn",
];

/// The only assertions a test in deviations.txt may fail: libiscsi 1.19.0's
/// write residual tests demand GOOD with part of the blocks written (FCP-4
/// option a) and then look for those blocks. ramslog refuses such a write
/// whole (option b, LIO's `target_cmd_size_check`), which libiscsi upstream
/// accepts since its residual tests were rewritten (test_write_residuals.c).
/// Any other failed assertion of such a test is a real failure.
const DEVIATION_ASSERTS: &[&str] = &[
    "CU_ASSERT_EQUAL(task->status,SCSI_STATUS_GOOD)",
    "CU_FAIL(\"Block was not written correctly\")",
];

/// Tests that pass in every run against ramslog-target when every suite
/// runs: all of `--list` but the listed skips, deviations, not-applicable
/// and expected failures. Pinned so that a test leaving the passing set
/// (into a list, or a skip) is a reviewed change of this number.
const EXPECTED_PASSES: usize = 164;

const TARGET_NAME: &str = "iqn.2026-11.org.ramslog:conformance";

fn env_secs(name: &str, default: u64) -> Duration {
    let secs = match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number of seconds: {e}")),
        Err(_) => default,
    };
    Duration::from_secs(secs)
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// One line of not-applicable.txt / expected-failures.txt.
#[derive(Clone, Debug)]
struct Entry {
    pattern: String,
    reason: String,
    file: &'static str,
    line: usize,
}

impl Entry {
    fn matches(&self, key: &str) -> bool {
        match self.pattern.strip_suffix(".*") {
            Some(suite) => key.split_once('.').is_some_and(|(s, _)| s == suite),
            None => self.pattern == key,
        }
    }
    fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
    /// A skips.txt entry's skip message: the quoted text its reason starts
    /// with (what libiscsi prints after `[SKIPPED]`).
    fn skip_message(&self) -> Option<&str> {
        let rest = self.reason.strip_prefix('"')?;
        rest.split_once('"')
            .map(|(m, _)| m)
            .filter(|m| !m.is_empty())
    }
}

fn read_list(
    path: &Path,
    file: &'static str,
    need_reason: bool,
    problems: &mut Vec<String>,
) -> Vec<Entry> {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let (pattern, reason) = match line.split_once(char::is_whitespace) {
            Some((p, r)) => (p.to_string(), r.trim().to_string()),
            None => (line.to_string(), String::new()),
        };
        let e = Entry {
            pattern,
            reason,
            file,
            line: i + 1,
        };
        if !e.pattern.contains('.') {
            problems.push(format!("{}: {:?} is not Suite.Test", e.at(), e.pattern));
        }
        if need_reason && e.reason.is_empty() {
            problems.push(format!(
                "{}: {} has no reason (format: `Suite.Test  reason`)",
                e.at(),
                e.pattern
            ));
        }
        if !need_reason && e.pattern.ends_with(".*") {
            problems.push(format!(
                "{}: wildcards are not allowed in expected-failures.txt; list each test",
                e.at()
            ));
        }
        out.push(e);
    }
    out
}

/// One `iscsi-test-cu` process and the results it produced.
struct Run {
    name: String,
    outcome: RunOutcome,
    results: Vec<TestResult>,
}

/// Add a FAIL for every listed test of `suites` that the run did not report.
fn complete(results: &mut Vec<TestResult>, suites: &[&Suite], ro: &RunOutcome) {
    let seen: BTreeSet<String> = results.iter().map(TestResult::key).collect();
    let last: Vec<&str> = ro
        .log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let last = last[last.len().saturating_sub(3)..].join(" | ");
    for s in suites {
        for t in &s.tests {
            let key = format!("{}.{}", s.name, t);
            if !seen.contains(&key) {
                results.push(TestResult {
                    suite: s.name.clone(),
                    test: t.clone(),
                    outcome: Outcome::Fail,
                    messages: vec![format!(
                        "not reported: iscsi-test-cu {}; log ends with: {last}",
                        ro.describe()
                    )],
                });
            }
        }
    }
}

fn counts<'a>(it: impl Iterator<Item = &'a TestResult>) -> (usize, usize, usize) {
    it.fold((0, 0, 0), |(p, f, s), r| match r.outcome {
        Outcome::Pass => (p + 1, f, s),
        Outcome::Fail => (p, f + 1, s),
        Outcome::Skip => (p, f, s + 1),
    })
}

#[test]
fn iscsi_test_cu_conformance() {
    // Missing, nothing would be checked: a failure everywhere (the test
    // command, tests/run-all.sh, installs it).
    let Some(bin) = find_in_path("iscsi-test-cu") else {
        panic!(
            "iscsi-test-cu is not installed, so no conformance test ran: apt-get install \
             libiscsi-bin (tests/run-all.sh installs it)"
        );
    };

    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out_dir = artefact_dir("conformance");
    for entry in fs::read_dir(&out_dir)
        .expect("read build/conformance")
        .flatten()
    {
        let p = entry.path();
        if p.extension()
            .is_some_and(|e| e == "log" || e == "json" || e == "txt")
        {
            let _ = fs::remove_file(p);
        }
    }

    // What exists.
    let list = Command::new(&bin)
        .arg("--list")
        .output()
        .unwrap_or_else(|e| panic!("run {} --list: {e}", bin.display()));
    let list = String::from_utf8_lossy(&list.stdout).into_owned();
    let all_suites = testcu::parse_list(&list);
    assert!(
        !all_suites.is_empty(),
        "`iscsi-test-cu --list` printed no ALL.<Suite> lines:\n{list}"
    );
    let known: BTreeSet<String> = all_suites
        .iter()
        .flat_map(|s| s.tests.iter().map(move |t| format!("{}.{}", s.name, t)))
        .collect();

    // The committed lists.
    let mut problems: Vec<String> = Vec::new();
    let na = read_list(
        &manifest.join("conformance/not-applicable.txt"),
        "not-applicable.txt",
        true,
        &mut problems,
    );
    let ef = read_list(
        &manifest.join("conformance/expected-failures.txt"),
        "expected-failures.txt",
        false,
        &mut problems,
    );
    let dv = read_list(
        &manifest.join("conformance/deviations.txt"),
        "deviations.txt",
        true,
        &mut problems,
    );
    let sk = read_list(
        &manifest.join("conformance/skips.txt"),
        "skips.txt",
        true,
        &mut problems,
    );
    for e in &sk {
        if e.skip_message().is_none() {
            problems.push(format!(
                "{}: {} has no quoted skip message (format: `Suite.Test  \"libiscsi's skip \
                 message\"  reason`)",
                e.at(),
                e.pattern
            ));
        }
        if e.pattern.ends_with(".*") {
            problems.push(format!(
                "{}: wildcards are not allowed in skips.txt; list each test",
                e.at()
            ));
        }
        for f in na.iter().chain(ef.iter()).chain(dv.iter()) {
            if known.iter().any(|k| e.matches(k) && f.matches(k)) {
                problems.push(format!("{} and {} both list {}", e.at(), f.at(), e.pattern));
            }
        }
    }
    for e in &dv {
        if e.pattern.ends_with(".*") {
            problems.push(format!(
                "{}: wildcards are not allowed in deviations.txt; list each test",
                e.at()
            ));
        }
        for f in na.iter().chain(ef.iter()) {
            if known.iter().any(|k| e.matches(k) && f.matches(k)) {
                problems.push(format!("{} and {} both list {}", e.at(), f.at(), e.pattern));
            }
        }
    }
    for e in na.iter().chain(ef.iter()).chain(dv.iter()).chain(sk.iter()) {
        if !known.iter().any(|k| e.matches(k)) {
            problems.push(format!(
                "{}: {} matches no test of `iscsi-test-cu --list`",
                e.at(),
                e.pattern
            ));
        }
    }
    for e in &na {
        let suite = e.pattern.split('.').next().unwrap_or("");
        if REQUIRED_SUITE_PREFIXES.iter().any(|p| suite.starts_with(p)) {
            problems.push(format!(
                "{}: {} cannot be not-applicable: the foundation issue requires suite {suite} \
                 (put it in expected-failures.txt while it is being built)",
                e.at(),
                e.pattern
            ));
        }
        for f in &ef {
            if known.iter().any(|k| e.matches(k) && f.matches(k)) {
                problems.push(format!("{} and {} both list {}", e.at(), f.at(), f.pattern));
            }
        }
    }

    // Which suites.
    let only: Option<Vec<String>> = std::env::var("RAMSLOG_CONFORMANCE_SUITES").ok().map(|v| {
        v.split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    });
    if let Some(only) = &only {
        for s in only {
            assert!(
                all_suites.iter().any(|x| &x.name == s),
                "RAMSLOG_CONFORMANCE_SUITES names unknown suite {s:?}"
            );
        }
    }
    let selected: Vec<&Suite> = all_suites
        .iter()
        .filter(|s| match &only {
            None => true,
            Some(o) => o.contains(&s.name),
        })
        .collect();
    let run_all = only.is_none() && !env_flag("RAMSLOG_CONFORMANCE_NO_ALL");

    // The target.
    let external = std::env::var("RAMSLOG_CONFORMANCE_URL")
        .ok()
        .filter(|u| !u.is_empty());
    // A second portal on the same target gives MultipathIO a real second path.
    let second_port = ramslog_tests::free_port();
    let start_target = || {
        TargetProcess::start_with(TargetOptions {
            target_name: TARGET_NAME.to_string(),
            extra_args: vec!["--listen".into(), format!("127.0.0.1:{second_port}")],
            ..TargetOptions::default()
        })
    };
    let mut target = match &external {
        Some(_) => None,
        None => Some(start_target()),
    };
    let url_of = |t: &Option<TargetProcess>| match t {
        Some(t) => t.url(0),
        None => external.clone().expect("external URL"),
    };
    let mut crashes: Vec<String> = Vec::new();

    let mut base_args: Vec<String> = vec!["-d".into(), "-v".into()];
    if env_flag("RAMSLOG_CONFORMANCE_VERBOSE_SCSI") {
        base_args.push("-V".into());
    }
    if let Ok(extra) = std::env::var("RAMSLOG_CONFORMANCE_EXTRA_ARGS") {
        base_args.extend(extra.split_whitespace().map(String::from));
    }
    let mpath = std::env::var("RAMSLOG_CONFORMANCE_MPATH_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(|| {
            external
                .is_none()
                .then(|| format!("iscsi://127.0.0.1:{second_port}/{TARGET_NAME}/0"))
        });
    let suite_timeout = env_secs("RAMSLOG_CONFORMANCE_SUITE_TIMEOUT", 300);
    let all_timeout = env_secs("RAMSLOG_CONFORMANCE_ALL_TIMEOUT", 1800);

    let mut jobs: Vec<(String, String, Vec<&Suite>, Duration)> = selected
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                format!("{}.{}", s.family(), s.name),
                vec![*s],
                suite_timeout,
            )
        })
        .collect();
    if run_all {
        jobs.push((
            "ALL".to_string(),
            "ALL".to_string(),
            all_suites.iter().collect(),
            all_timeout,
        ));
    }

    let mut runs: Vec<Run> = Vec::new();
    for (name, spec, suites, timeout) in jobs {
        let url = url_of(&target);
        let mut args = base_args.clone();
        args.push("-t".into());
        args.push(spec);
        args.push(url.clone());
        args.extend(mpath.clone());
        let log_path = out_dir.join(format!("{name}.log"));
        let ro = testcu::run_logged(&bin, &args, &log_path, timeout);
        let mut results: Vec<TestResult> = testcu::parse_log(&ro.log)
            .into_iter()
            .filter(|r| suites.iter().any(|s| s.name == r.suite))
            .collect();
        complete(&mut results, &suites, &ro);
        let (p, f, s) = counts(results.iter());
        eprintln!(
            "conformance: {name:<26} PASS {p:>3} FAIL {f:>3} SKIP {s:>3}  ({}{})",
            ro.describe(),
            if ro.abnormal() { ", ABNORMAL" } else { "" }
        );
        if let Some(t) = target.as_mut() {
            if !t.is_running() {
                crashes.push(format!(
                    "ramslog-target died during run {name} ({:?}); log {}; last lines:\n{}",
                    t.try_exit_status(),
                    t.log_path().display(),
                    t.output_tail(40)
                ));
                target = Some(start_target());
            }
        }
        runs.push(Run {
            name,
            outcome: ro,
            results,
        });
    }
    if let Some(t) = target.as_mut() {
        let status = t.stop();
        eprintln!(
            "conformance: ramslog-target stopped ({status}); its log: {}",
            t.log_path().display()
        );
    }

    // Aggregate per test, in --list order.
    let mut order: Vec<String> = Vec::new();
    let mut per_test: BTreeMap<String, Vec<(&str, &TestResult)>> = BTreeMap::new();
    for run in &runs {
        for r in &run.results {
            let key = r.key();
            if !per_test.contains_key(&key) {
                order.push(key.clone());
            }
            per_test.entry(key).or_default().push((&run.name, r));
        }
    }
    let pos: BTreeMap<String, usize> = all_suites
        .iter()
        .flat_map(|s| s.tests.iter().map(move |t| format!("{}.{}", s.name, t)))
        .enumerate()
        .map(|(i, k)| (k, i))
        .collect();
    order.sort_by_key(|k| pos.get(k.as_str()).copied().unwrap_or(usize::MAX));

    let mut unexpected: Vec<String> = Vec::new();
    let mut expected_failing: Vec<String> = Vec::new();
    let mut unexpectedly_passed: Vec<String> = Vec::new();
    let mut na_results: Vec<String> = Vec::new();
    let mut deviations: Vec<String> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut passed: Vec<String> = Vec::new();
    let mut tests_json = Vec::new();
    for key in &order {
        let rs = &per_test[key];
        let na_entry = na.iter().find(|e| e.matches(key));
        let ef_entry = ef.iter().find(|e| e.matches(key));
        let dv_entry = dv.iter().find(|e| e.matches(key));
        let sk_entry = sk.iter().find(|e| e.matches(key));
        let skipping: Vec<&str> = rs
            .iter()
            .filter(|(_, r)| r.outcome == Outcome::Skip)
            .map(|(run, _)| *run)
            .collect();
        let failing: Vec<&(&str, &TestResult)> = rs
            .iter()
            .filter(|(_, r)| r.outcome == Outcome::Fail)
            .collect();
        let all_pass = rs.iter().all(|(_, r)| r.outcome == Outcome::Pass);
        let describe_fail = || {
            failing
                .iter()
                .map(|(run, r)| {
                    let msg = r.messages.join("; ");
                    let msg: String = msg.chars().take(300).collect();
                    format!("[{run}] {msg}")
                })
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let class = if let Some(e) = dv_entry {
            // A deliberate deviation fails in every run, and only where
            // the rule it names says so.
            let off_rule: Vec<String> = rs
                .iter()
                .flat_map(|(run, r)| {
                    r.messages
                        .iter()
                        .filter(|m| !DEVIATION_ASSERTS.iter().any(|a| m.contains(a)))
                        .map(move |m| format!("[{run}] {m}"))
                })
                .collect();
            if failing.len() != rs.len() {
                unexpected.push(format!(
                    "{key}: passed, but deviations.txt says it must fail ({}): the target \
                     no longer follows that rule",
                    e.reason
                ));
                "deviation-passed"
            } else if !off_rule.is_empty() {
                unexpected.push(format!(
                    "{key}: fails beyond its deviation ({}): {}",
                    e.reason,
                    off_rule.join("; ")
                ));
                "unexpected-failure"
            } else {
                deviations.push(format!("{key}: {}", e.reason));
                "deviation"
            }
        } else if !failing.is_empty() {
            if let Some(e) = na_entry {
                na_results.push(format!("{key}: FAIL (not applicable: {})", e.reason));
                "not-applicable"
            } else if ef_entry.is_some() {
                expected_failing.push(format!("{key}: {}", describe_fail()));
                "expected-failure"
            } else {
                unexpected.push(format!("{key}: {}", describe_fail()));
                "unexpected-failure"
            }
        } else if ef_entry.is_some() && all_pass {
            unexpectedly_passed.push(format!(
                "{key} ({}): unexpectedly passed: remove it from expected-failures.txt",
                ef_entry.map(Entry::at).unwrap_or_default()
            ));
            "unexpectedly-passed"
        } else if let Some(e) = na_entry {
            let outcomes: Vec<String> = rs.iter().map(|(_, r)| r.outcome.to_string()).collect();
            na_results.push(format!(
                "{key}: {} (not applicable: {})",
                outcomes.join("/"),
                e.reason
            ));
            "not-applicable"
        } else if let Some(e) = sk_entry {
            // libiscsi passes a test it skips: a listed skip must skip in
            // every run, or the list no longer says what ran, and for the
            // reason listed (its message), or it is another skip.
            let expected = e.skip_message().unwrap_or_default();
            let other_reason: Vec<String> = rs
                .iter()
                .filter(|(_, r)| {
                    r.outcome == Outcome::Skip && !r.messages.iter().any(|m| m.contains(expected))
                })
                .map(|(run, r)| format!("[{run}] {}", r.messages.join("; ")))
                .collect();
            if skipping.len() == rs.len() && other_reason.is_empty() {
                "skip"
            } else if skipping.len() == rs.len() {
                unexpected.push(format!(
                    "{key} ({}): skipped, but not with the listed message \"{expected}\": {}",
                    e.at(),
                    other_reason.join(" / ")
                ));
                "skip-other-reason"
            } else {
                let ran: Vec<&str> = rs
                    .iter()
                    .filter(|(_, r)| r.outcome != Outcome::Skip)
                    .map(|(run, _)| *run)
                    .collect();
                unexpected.push(format!(
                    "{key} ({}): listed as skipped ({}), but it ran and passed in {}: remove it \
                     from skips.txt",
                    e.at(),
                    e.reason,
                    ran.join(", ")
                ));
                "skip-ran"
            }
        } else if !skipping.is_empty() {
            // INVALID OPERATION CODE (or any answer libiscsi reads as "not
            // supported") turns a test into a pass marked SKIPPED: one that
            // is not listed is a regression until shown otherwise.
            let why: Vec<String> = rs
                .iter()
                .filter(|(_, r)| r.outcome == Outcome::Skip)
                .map(|(run, r)| format!("[{run}] {}", r.messages.join("; ")))
                .collect();
            unexpected.push(format!(
                "{key}: skipped, and not in skips.txt (a command that stopped working reads \
                 as a skip): {}",
                why.join(" / ")
            ));
            "unexpected-skip"
        } else {
            "ok"
        };
        if class == "ok" {
            passed.push(key.clone());
        }
        for (run, r) in rs {
            if r.outcome == Outcome::Skip && (*run != "ALL" || rs.len() == 1) {
                skipped.push(format!("{key}: {}", r.messages.join("; ")));
            }
        }
        let results: serde_json::Map<String, serde_json::Value> = rs
            .iter()
            .map(|(run, r)| {
                (
                    run.to_string(),
                    json!({"outcome": r.outcome.to_string(), "messages": r.messages}),
                )
            })
            .collect();
        tests_json.push(json!({"test": key, "class": class, "runs": results}));
    }

    if only.is_none() && external.is_none() && passed.len() != EXPECTED_PASSES {
        unexpected.push(format!(
            "{} tests passed in every run, EXPECTED_PASSES in conformance.rs says {EXPECTED_PASSES}",
            passed.len()
        ));
    }

    // Summary text.
    let mut txt = String::new();
    let target_desc = match &external {
        Some(u) => format!("external target {u}"),
        None => "fresh ramslog-target (ephemeral, 256M)".to_string(),
    };
    let _ = writeln!(txt, "iscsi-test-cu conformance against {target_desc}");
    let _ = writeln!(
        txt,
        "\n{:<26} {:>4} {:>4} {:>4}   {:>4} {:>4} {:>4}",
        "suite (own process | -t ALL)", "PASS", "FAIL", "SKIP", "PASS", "FAIL", "SKIP"
    );
    let all_run = runs.iter().find(|r| r.name == "ALL");
    let mut tot = [0usize; 6];
    for s in &selected {
        let own = runs.iter().find(|r| r.name == s.name);
        let (p, f, k) = own.map(|r| counts(r.results.iter())).unwrap_or_default();
        let (ap, af, ak) = all_run
            .map(|r| counts(r.results.iter().filter(|t| t.suite == s.name)))
            .unwrap_or_default();
        for (i, v) in [p, f, k, ap, af, ak].into_iter().enumerate() {
            tot[i] += v;
        }
        let flag = if own.is_some_and(|r| r.outcome.abnormal()) {
            "  (process crashed/timed out)"
        } else {
            ""
        };
        let _ = writeln!(
            txt,
            "{:<26} {p:>4} {f:>4} {k:>4}   {ap:>4} {af:>4} {ak:>4}{flag}",
            s.name
        );
    }
    let _ = writeln!(
        txt,
        "{:<26} {:>4} {:>4} {:>4}   {:>4} {:>4} {:>4}",
        "TOTAL", tot[0], tot[1], tot[2], tot[3], tot[4], tot[5]
    );
    if let Some(a) = all_run {
        let _ = writeln!(txt, "-t ALL run: {}", a.outcome.describe());
    }
    let _ = writeln!(
        txt,
        "passed in every run: {} of {} tests (pinned: {EXPECTED_PASSES})",
        passed.len(),
        order.len()
    );
    let section = |txt: &mut String, title: &str, items: &[String]| {
        let _ = writeln!(txt, "\n{title} ({}):", items.len());
        for i in items {
            let _ = writeln!(txt, "  {i}");
        }
    };
    section(&mut txt, "UNEXPECTED FAILURES", &unexpected);
    section(&mut txt, "UNEXPECTEDLY PASSED", &unexpectedly_passed);
    section(
        &mut txt,
        "expected failures (still failing)",
        &expected_failing,
    );
    section(
        &mut txt,
        "deliberate deviations (failing as listed)",
        &deviations,
    );
    section(&mut txt, "not applicable", &na_results);
    section(&mut txt, "skipped", &skipped);
    section(&mut txt, "list problems", &problems);
    section(&mut txt, "target crashes", &crashes);
    let _ = writeln!(txt, "\nlogs: {}", out_dir.display());
    println!("{txt}");
    fs::write(out_dir.join("summary.txt"), &txt).expect("write summary.txt");

    let runs_json: Vec<_> = runs
        .iter()
        .map(|r| {
            let (p, f, s) = counts(r.results.iter());
            json!({
                "name": r.name,
                "log": r.outcome.log_path.display().to_string(),
                "exit": r.outcome.status.map(|s| s.to_string()),
                "timed_out": r.outcome.timed_out,
                "elapsed_s": r.outcome.elapsed.as_secs_f64(),
                "pass": p, "fail": f, "skip": s,
            })
        })
        .collect();
    let summary = json!({
        "target": target_desc,
        "runs": runs_json,
        "totals_per_suite_runs": {"pass": tot[0], "fail": tot[1], "skip": tot[2]},
        "totals_all_run": {"pass": tot[3], "fail": tot[4], "skip": tot[5]},
        "unexpected_failures": unexpected,
        "unexpectedly_passed": unexpectedly_passed,
        "expected_failures": expected_failing,
        "not_applicable": na_results,
        "deviations": deviations,
        "skipped": skipped,
        "passed_every_run": passed.len(),
        "list_problems": problems,
        "target_crashes": crashes,
        "tests": tests_json,
    });
    fs::write(
        out_dir.join("summary.json"),
        serde_json::to_string_pretty(&summary).expect("serialize summary"),
    )
    .expect("write summary.json");

    let mut verdict = Vec::new();
    if !unexpected.is_empty() {
        verdict.push(format!(
            "{} unexpected failure(s) or skip(s) (fix them, or list them in tests/conformance/\
             expected-failures.txt / not-applicable.txt / skips.txt)",
            unexpected.len()
        ));
    }
    if !unexpectedly_passed.is_empty() {
        verdict.push(format!(
            "{} test(s) unexpectedly passed: remove them from expected-failures.txt",
            unexpectedly_passed.len()
        ));
    }
    if !problems.is_empty() {
        verdict.push(format!("{} problem(s) in the list files", problems.len()));
    }
    if !crashes.is_empty() {
        verdict.push(format!("ramslog-target crashed {} time(s)", crashes.len()));
    }
    let mut why = String::new();
    section(&mut why, "UNEXPECTED FAILURES", &unexpected);
    section(&mut why, "UNEXPECTEDLY PASSED", &unexpectedly_passed);
    section(&mut why, "list problems", &problems);
    section(&mut why, "target crashes", &crashes);
    assert!(
        verdict.is_empty(),
        "conformance failed: {}\nfull table, skips and logs: {}/summary.txt\n{why}",
        verdict.join("; "),
        out_dir.display()
    );
}
