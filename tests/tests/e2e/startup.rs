//! Start-up refusals: each names the limit or setting and the fix, exits
//! non-zero, and never panics.

use std::process::{Command, Output};

use ramslog_tests::{find_in_path, free_port, target_binary};

use crate::{is_root, refused};

fn run(prefix: &[&str], args: &[&str]) -> Output {
    let (prog, pre) = match prefix.split_first() {
        Some((p, rest)) => (p.to_string(), rest.to_vec()),
        None => (target_binary().display().to_string(), Vec::new()),
    };
    let mut cmd = Command::new(prog);
    cmd.args(pre);
    if !prefix.is_empty() {
        cmd.arg(target_binary());
    }
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run ramslog-target")
}

#[test]
fn mlock_limit_is_named_with_the_fix() {
    let (Some(_), Some(_)) = (find_in_path("prlimit"), find_in_path("setpriv")) else {
        panic!("prlimit and setpriv (util-linux) are needed; tests/run-all.sh installs them");
    };
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let args = [
        "--size",
        "64M",
        "--ephemeral",
        "--hugepages",
        "off",
        "--listen",
        &listen,
    ];
    // Root bypasses RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it from the
    // bounding set. An unprivileged user has no such capability to drop.
    let out = if is_root() {
        run(
            &[
                "prlimit",
                "--memlock=65536:65536",
                "setpriv",
                "--bounding-set=-ipc_lock",
                "--inh-caps=-ipc_lock",
            ],
            &args,
        )
    } else {
        run(&["prlimit", "--memlock=65536:65536"], &args)
    };
    refused(
        &out,
        &[
            "RLIMIT_MEMLOCK",
            "65536",
            "ulimit -l",
            "LimitMEMLOCK=infinity",
        ],
    );
}

#[test]
fn hugepages_require_names_the_reservation() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            })
            .unwrap_or(0)
    };
    let (free, page_kib) = (field("HugePages_Free:"), field("Hugepagesize:").max(2048));
    // More than every free huge page holds, wherever this runs.
    let size = format!("{}M", free * page_kib / 1024 + 128);
    let port = free_port().to_string();
    let out = run(
        &[],
        &[
            "--size",
            &size,
            "--ephemeral",
            "--hugepages",
            "require",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ],
    );
    refused(&out, &["huge pages", "nr_hugepages", "--hugepages auto"]);
}

#[test]
fn non_loopback_without_acl_is_refused() {
    let out = run(
        &[],
        &["--size", "16M", "--ephemeral", "--listen", "0.0.0.0:3260"],
    );
    refused(&out, &["--allow", "--allow-any", "CHAP"]);
}

#[test]
fn missing_or_bad_settings_name_the_fix() {
    refused(&run(&[], &["--ephemeral"]), &["--size"]);
    let out = run(&[], &["--size", "4X", "--ephemeral"]);
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a size"));
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, "listen = [\"127.0.0.1:3260\"]\nbogus = 1\n").expect("write config");
    refused(
        &run(
            &[],
            &["--config", cfg.to_str().unwrap_or_default(), "--ephemeral"],
        ),
        &["bad.toml", "bogus"],
    );
    refused(
        &run(
            &[],
            &[
                "--size",
                "16M",
                "--ephemeral",
                "--target-name",
                "not an iqn",
            ],
        ),
        &["not a valid iSCSI name"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `check-config FILE` (issue 13, item 8): the first TOML error, or every
/// semantic error with FILE:LINE:COLUMN, non-zero exit; the daemon refuses
/// the same file with the same lines.
#[test]
fn check_config_reports_every_problem_with_its_position_as_the_daemon_does() {
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = |name: &str| dir.join(name).display().to_string();

    std::fs::write(
        dir.join("good.toml"),
        "listen = [\"127.0.0.1:3260\"]\n[[target]]\nname = \"iqn.2026-11.org.ramslog:a\"\n[[target.lun]]\nsize = \"16M\"\n",
    )
    .expect("write config");
    let out = run(&[], &["check-config", &path("good.toml")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("no problems"));

    std::fs::write(
        dir.join("syntax.toml"),
        "listen = [\"127.0.0.1:3260\"\n[[target]]\n",
    )
    .expect("write config");
    let out = run(&[], &["check-config", &path("syntax.toml")]);
    refused(
        &out,
        &[&format!("{}:2:1:", path("syntax.toml")), "1 problem in"],
    );

    let bad = "cmd_window = 0\n\
               [[target]]\n\
               name = \"not an iqn\"\n\
               [[target.lun]]\n\
               size = \"3K\"\n\
               block_size = 1024\n";
    std::fs::write(dir.join("bad.toml"), bad).expect("write config");
    let out = run(&[], &["check-config", &path("bad.toml")]);
    let expected = [
        format!(
            "{}:1:14: cmd_window must be between 1 and 4096",
            path("bad.toml")
        ),
        format!("{}:3:8: target name", path("bad.toml")),
        format!("{}:5:8: ", path("bad.toml")),
        format!("{}:6:14: ", path("bad.toml")),
    ];
    let needles: Vec<&str> = expected.iter().map(String::as_str).collect();
    refused(&out, &needles);
    assert!(String::from_utf8_lossy(&out.stderr).contains("4 problems in"));

    let daemon = run(&[], &["--config", &path("bad.toml"), "--ephemeral"]);
    refused(&daemon, &needles);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every portal address is bound before any is served: when a later
/// `--listen` cannot be bound the daemon exits without ever having accepted
/// a connection on an earlier one (a write accepted there would be lost with
/// no dump).
#[test]
fn a_failed_second_listen_exits_before_the_first_is_served() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = taken.local_addr().expect("addr");
    let first = format!("127.0.0.1:{}", free_port());
    // At info the daemon logs each address as it starts serving it.
    let out = Command::new(target_binary())
        .env("RUST_LOG", "info")
        .args([
            "--size",
            "16M",
            "--ephemeral",
            "--control-socket",
            &ramslog_tests::private_socket_dir()
                .join(format!("ramslog-e2e-listen-{}.sock", std::process::id()))
                .display()
                .to_string(),
            "--listen",
            &first,
            "--listen",
            &busy.to_string(),
        ])
        .output()
        .expect("run ramslog-target");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let log = err.clone() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        !log.contains(&format!("listening on {first}")),
        "served before every address was bound: {log}"
    );
    refused(&out, &[&format!("cannot listen on {busy}"), "--listen"]);
}

/// A directory others may write to, for the control-socket tests.
fn open_dir(name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("ramslog-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    dir
}

/// A control socket in a directory another user can write to can be
/// pre-created by that user, who then answers `status` or swallows `stop`
/// in the daemon's place: the daemon refuses to bind there and the client
/// refuses to connect there, each naming the directory and the fix.
#[test]
fn control_sockets_in_directories_others_can_write_are_refused() {
    let dir = open_dir("socket-dir");
    let socket = dir.join("control.sock");
    let socket_arg = socket.display().to_string();
    let port = free_port().to_string();
    let daemon = Command::new(target_binary())
        .args(["--size", "16M", "--ephemeral", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["--control-socket", &socket_arg])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ramslog-target");
    let out = exited_within(daemon, std::time::Duration::from_secs(10));
    let client = Command::new(target_binary())
        .args(["status", "--control-socket", &socket_arg])
        .output()
        .expect("run ramslog-target status");
    let _ = std::fs::remove_dir_all(&dir);
    let Some(out) = out else {
        panic!("the daemon served a control socket another user could plant");
    };
    refused(
        &out,
        &[&dir.display().to_string(), "writable by group or others"],
    );
    let err = String::from_utf8_lossy(&client.stderr);
    assert!(
        !client.status.success() && err.contains("writable by group or others"),
        "the client must refuse that directory, not just fail to connect: {err}"
    );
}

/// Without `$XDG_RUNTIME_DIR` a non-root `--ephemeral` daemon has no
/// directory of its own for the socket (`/tmp/ramslog-<uid>` could be
/// pre-created by anyone): it refuses and says what to give instead, and a
/// non-root client's default lookup does not go there either.
#[test]
fn a_non_root_daemon_without_a_runtime_directory_names_the_fix() {
    assert!(
        is_root(),
        "this test runs the daemon as nobody (CI runs as root)"
    );
    let port = free_port().to_string();
    // 4 MiB: within the 8 MiB RLIMIT_MEMLOCK an unprivileged user gets.
    let daemon = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(target_binary())
        .args([
            "--size",
            "4M",
            "--ephemeral",
            "--hugepages",
            "off",
            "--listen",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .env_remove("XDG_RUNTIME_DIR")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ramslog-target as nobody");
    let out = exited_within(daemon, std::time::Duration::from_secs(10));
    let Some(out) = out else {
        panic!("a non-root daemon used a control socket another user could plant");
    };
    refused(&out, &["XDG_RUNTIME_DIR", "--control-socket"]);
    let client = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(target_binary())
        .arg("status")
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .expect("run status as nobody");
    let err = String::from_utf8_lossy(&client.stderr);
    assert!(!client.status.success(), "{err}");
    assert!(
        !err.contains("/tmp/ramslog-"),
        "no lookup under /tmp: {err}"
    );
}

/// The output of `child` if it exits within `limit`; otherwise it is killed
/// and None returned.
fn exited_within(mut child: std::process::Child, limit: std::time::Duration) -> Option<Output> {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return child.wait_with_output().ok();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}
