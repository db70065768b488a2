//! Running libiscsi's `iscsi-test-cu` and parsing its verbose (`-v`) CUnit output.
//!
//! CUnit counts a skipped test as passed; libiscsi marks skips by printing `[SKIPPED]`. So a test
//! is FAIL if CUnit reported `FAILED`, SKIP if it printed `[SKIPPED]` and did not fail, PASS if
//! CUnit reported `passed`. A test without any verdict (process crashed or was killed mid-test)
//! is FAIL.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Verdict for one test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
        })
    }
}

/// One test's result as parsed from a log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestResult {
    pub suite: String,
    pub test: String,
    pub outcome: Outcome,
    /// `[FAILED]`/assert lines for failures, `[SKIPPED]` lines for skips (deduplicated).
    pub messages: Vec<String>,
}

impl TestResult {
    /// `Suite.Test`.
    pub fn key(&self) -> String {
        format!("{}.{}", self.suite, self.test)
    }
}

/// A suite and its tests, in `--list` order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suite {
    pub name: String,
    pub tests: Vec<String>,
}

impl Suite {
    /// The family to select it with: `iSCSI` for the iSCSI* suites, else `SCSI`.
    pub fn family(&self) -> &'static str {
        family_of(&self.name)
    }
}

/// `iSCSI` for suites named `iSCSI*`, else `SCSI` (as in the lab's run_testcu_per_suite.sh).
pub fn family_of(suite: &str) -> &'static str {
    if suite.starts_with("iSCSI") {
        "iSCSI"
    } else {
        "SCSI"
    }
}

/// Parse `iscsi-test-cu --list`: the `ALL.<Suite>` and `ALL.<Suite>.<Test>` lines.
pub fn parse_list(list: &str) -> Vec<Suite> {
    let mut suites: Vec<Suite> = Vec::new();
    for line in list.lines() {
        let Some(rest) = line.trim().strip_prefix("ALL.") else {
            continue;
        };
        match rest.split_once('.') {
            None => {
                if !suites.iter().any(|s| s.name == rest) {
                    suites.push(Suite {
                        name: rest.to_string(),
                        tests: Vec::new(),
                    });
                }
            }
            Some((suite, test)) => {
                let idx = match suites.iter().position(|s| s.name == suite) {
                    Some(i) => i,
                    None => {
                        suites.push(Suite {
                            name: suite.to_string(),
                            tests: Vec::new(),
                        });
                        suites.len() - 1
                    }
                };
                if !suites[idx].tests.iter().any(|t| t == test) {
                    suites[idx].tests.push(test.to_string());
                }
            }
        }
    }
    suites
}

struct Pending {
    suite: String,
    test: String,
    lines: Vec<String>,
}

impl Pending {
    fn finish(self) -> TestResult {
        // CUnit prints "\n  Test: NAME ..." then the test's own output, then "passed" or
        // "FAILED" (no newline) followed, for failures, by numbered assert lines. Anything else
        // after the verdict comes from suite cleanup or the next test's setup: ignore it.
        let mut verdict: Option<bool> = None; // Some(true) = passed
        let mut before: Vec<&str> = Vec::new();
        let mut asserts: Vec<&str> = Vec::new();
        for l in self.lines.iter().map(|l| l.trim()) {
            match verdict {
                None if l.starts_with("passed") => verdict = Some(true),
                None if l.starts_with("FAILED") => verdict = Some(false),
                None => before.push(l),
                Some(false) => {
                    let is_assert = l.split_once(". ").is_some_and(|(n, _)| {
                        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
                    });
                    if is_assert {
                        asserts.push(l);
                    }
                }
                Some(true) => {}
            }
        }
        let mut messages: Vec<String> = Vec::new();
        let mut push = |m: &str| {
            if !m.is_empty() && !messages.iter().any(|x| x == m) {
                messages.push(m.to_string());
            }
        };
        let skipped = before.iter().any(|l| l.contains("[SKIPPED]"));
        let outcome = match verdict {
            Some(true) if skipped => {
                for l in &before {
                    if let Some(i) = l.find("[SKIPPED]") {
                        push(l[i..].trim());
                    }
                }
                Outcome::Skip
            }
            Some(true) => Outcome::Pass,
            failed => {
                for l in &before {
                    if let Some(i) = l.find("[FAILED]") {
                        push(l[i..].trim());
                    }
                }
                for l in &asserts {
                    push(l);
                }
                if failed.is_none() {
                    push(
                        "test did not complete: no CUnit verdict in the output \
                         (process crashed, hung or was killed)",
                    );
                }
                Outcome::Fail
            }
        };
        TestResult {
            suite: self.suite,
            test: self.test,
            outcome,
            messages,
        }
    }
}

/// Parse the verbose output of one `iscsi-test-cu -v` run into per-test results.
pub fn parse_log(log: &str) -> Vec<TestResult> {
    let mut out = Vec::new();
    let mut suite = String::new();
    let mut cur: Option<Pending> = None;
    for line in log.lines() {
        if let Some(rest) = line.strip_prefix("Suite: ") {
            out.extend(cur.take().map(Pending::finish));
            suite = rest.trim().to_string();
            continue;
        }
        if let Some(rest) = line.strip_prefix("  Test: ") {
            out.extend(cur.take().map(Pending::finish));
            let (name, tail) = rest.split_once(" ...").unwrap_or((rest, ""));
            cur = Some(Pending {
                suite: suite.clone(),
                test: name.trim().to_string(),
                lines: vec![tail.to_string()],
            });
            continue;
        }
        if line.starts_with("Run Summary:") || line.starts_with("WARNING - Suite") {
            out.extend(cur.take().map(Pending::finish));
            continue;
        }
        if let Some(c) = cur.as_mut() {
            c.lines.push(line.to_string());
        }
    }
    out.extend(cur.take().map(Pending::finish));
    out
}

/// How one `iscsi-test-cu` process ended.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// Exit status; `None` if it was killed after the timeout.
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub elapsed: Duration,
    pub log_path: PathBuf,
    pub log: String,
}

impl RunOutcome {
    /// Human-readable description of how the process ended.
    pub fn describe(&self) -> String {
        match (self.timed_out, self.status) {
            (true, _) => format!("timed out after {:.0?} and was killed", self.elapsed),
            (false, Some(s)) => format!("exited with {s} after {:.1?}", self.elapsed),
            (false, None) => "ended in an unknown way".to_string(),
        }
    }

    /// True if the process crashed (signal) or timed out, as opposed to exiting normally
    /// (CUnit exits 0 or 1; startup failures exit 255).
    pub fn abnormal(&self) -> bool {
        self.timed_out || self.status.is_some_and(|s| s.code().is_none())
    }

    /// The last `n` lines of the log.
    pub fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Run `iscsi-test-cu ARGS`, stdout+stderr to `log_path` (line-buffered through `stdbuf` when
/// available so output survives a kill), killing it after `timeout`.
pub fn run_logged(bin: &Path, args: &[String], log_path: &Path, timeout: Duration) -> RunOutcome {
    let log =
        File::create(log_path).unwrap_or_else(|e| panic!("create {}: {e}", log_path.display()));
    let log2 = log.try_clone().expect("clone log handle");
    let mut cmd = match crate::find_in_path("stdbuf") {
        Some(stdbuf) => {
            let mut c = Command::new(stdbuf);
            c.arg("-oL").arg("-eL").arg(bin);
            c
        }
        None => Command::new(bin),
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2));
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait on iscsi-test-cu") {
            break Some(s);
        }
        if start.elapsed() >= timeout {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let elapsed = start.elapsed();
    let log = std::fs::read(log_path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    RunOutcome {
        status,
        timed_out,
        elapsed,
        log_path: log_path.to_path_buf(),
        log,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &[&str] = &[
        "",
        "     CUnit - A unit testing framework for C - Version 2.1-3",
        "Suite: Sanitize",
        "  Test: BlockErase ...    [SKIPPED] --allow-sanitize flag is not set. Skipping test.",
        "passed",
        "  Test: Reset ...passed",
        "Suite: iSCSIdatasn",
        "  Test: iSCSIDataSnInvalid ...FAILED",
        "    1. test_iscsi_datasn_invalid.c:98  - CU_ASSERT_NOT_EQUAL(ret,0)",
        "    2. test_iscsi_datasn_invalid.c:116  - CU_ASSERT_NOT_EQUAL(ret,0)",
        "  Test: Other ...    [FAILED] WRITE10 command failed with status 2",
        "    [SKIPPED] something",
        "FAILED",
        "    1. x.c:1  - CU_FAIL",
        "  Test: Noise ...passed    [FAILED] PRIN command: failed with sense.",
        "  Test: Crashed ...    [OK] something",
        "",
        "Run Summary:    Type  Total    Ran Passed Failed Inactive",
    ];

    #[test]
    fn parses_verdicts() {
        let r = parse_log(&LOG.join("\n"));
        let v: Vec<(String, Outcome)> = r.iter().map(|t| (t.key(), t.outcome)).collect();
        assert_eq!(
            v,
            vec![
                ("Sanitize.BlockErase".to_string(), Outcome::Skip),
                ("Sanitize.Reset".to_string(), Outcome::Pass),
                ("iSCSIdatasn.iSCSIDataSnInvalid".to_string(), Outcome::Fail),
                ("iSCSIdatasn.Other".to_string(), Outcome::Fail),
                ("iSCSIdatasn.Noise".to_string(), Outcome::Pass),
                ("iSCSIdatasn.Crashed".to_string(), Outcome::Fail),
            ]
        );
        assert_eq!(
            r[0].messages,
            vec!["[SKIPPED] --allow-sanitize flag is not set. Skipping test."]
        );
        assert_eq!(r[2].messages.len(), 2);
        assert!(r[3].messages[0].starts_with("[FAILED] WRITE10"));
        assert!(r[5].messages[0].contains("did not complete"));
    }

    #[test]
    fn parses_list() {
        let l = "ALL\nALL.Read10\nALL.Read10.Simple\nALL.Read10.Async\nALL.iSCSIcmdsn\n\
                 ALL.iSCSIcmdsn.iSCSICmdSnTooHigh\nSCSI\nSCSI.Read10\nSCSI.Read10.Simple\n";
        let s = parse_list(l);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].name, "Read10");
        assert_eq!(s[0].tests, vec!["Simple", "Async"]);
        assert_eq!(s[0].family(), "SCSI");
        assert_eq!(s[1].family(), "iSCSI");
    }
}
