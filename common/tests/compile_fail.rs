//! The verbs wrapper's safety rests on what safe code cannot write. Its
//! doctests mark those snippets `compile_fail,E0xxx`, but stable rustdoc
//! ignores the error code: a snippet that fails for any other reason (a
//! typo, a renamed item) would pass. Here each snippet is compiled against
//! the very `ramslog_common` this test links, and must fail with its code,
//! while a control snippet beside it must compile. They need the `rdma`
//! feature (the workspace's build turns it on); built without it, the one
//! test left fails, so nothing passes having checked nothing.

#[cfg(not(feature = "rdma"))]
#[test]
fn the_verbs_wrapper_is_built() {
    panic!(
        "ramslog-common was built without the rdma feature: the verbs wrapper's compile-fail \
         checks did not run (cargo test -p ramslog-common --features rdma, or the workspace)"
    );
}

#[cfg(feature = "rdma")]
mod with_rdma {

    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Each compile gets its own scratch directory: the tests run in parallel.
    static SCRATCH: AtomicUsize = AtomicUsize::new(0);

    /// The directory holding this test's dependencies (`<profile>/deps`).
    fn deps_dir() -> PathBuf {
        let exe = std::env::current_exe().expect("test executable");
        exe.parent().expect("deps directory").to_path_buf()
    }

    /// Type-check `src` as a library against `rlib`; the error codes rustc
    /// reports (empty when it compiles; lints such as unused imports are not
    /// errors).
    fn error_codes(rlib: &Path, src: &str) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!(
            "ramslog-compile-fail-{}-{}",
            std::process::id(),
            SCRATCH.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let file = dir.join("snippet.rs");
        std::fs::write(&file, src).expect("write snippet");
        let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        let out = Command::new(rustc)
            .args([
                "--edition",
                "2021",
                "--crate-type",
                "lib",
                "--emit",
                "metadata",
            ])
            .arg("--error-format=json")
            .arg("-L")
            .arg(format!("dependency={}", deps_dir().display()))
            .arg("--extern")
            .arg(format!("ramslog_common={}", rlib.display()))
            .arg("--out-dir")
            .arg(&dir)
            .arg(&file)
            .output()
            .expect("run rustc");
        let _ = std::fs::remove_dir_all(&dir);
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter_map(|l| {
                let at = l.find(r#""code":{"code":""#)? + r#""code":{"code":""#.len();
                Some(l[at..].split('"').next()?.to_string())
            })
            .filter(|code| code.starts_with('E'))
            .collect()
    }

    /// The `ramslog_common` rlib built with the verbs module: the one a
    /// control snippet using it compiles against.
    fn verbs_rlib(control: &str) -> PathBuf {
        let mut candidates: Vec<PathBuf> = std::fs::read_dir(deps_dir())
            .expect("deps directory")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libramslog_common-") && n.ends_with(".rlib"))
            })
            .collect();
        // The newest first: the one this test was built with.
        candidates.sort_by_key(|p| std::cmp::Reverse(p.metadata().and_then(|m| m.modified()).ok()));
        candidates
            .into_iter()
            .find(|p| error_codes(p, control).is_empty())
            .expect("no ramslog_common rlib with the verbs module compiles the control snippet")
    }

    fn check(control: &str, refused: &str, code: &str) {
        let rlib = verbs_rlib(control);
        let codes = error_codes(&rlib, refused);
        assert!(
            codes.iter().any(|c| c == code),
            "expected {code}, rustc reported {codes:?} for:\n{refused}"
        );
    }

    #[test]
    fn an_sge_cannot_be_made_from_any_address() {
        check(
            "use ramslog_common::verbs::{RegisteredBuffer, Sge};\n\
         pub fn slot(b: &RegisteredBuffer, i: usize) -> Option<Sge> { b.sge(i * 512, 512) }\n",
            "pub fn forged() -> ramslog_common::verbs::Sge<'static> {\n\
         ramslog_common::verbs::Sge { addr: 0x1000, len: 4096, lkey: 1, region: std::marker::PhantomData }\n}\n",
            "E0451",
        );
    }

    /// What the post snippets share: a buffer, a work request, an id.
    const POST_USE: &str =
        "use ramslog_common::verbs::{CmId, RegisteredBuffer, SendOp, SendWr, WrId};\n";

    /// An entry kept past its buffer's drop would name a key the next
    /// registration may reuse, over memory that is gone: it must not be
    /// posted, or outlive the buffer at all.
    #[test]
    fn an_sge_does_not_outlive_its_region() {
        let post = |before_post: &str| {
            format!(
                "{POST_USE}pub fn send(id: &CmId, b: RegisteredBuffer) {{\n\
                 let Some(sge) = b.sge(0, 512) else {{ return }};\n\
                 {before_post}\n\
                 let wr = SendWr {{ wr_id: WrId::default(), op: SendOp::Send, sge, signaled: true, inline: false }};\n\
                 let _ = id.post_send(&wr);\n\
                 drop(b);\n}}\n"
            )
        };
        check(&post(""), &post("let b2 = b;\ndrop(b2);"), "E0505");
        check(
            &format!(
                "{POST_USE}pub fn entry(b: &RegisteredBuffer) -> Option<ramslog_common::verbs::Sge<'_>> {{ b.sge(0, 512) }}\n"
            ),
            &format!(
                "{POST_USE}pub fn stale(b: RegisteredBuffer) -> Option<ramslog_common::verbs::Sge<'static>> {{ b.sge(0, 512) }}\n"
            ),
            "E0515",
        );
    }

    #[test]
    fn a_registered_buffer_is_only_ever_copied() {
        check(
        "use ramslog_common::verbs::RegisteredBuffer;\n\
         pub fn first(b: &RegisteredBuffer) -> Option<u8> { let mut o = [0u8; 1]; b.read(0, &mut o)?; Some(o[0]) }\n",
        "use ramslog_common::verbs::RegisteredBuffer;\n\
         pub fn slot(b: &RegisteredBuffer) -> Option<&[u8]> { b.bytes(0..512) }\n",
        "E0599",
    );
    }

    /// What the slot snippets share: a buffer, an id and a completion.
    const SLOT_USE: &str = "use ramslog_common::verbs::{CmId, Slot, SlotBuffer, WorkCompletion};\n";

    #[test]
    fn a_slot_is_read_before_it_is_lent_again() {
        check(
        &format!(
            "{SLOT_USE}pub fn answer(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) -> Option<u8> {{\n\
             let slot = buf.reclaim(wc)?;\n\
             let first = buf.bytes(&slot, 1)?[0];\n\
             let _ = buf.post_recv(id, &mut vec![slot]);\n\
             Some(first)\n}}\n"
        ),
        &format!(
            "{SLOT_USE}pub fn early(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) -> Option<u8> {{\n\
             let slot = buf.reclaim(wc)?;\n\
             let bytes = buf.bytes(&slot, 1)?;\n\
             let _ = buf.post_recv(id, &mut vec![slot]);\n\
             Some(bytes[0])\n}}\n"
        ),
        "E0505",
    );
    }

    #[test]
    fn a_lent_slot_is_gone() {
        check(
            &format!("{SLOT_USE}pub fn keep(s: Slot) -> u32 {{ s.index() }}\n"),
            &format!(
            "{SLOT_USE}pub fn late(buf: &mut SlotBuffer, id: &CmId, wc: &mut WorkCompletion) {{\n\
             let Some(slot) = buf.reclaim(wc) else {{ return }};\n\
             let _ = buf.post_recv(id, &mut vec![slot]);\n\
             let _ = buf.bytes(&slot, 1);\n}}\n"
        ),
            "E0382",
        );
    }

    #[test]
    fn a_slot_and_a_completion_cannot_be_duplicated() {
        let control = format!("{SLOT_USE}pub fn index(s: &Slot) -> u32 {{ s.index() }}\n");
        check(
            &control,
            &format!("{SLOT_USE}pub fn twice(s: &Slot) -> Slot {{ Slot::clone(s) }}\n"),
            "E0277",
        );
        check(
        &control,
        &format!("{SLOT_USE}pub fn twice(wc: &WorkCompletion) -> WorkCompletion {{ WorkCompletion::clone(wc) }}\n"),
        "E0277",
    );
        check(
        &control,
        &format!("{SLOT_USE}pub fn forged() -> WorkCompletion {{ WorkCompletion {{ lent: 1, ..Default::default() }} }}\n"),
        "E0451",
    );
    }

    #[test]
    fn a_device_handle_is_cloned_never_copied() {
        check(
        "use ramslog_common::verbs::Device;\npub fn another(d: &Device) -> Device { d.clone() }\n",
        "use ramslog_common::verbs::Device;\npub fn another(d: &Device) -> Device { *d }\n",
        "E0507",
    );
    }
}
