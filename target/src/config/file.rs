//! The config file: its TOML shape, with the position of every value a check
//! can refuse, and the checks that need no command line. `check-config` and
//! the daemon at start run the same [`check_file`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::{
    chap, check_block_size, check_lun_number, check_lun_size, check_setting, check_target_name,
    open_access, parse_metrics_addr, parse_metrics_network, parse_size, ConfigError,
};
use crate::iscsi::portal::AclEntry;
use crate::store::HugePages;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    #[serde(default)]
    pub listen: Vec<SocketAddr>,
    pub state_dir: Option<PathBuf>,
    pub control_socket: Option<PathBuf>,
    pub image_dir: Option<PathBuf>,
    pub hugepages: Option<Spanned<String>>,
    #[serde(default)]
    pub allow_any: bool,
    pub cmd_window: Option<Spanned<u32>>,
    pub nop_interval: Option<Spanned<u64>>,
    pub nop_timeout: Option<Spanned<u64>>,
    pub login_timeout: Option<Spanned<u64>>,
    pub output_stall_timeout: Option<Spanned<u64>>,
    pub first_pdu_timeout: Option<Spanned<u64>>,
    pub restart_drain_ms: Option<Spanned<u64>>,
    pub discovery_lifetime: Option<Spanned<u64>>,
    pub max_connections: Option<Spanned<u32>>,
    pub max_connections_per_host: Option<Spanned<u32>>,
    pub max_logins_per_host: Option<Spanned<u32>>,
    pub max_pending_logins: Option<Spanned<u32>>,
    #[serde(alias = "max_pending_iser_logins")]
    pub max_pending_rdma_logins: Option<Spanned<u32>>,
    pub max_discovery_sessions: Option<Spanned<u32>>,
    pub max_discovery_sessions_per_host: Option<Spanned<u32>>,
    #[serde(alias = "max_iser_connections")]
    pub max_rdma_connections: Option<Spanned<u32>>,
    pub max_iscsi_connections: Option<Spanned<u32>>,
    pub staging_budget: Option<Spanned<String>>,
    pub iser: Option<bool>,
    pub iser_spin: Option<u32>,
    pub kept_memory: Option<bool>,
    pub verify_kept_memory: Option<bool>,
    pub discovery_chap: Option<Spanned<FileChap>>,
    pub metrics: Option<Spanned<String>>,
    pub metrics_allow: Option<Spanned<Vec<String>>>,
    #[serde(default)]
    pub target: Vec<Spanned<FileTarget>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileTarget {
    pub name: Spanned<String>,
    pub alias: Option<String>,
    #[serde(default)]
    pub allow: Vec<Spanned<String>>,
    pub chap: Option<Spanned<FileChap>>,
    pub mutual_chap: Option<Spanned<FileChap>>,
    #[serde(default)]
    pub lun: Vec<Spanned<FileLun>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileChap {
    pub user: String,
    pub secret: Option<String>,
    pub secret_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileLun {
    /// Default 0.
    pub lun: Option<Spanned<u64>>,
    pub size: Spanned<String>,
    /// Default 512.
    pub block_size: Option<Spanned<u32>>,
}

impl FileLun {
    pub fn number(&self) -> u64 {
        self.lun.as_ref().map_or(0, |n| *n.get_ref())
    }

    pub fn block_size(&self) -> u32 {
        self.block_size.as_ref().map_or(512, |b| *b.get_ref())
    }
}

/// One thing wrong in a config file, and where (1-based, columns in characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl Problem {
    fn at(text: &str, span: Range<usize>, message: impl Into<String>) -> Problem {
        let before = &text[..span.start.min(text.len())];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Problem {
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
            message: message.into(),
        }
    }

    /// `PATH:LINE:COLUMN: message`, one per line, as compilers print them.
    pub fn list(path: &Path, problems: &[Problem]) -> String {
        problems
            .iter()
            .map(|p| format!("{}:{}:{}: {}", path.display(), p.line, p.column, p.message))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Read and parse a config file; a TOML error (syntax, unknown key, wrong
/// type) stops at the first one, as the parser does.
pub(super) fn parse(path: &Path) -> Result<(String, FileConfig), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    match toml::from_str(&text) {
        Ok(file) => Ok((text, file)),
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            let message = e.message().trim_end().replace('\n', "; ");
            Err(ConfigError::File {
                path: path.to_path_buf(),
                problems: vec![Problem::at(&text, span, message)],
            })
        }
    }
}

/// Every semantic error of the file, in file order: what `check-config`
/// prints, and what stops the daemon at start. `Ok` holds the parsed file.
pub fn check_file(path: &Path) -> Result<(), ConfigError> {
    parse(path).and_then(|(text, file)| {
        let exposure = Exposure::of(&file.listen, file.allow_any);
        checked(path, &text, &file, exposure)
    })
}

/// What the access rule depends on besides the file: the daemon passes the
/// values after its flags (`--listen`, `--allow-any`); `check-config` the file's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Exposure {
    pub all_loopback: bool,
    pub allow_any: bool,
}

impl Exposure {
    pub fn of(listen: &[SocketAddr], allow_any: bool) -> Exposure {
        Exposure {
            all_loopback: listen.iter().all(|a| a.ip().is_loopback()),
            allow_any,
        }
    }
}

pub(super) fn checked(
    path: &Path,
    text: &str,
    file: &FileConfig,
    exposure: Exposure,
) -> Result<(), ConfigError> {
    let problems = problems(text, file, exposure);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::File {
            path: path.to_path_buf(),
            problems,
        })
    }
}

fn problems(text: &str, file: &FileConfig, exposure: Exposure) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut refuse =
        |span: Range<usize>, message: String| out.push(Problem::at(text, span, message));

    if let Some(h) = &file.hugepages {
        if let Err(e) = h.get_ref().parse::<HugePages>() {
            refuse(h.span(), format!("hugepages: {e}"));
        }
    }
    // Each numeric key, by its name in the file.
    macro_rules! numbers {
        ($($key:ident),* $(,)?) => {
            [$((stringify!($key), file.$key.as_ref().map(widen))),*]
        };
    }
    let numbers = numbers![
        cmd_window,
        nop_interval,
        nop_timeout,
        login_timeout,
        output_stall_timeout,
        first_pdu_timeout,
        restart_drain_ms,
        discovery_lifetime,
        max_connections,
        max_connections_per_host,
        max_logins_per_host,
        max_pending_logins,
        max_pending_rdma_logins,
        max_discovery_sessions,
        max_discovery_sessions_per_host,
        max_rdma_connections,
        max_iscsi_connections,
    ];
    for (key, value) in numbers {
        if let Some(v) = value {
            if let Err(e) = check_setting(key, *v.get_ref()) {
                refuse(v.span(), e);
            }
        }
    }
    if let Some(b) = &file.staging_budget {
        match parse_size(b.get_ref()) {
            Ok(n) => {
                if let Err(e) = check_setting("staging_budget", n) {
                    refuse(b.span(), e);
                }
            }
            Err(e) => refuse(b.span(), format!("staging_budget: {e}")),
        }
    }
    if let Some(m) = &file.metrics {
        if let Err(e) = parse_metrics_addr(m.get_ref()) {
            refuse(m.span(), format!("metrics: {e}"));
        }
    }
    if let Some(nets) = &file.metrics_allow {
        for n in nets.get_ref() {
            if let Err(e) = parse_metrics_network(n) {
                refuse(nets.span(), format!("metrics_allow: {e}"));
            }
        }
    }
    if let Some(c) = &file.discovery_chap {
        if let Err(e) = chap(Some(c.get_ref().clone())) {
            refuse(c.span(), format!("discovery_chap: {e}"));
        }
    }

    let mut names = HashSet::new();
    for t in &file.target {
        let t = t.get_ref();
        let name = t.name.get_ref();
        if let Err(e) = check_target_name(name) {
            refuse(t.name.span(), e);
        } else if !names.insert(name.to_ascii_lowercase()) {
            refuse(t.name.span(), format!("target {name} is defined twice"));
        }
        if t.lun.is_empty() {
            refuse(t.name.span(), format!("target {name} has no LUN"));
        }
        let mut luns = HashSet::new();
        for table in &t.lun {
            let l = table.get_ref();
            let n = l.number();
            // A key left out has no position of its own: point at its table.
            let lun_at = l.lun.as_ref().map_or(table.span(), |s| s.span());
            if let Err(e) = check_lun_number(n) {
                refuse(lun_at, format!("target {name}: {e}"));
            } else if !luns.insert(n) {
                refuse(lun_at, format!("target {name}: LUN {n} is defined twice"));
            }
            if let Err(e) = check_block_size(l.block_size()) {
                let at = l.block_size.as_ref().map_or(table.span(), |s| s.span());
                refuse(at, format!("target {name} LUN {n}: {e}"));
            }
            match parse_size(l.size.get_ref()) {
                Ok(size) => {
                    if let Err(e) = check_lun_size(size) {
                        refuse(l.size.span(), format!("target {name} LUN {n}: {e}"));
                    }
                }
                Err(e) => refuse(l.size.span(), format!("target {name} LUN {n}: size: {e}")),
            }
        }
        for a in &t.allow {
            if let Err(e) = a.get_ref().parse::<AclEntry>() {
                refuse(a.span(), e);
            }
        }
        for (key, c) in [("chap", &t.chap), ("mutual_chap", &t.mutual_chap)] {
            if let Some(c) = c {
                if let Err(e) = chap(Some(c.get_ref().clone())) {
                    refuse(c.span(), format!("target {name} {key}: {e}"));
                }
            }
        }
        if let Err(e) = open_access(
            name,
            t.allow.is_empty(),
            exposure.all_loopback,
            exposure.allow_any,
            t.chap.is_some(),
        ) {
            refuse(t.name.span(), e);
        }
    }
    // Stable: problems at one position keep the order they were found in.
    out.sort_by_key(|p| (p.line, p.column));
    out
}

fn widen<T: Copy + Into<u64>>(v: &Spanned<T>) -> Spanned<u64> {
    Spanned::new(v.span(), (*v.get_ref()).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems_of(text: &str) -> Vec<(usize, usize, String)> {
        let file: FileConfig = toml::from_str(text).expect("valid TOML");
        problems(text, &file, Exposure::of(&file.listen, file.allow_any))
            .into_iter()
            .map(|p| (p.line, p.column, p.message))
            .collect()
    }

    #[test]
    fn every_semantic_error_is_reported_with_its_position() {
        let text = "cmd_window = 0\nnop_timeout = 7200\n\n[[target]]\nname = \"bad name\"\n[[target.lun]]\nsize = \"3K\"\nblock_size = 1024\n[[target.lun]]\nlun = 0\nsize = \"1X\"\n";
        let p = problems_of(text);
        let at: Vec<_> = p.iter().map(|(l, c, _)| (*l, *c)).collect();
        assert_eq!(
            at,
            [(1, 14), (2, 15), (5, 8), (7, 8), (8, 14), (10, 7), (11, 8)],
            "{p:#?}"
        );
        assert!(p[0].2.contains("cmd_window"), "{p:#?}");
        assert!(p[5].2.contains("defined twice"), "{p:#?}");
    }

    #[test]
    fn a_bad_metrics_address_is_placed() {
        let p = problems_of("metrics = \"localhost\"\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!((p[0].0, p[0].1), (1, 11));
        assert!(p[0].2.contains("ADDR:PORT"), "{p:#?}");
        assert!(problems_of("metrics = \"9105\"\n").is_empty());
        assert!(problems_of("metrics = \"[::1]:9105\"\n").is_empty());
        let p = problems_of("metrics_allow = [\"192.0.2.0/24\", \"example\"]\n");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert!(
            p[0].2.contains("metrics_allow") && p[0].2.contains("example"),
            "{p:#?}"
        );
        assert!(problems_of("metrics_allow = [\"192.0.2.0/24\", \"2001:db8::1\"]\n").is_empty());
    }

    #[test]
    fn a_good_file_has_no_problems() {
        let text = "listen = [\"127.0.0.1:3260\"]\n[[target]]\nname = \"iqn.2026-11.org.ramslog:a\"\n[[target.lun]]\nsize = \"16M\"\n";
        assert!(problems_of(text).is_empty());
    }

    #[test]
    fn positions_count_characters_not_bytes() {
        let text = "# é\nx";
        let p = Problem::at(text, 5..6, "m");
        assert_eq!((p.line, p.column), (2, 1));
        let p = Problem::at("ab\u{e9}c", 4..5, "m");
        assert_eq!((p.line, p.column), (1, 4));
    }
}
