//! The layer rules that keep the bottom of the daemon reusable by any front
//! end (iSCSI today, NVMe-oF next), checked on the source text so a new
//! `use` that breaks one fails the test command, not a later review.
//!
//! - `volume/` and `store/` form the storage layer: they name nothing of
//!   the crate but themselves and a few leaves (modules that name nothing of
//!   the crate at all).
//! - `metrics/` counts with neutral types: it names nothing of `scsi` (nor of
//!   the engine, the drivers or the portal above it).
//! - The transports (`tcp.rs`, `rdma/`) name nothing of `scsi`.
//!
//! Every path is resolved to the top-level module it lands in: `use`
//! statements, grouped imports (`crate::{a, b::c}`), inline paths in code
//! (`crate::scsi::Sense::new()`) and `super::` chains that climb out of a
//! module. What cannot be resolved (`crate` used as a value or renamed,
//! `#[path]`, `include!`) counts as a violation.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Modules that name nothing of the crate but the store: anything may use
/// them.
const LEAVES: &[&str] = &[
    "clock",
    "private_dir",
    "metrics",
    "signals",
    "systemd",
    "test_pause",
];

/// The storage layer and what it may name besides itself.
const STORAGE: &[&str] = &["volume", "store"];

/// What `metrics/` must never name.
const ABOVE_METRICS: &[&str] = &[
    "scsi",
    "iscsi",
    "tcp",
    "rdma",
    "admission",
    "control",
    "lifecycle",
    "config",
    "daemon",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file of a top-level module (`name.rs` or `name/**`).
fn files_of(module: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let file = src().join(format!("{module}.rs"));
    if file.is_file() {
        out.push(file);
    }
    let mut dirs = vec![src().join(module)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no source files for module `{module}`");
    out
}

/// The module path of a source file: `volume/image/mod.rs` → `volume::image`.
fn module_path(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).expect("file under src/");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Punct(char),
}

/// Identifiers and punctuation, with comments, string and char literals
/// removed (a path inside a doc comment or a message is not a dependency).
fn tokens(text: &str) -> Vec<Token> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == 'r' && (b.get(i + 1) == Some(&'"') || b.get(i + 1) == Some(&'#')) && {
            let mut j = i + 1;
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            b.get(j) == Some(&'"')
        } {
            // Raw string: r#"..."#
            let mut hashes = 0;
            i += 1;
            while b[i] == '#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            'raw: while i < b.len() {
                if b[i] == '"' && (0..hashes).all(|k| b.get(i + 1 + k) == Some(&'#')) {
                    i += 1 + hashes;
                    break 'raw;
                }
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' {
            // A char literal ('a', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(b[start..i].iter().collect()));
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

fn is_path_sep(t: &[Token], i: usize) -> bool {
    t.get(i) == Some(&Token::Punct(':')) && t.get(i + 1) == Some(&Token::Punct(':'))
}

fn ident(t: &[Token], i: usize) -> Option<&str> {
    match t.get(i) {
        Some(Token::Ident(s)) => Some(s),
        _ => None,
    }
}

/// The top-level modules a path starting at token `i` can land in, given
/// `base` (the module path `crate` or `super` starts from). `i` points just
/// past the `::` that follows the path's head. Follows `super` segments and
/// every branch of a `{...}` group.
fn landings(
    t: &[Token],
    i: usize,
    base: &[String],
    out: &mut BTreeSet<String>,
    bad: &mut Vec<String>,
) {
    let mut base = base.to_vec();
    let mut i = i;
    loop {
        match t.get(i) {
            Some(Token::Ident(s)) if s == "super" => {
                if base.pop().is_none() {
                    bad.push("`super` above the crate root".into());
                    return;
                }
                if !is_path_sep(t, i + 1) {
                    bad.push("`super` used as a name".into());
                    return;
                }
                i += 3;
            }
            Some(Token::Ident(s)) if s == "self" => {
                if !is_path_sep(t, i + 1) {
                    // `crate::volume::{self, ...}`: the group's own module.
                    match base.first() {
                        Some(top) => {
                            out.insert(top.clone());
                        }
                        None => bad.push("the crate root itself named".into()),
                    }
                    return;
                }
                i += 3;
            }
            Some(Token::Ident(s)) => {
                match base.first() {
                    Some(top) => out.insert(top.clone()),
                    None => out.insert(s.clone()),
                };
                return;
            }
            Some(Token::Punct('{')) => {
                // Each comma-separated branch at depth 1.
                let mut depth = 0;
                let mut j = i;
                let mut branch_start = i + 1;
                while j < t.len() {
                    match t[j] {
                        Token::Punct('{') => depth += 1,
                        Token::Punct('}') => {
                            depth -= 1;
                            if depth == 0 {
                                if branch_start < j {
                                    landings(t, branch_start, &base, out, bad);
                                }
                                return;
                            }
                        }
                        Token::Punct(',') if depth == 1 => {
                            if branch_start < j {
                                landings(t, branch_start, &base, out, bad);
                            }
                            branch_start = j + 1;
                        }
                        _ => {}
                    }
                    j += 1;
                }
                bad.push("unclosed `{` in a path".into());
                return;
            }
            Some(Token::Punct('*')) => {
                match base.first() {
                    Some(top) => {
                        out.insert(top.clone());
                    }
                    None => bad.push("a glob of the crate root".into()),
                }
                return;
            }
            _ => {
                bad.push("a path that ends after `::`".into());
                return;
            }
        }
    }
}

/// The top-level modules a file names, and what could not be resolved.
fn names_in(file: &Path) -> (BTreeSet<String>, Vec<String>) {
    let text = fs::read_to_string(file).expect("read source");
    names(&text, &module_path(file))
}

/// The top-level modules `text`, the source of module `here`, names.
fn names(text: &str, here: &[String]) -> (BTreeSet<String>, Vec<String>) {
    let t = tokens(text);
    let mut out = BTreeSet::new();
    let mut bad = Vec::new();
    // Inline modules (`mod tests { ... }`) add a level `super` climbs.
    let mut here = here.to_vec();
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    for i in 0..t.len() {
        match t[i] {
            Token::Punct('{') => {
                depth += 1;
                if i >= 2 && ident(&t, i - 2) == Some("mod") {
                    here.push(ident(&t, i - 1).unwrap_or("_").to_string());
                    inline.push(depth);
                }
            }
            Token::Punct('}') => {
                if inline.last() == Some(&depth) {
                    inline.pop();
                    here.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        let prev_is_sep = i >= 2 && is_path_sep(&t, i - 2);
        match ident(&t, i) {
            Some("crate") if !prev_is_sep => {
                if is_path_sep(&t, i + 1) {
                    landings(&t, i + 3, &[], &mut out, &mut bad);
                } else if t.get(i.wrapping_sub(1)) == Some(&Token::Punct('('))
                    && t.get(i + 1) == Some(&Token::Punct(')'))
                {
                    // pub(crate)
                } else {
                    bad.push("`crate` not followed by `::`".into());
                }
            }
            Some("super") if !prev_is_sep => {
                // `pub(super)` is visibility, not a path.
                if t.get(i.wrapping_sub(1)) == Some(&Token::Punct('('))
                    && t.get(i + 1) == Some(&Token::Punct(')'))
                {
                    continue;
                }
                landings(&t, i, &here, &mut out, &mut bad);
            }
            Some("include") | Some("include_str") | Some("include_bytes")
                if t.get(i + 1) == Some(&Token::Punct('!')) =>
            {
                bad.push("`include!` of another file".into());
            }
            Some("path")
                if i >= 2
                    && t.get(i - 1) == Some(&Token::Punct('['))
                    && t.get(i - 2) == Some(&Token::Punct('#'))
                    && t.get(i + 1) == Some(&Token::Punct('=')) =>
            {
                bad.push("`#[path]` attribute".into());
            }
            _ => {}
        }
    }
    (out, bad)
}

/// Every file of `modules` that names a top-level module `allowed` refuses,
/// as "file: module" lines.
fn violations(modules: &[&str], allowed: impl Fn(&str) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    for m in modules {
        for f in files_of(m) {
            let (names, bad) = names_in(&f);
            let rel = f.strip_prefix(src()).unwrap_or(&f).display().to_string();
            for n in names.iter().filter(|n| !allowed(n)) {
                found.push(format!("{rel}: names `crate::{n}`"));
            }
            for b in bad {
                found.push(format!("{rel}: {b}"));
            }
        }
    }
    found
}

#[test]
fn the_storage_layer_names_only_itself_and_leaves() {
    let found = violations(STORAGE, |n| STORAGE.contains(&n) || LEAVES.contains(&n));
    assert!(
        found.is_empty(),
        "the storage layer reaches above itself:\n{}",
        found.join("\n")
    );
}

#[test]
fn leaves_name_nothing_of_the_crate() {
    for leaf in LEAVES {
        // The store is the bottom: descriptors systemd passes become owned
        // there, where all of the crate's unsafe lives.
        let found = violations(&[leaf], |n| n == *leaf || n == "store");
        assert!(
            found.is_empty(),
            "`{leaf}` is listed as a leaf but names other modules:\n{}",
            found.join("\n")
        );
    }
}

#[test]
fn metrics_names_nothing_of_scsi_or_above() {
    let found = violations(&["metrics"], |n| !ABOVE_METRICS.contains(&n));
    assert!(
        found.is_empty(),
        "metrics names a layer above it:\n{}",
        found.join("\n")
    );
}

/// The transports carry commands; they never name the SCSI command set
/// (what an abort waits for, `Transfers`, is admission's), so an NVMe-oF
/// front end can run over them unchanged.
#[test]
fn transports_name_nothing_of_scsi() {
    let found = violations(&["tcp", "rdma"], |n| n != "scsi");
    assert!(
        found.is_empty(),
        "a transport names the SCSI command set:\n{}",
        found.join("\n")
    );
}

/// The TCP transport carries bytes for whichever front end its listener
/// serves: it names no iSCSI framing, engine or portal (NVMe/TCP will be
/// its second user).
#[test]
fn the_tcp_transport_names_no_front_end() {
    let mut found = violations(&["tcp"], |n| !["iscsi", "scsi"].contains(&n));
    for f in files_of("tcp") {
        let text = fs::read_to_string(&f).expect("read a source file");
        for framing in ["ramslog_common::iscsi", "ramslog_common::iser"] {
            if text.contains(framing) {
                found.push(format!("{}: names `{framing}`", f.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the TCP transport names a front end:\n{}",
        found.join("\n")
    );
}

/// The core is what every front end stands on: it names none of them, and
/// nothing of the SCSI command set.
#[test]
fn the_core_names_no_front_end() {
    let found = violations(&["core"], |n| {
        ["admission", "metrics", "core"].contains(&n) || STORAGE.contains(&n) || LEAVES.contains(&n)
    });
    assert!(
        found.is_empty(),
        "the core names a front end or a layer above it:\n{}",
        found.join("\n")
    );
}

/// Start-up, shutdown and the restart machinery work on the core's volumes
/// and gate, never on iSCSI's portal or engine.
#[test]
fn lifecycle_names_no_iscsi_front_end() {
    let found = violations(&["lifecycle", "handover"], |n| n != "iscsi");
    assert!(
        found.is_empty(),
        "the lifecycle names iSCSI's front end:\n{}",
        found.join("\n")
    );
}

/// `status`, `status --json` and `/metrics` read the core's volumes and
/// each front end's view: they name no front end's internals.
#[test]
fn faces_name_no_front_end() {
    let found = violations(&["control", "exposition"], |n| {
        !["scsi", "iscsi", "tcp", "rdma"].contains(&n)
    });
    assert!(
        found.is_empty(),
        "a face names a front end's internals:\n{}",
        found.join("\n")
    );
}

/// The checker itself: each way of naming a module is seen.
#[test]
fn every_form_of_path_is_resolved() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("volume/a.rs", "use crate::scsi::Sense;", &["scsi"]),
        (
            "volume/b.rs",
            "use crate::{store::Store, engine::{X, Y}};",
            &["engine", "store"],
        ),
        (
            "volume/c.rs",
            "fn f() { let _ = crate::portal::Portal::new(); }",
            &["portal"],
        ),
        (
            "volume/image/d.rs",
            "use super::super::super::metrics::Tally;",
            &["metrics"],
        ),
        (
            "volume/image/mod.rs",
            "use super::Identity; use super::super::scsi;",
            &["scsi", "volume"],
        ),
        (
            "volume/e.rs",
            "// crate::scsi in a comment\nconst S: &str = \"crate::engine\";",
            &[],
        ),
        (
            "volume/f.rs",
            "pub(crate) fn f() {} pub(super) fn g() {}",
            &[],
        ),
        (
            "volume/g.rs",
            "use crate::volume::{self, image};",
            &["volume"],
        ),
        (
            "volume/i.rs",
            "mod tests { use super::*; use super::super::super::scsi::X; }",
            &["scsi", "volume"],
        ),
        (
            "volume/h.rs",
            "fn f<'a>(c: char) -> bool { c == '{' || crate::tcp::x() }",
            &["tcp"],
        ),
    ];
    for (rel, text, want) in cases {
        let (got, bad) = names(text, &module_path(&src().join(rel)));
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(got, want, "{rel}: {text}");
        assert!(bad.is_empty(), "{rel}: {bad:?}");
    }
    for text in [
        "use crate as c;",
        "#[path = \"x.rs\"] mod x;",
        "include!(\"x.rs\");",
    ] {
        let (_, bad) = names(text, &module_path(&src().join("volume/x.rs")));
        assert!(!bad.is_empty(), "not refused: {text}");
    }
}
