//! Helpers shared by the end-to-end tests.
//!
//! [`TargetProcess`] starts the real `ramslog-target` binary on a free loopback port, waits
//! until it accepts TCP connections, keeps its stderr/stdout in a log file for post-mortem and
//! stops it (SIGTERM, then SIGKILL) when dropped. [`testcu`] runs and parses libiscsi's
//! `iscsi-test-cu`.

pub mod counting_alloc;
pub mod fdstore;
pub mod testcu;

pub use rustix::process::Signal;
use std::fs::{self, File};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Target name used when a test does not choose one.
pub const DEFAULT_TARGET_NAME: &str = "iqn.2026-11.org.ramslog:test";
/// Block size of the LUN served by `ramslog-target`.
pub const BLOCK_SIZE: u32 = 512;

/// How long [`TargetProcess::stop`] waits after SIGTERM (which fences and
/// dumps the LUN to its image) before sending SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(60);

static INSTANCE: AtomicU32 = AtomicU32::new(0);

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cargo profile directory the running test binary was built into (e.g. `build/debug`).
///
/// Test executables live in `<profile>/deps/`; when that is not the case (custom runner) we fall
/// back to `CARGO_MANIFEST_DIR/../build/debug`.
pub fn profile_dir() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            if dir.file_name().is_some_and(|n| n == "deps") {
                if let Some(profile) = dir.parent() {
                    return profile.to_path_buf();
                }
            }
        }
    }
    manifest_dir().join("../build/debug")
}

/// The workspace build directory (`build/`), where test artefacts such as logs are written.
pub fn build_dir() -> PathBuf {
    profile_dir()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest_dir().join("../build"))
}

/// Directory for artefacts of one kind of test, e.g. `build/conformance`; created if missing.
pub fn artefact_dir(name: &str) -> PathBuf {
    let dir = build_dir().join(name);
    fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create artefact dir {}: {e}", dir.display()));
    dir
}

/// A directory for control sockets only this user can write to, as the
/// daemon and its clients require: `$TMPDIR/ramslog-tests-<uid>` (short, for
/// the 108-byte limit of socket paths), 0700.
pub fn private_socket_dir() -> PathBuf {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let uid = fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ramslog-tests-{uid}"));
    let _ = fs::DirBuilder::new().mode(0o700).create(&dir);
    let meta = fs::symlink_metadata(&dir)
        .unwrap_or_else(|e| panic!("socket directory {}: {e}", dir.display()));
    assert!(
        meta.is_dir() && meta.uid() == uid && meta.permissions().mode() & 0o077 == 0,
        "{} must be a directory of uid {uid}, mode 0700: remove it",
        dir.display()
    );
    dir
}

/// A CHAP secret file only its owner can read, as the daemon requires:
/// `build/secrets/<name>-<pid>`.
pub fn secret_file(name: &str, secret: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = artefact_dir("secrets").join(format!("{name}-{}", std::process::id()));
    fs::write(&path, secret).expect("write the secret file");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod the secret file");
    path
}

/// Path of the `ramslog-target` binary: `$RAMSLOG_TARGET_BIN`, else the profile directory of
/// the running test, else `build/debug`, else `build/release`.
pub fn target_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("RAMSLOG_TARGET_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "RAMSLOG_TARGET_BIN={} does not exist",
            p.display()
        );
        return p;
    }
    let candidates = [
        profile_dir().join("ramslog-target"),
        manifest_dir().join("../build/debug/ramslog-target"),
        manifest_dir().join("../build/release/ramslog-target"),
    ];
    for c in &candidates {
        if c.is_file() {
            return c.clone();
        }
    }
    panic!(
        "ramslog-target binary not found (looked at {}): run `cargo build --workspace` first",
        candidates
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// A currently free TCP port on 127.0.0.1 (bind to port 0, read the port, release it).
pub fn free_port() -> u16 {
    // The kernel may hand the same free port to two probes in a row (the
    // first is closed again at once): never give one twice in a process,
    // or a test's portal and metrics port could collide.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
        let port = l.local_addr().expect("local_addr of probe listener").port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// How to start `ramslog-target`.
#[derive(Clone, Debug)]
pub struct TargetOptions {
    /// `--target-name`.
    pub target_name: String,
    /// `--size` (e.g. `256M`).
    pub size: String,
    /// `--config FILE` instead of `--size` and `--target-name` (the file
    /// names the targets and LUNs; `target_name` should be its first).
    pub config: Option<PathBuf>,
    /// `--ephemeral`; when false a fresh temporary state directory is passed via
    /// `--state-dir` and removed on drop (unless `RAMSLOG_KEEP_STATE` is set).
    pub ephemeral: bool,
    /// Reuse this state directory (kept on drop) instead of a fresh temporary one.
    pub state_dir: Option<PathBuf>,
    /// Listen on this port instead of a free one (to restart "the same box").
    pub port: Option<u16>,
    /// Appended after the standard arguments.
    pub extra_args: Vec<String>,
    /// Extra environment; `RUST_LOG` defaults to `info` unless set here or in the environment.
    pub env: Vec<(String, String)>,
    /// How long to wait for the port to accept connections.
    pub ready_timeout: Duration,
    /// A command the binary runs under (e.g. `setpriv` with its options).
    pub wrapper: Vec<String>,
    /// Run this file instead of [`target_binary`] (a copy a test replaces,
    /// as an upgrade replaces the installed binary).
    pub binary: Option<PathBuf>,
    /// Leave an ephemeral target's control socket at the daemon's default
    /// (`/run/ramslog/control.sock` for root). Tests run in parallel, so by
    /// default each ephemeral target gets its own socket; only one test may
    /// set this.
    pub default_control_socket: bool,
    /// `--verify-kept-memory on` (the default here): the daemon keeps page
    /// checksums, and at a clean stop reports any page a write left
    /// counted in, which [`TargetProcess::stop`] fails on.
    pub page_checksums: bool,
}

impl Default for TargetOptions {
    fn default() -> Self {
        TargetOptions {
            target_name: DEFAULT_TARGET_NAME.to_string(),
            size: "256M".to_string(),
            config: None,
            ephemeral: true,
            state_dir: None,
            port: None,
            extra_args: Vec::new(),
            env: Vec::new(),
            ready_timeout: Duration::from_secs(10),
            wrapper: Vec::new(),
            binary: None,
            default_control_socket: false,
            page_checksums: true,
        }
    }
}

/// A running `ramslog-target`; stopped (SIGTERM, then SIGKILL) on drop.
pub struct TargetProcess {
    child: Child,
    addr: SocketAddr,
    target_name: String,
    log_path: PathBuf,
    state_dir: Option<PathBuf>,
    /// A per-test control socket, removed on drop (a killed daemon leaves it).
    own_control_socket: Option<PathBuf>,
    exit: Option<ExitStatus>,
}

impl TargetProcess {
    /// Start with [`TargetOptions::default`] (ephemeral, 256M, [`DEFAULT_TARGET_NAME`]).
    pub fn start() -> Self {
        Self::start_with(TargetOptions::default())
    }

    /// Start with the given options; panics (showing the target's output) if it exits early or
    /// does not accept TCP connections within `ready_timeout`.
    pub fn start_with(opts: TargetOptions) -> Self {
        let timeout = opts.ready_timeout;
        let mut tp = Self::spawn_with(opts);
        tp.wait_ready(timeout);
        tp
    }

    /// Start without waiting for the portal (to watch the start-up itself).
    pub fn spawn_with(opts: TargetOptions) -> Self {
        let bin = opts.binary.clone().unwrap_or_else(target_binary);
        let n = INSTANCE.fetch_add(1, Ordering::SeqCst);
        let port = opts.port.unwrap_or_else(free_port);
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();

        let log_dir = artefact_dir("test-logs");
        let log_path = log_dir.join(format!(
            "ramslog-target-{}-{}-port{}.log",
            std::process::id(),
            n,
            port
        ));
        let log = File::create(&log_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", log_path.display()));
        let log2 = log.try_clone().expect("clone log file handle");

        let mut cmd = match opts.wrapper.split_first() {
            Some((prog, args)) => {
                let mut c = Command::new(prog);
                c.args(args).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let mut state_dir = None;
        let mut own_control_socket = None;
        if opts.ephemeral {
            cmd.arg("--ephemeral");
            if !opts.default_control_socket {
                let socket = private_socket_dir().join(format!(
                    "ramslog-test-{}-{}.sock",
                    std::process::id(),
                    n
                ));
                cmd.arg("--control-socket").arg(&socket);
                own_control_socket = Some(socket);
            }
        } else if let Some(dir) = &opts.state_dir {
            cmd.arg("--state-dir").arg(dir);
        } else {
            let dir = std::env::temp_dir().join(format!(
                "ramslog-test-state-{}-{}",
                std::process::id(),
                n
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("create state dir {}: {e}", dir.display()));
            cmd.arg("--state-dir").arg(&dir);
            state_dir = Some(dir);
        }
        match &opts.config {
            Some(file) => cmd.arg("--config").arg(file),
            None => cmd
                .arg("--size")
                .arg(&opts.size)
                .arg("--target-name")
                .arg(&opts.target_name),
        };
        cmd.arg("--listen").arg(addr.to_string());
        if opts.page_checksums {
            cmd.args(["--verify-kept-memory", "on"]);
        }
        cmd.args(&opts.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log2))
            .stderr(Stdio::from(log));
        if std::env::var_os("RUST_LOG").is_none() && !opts.env.iter().any(|(k, _)| k == "RUST_LOG")
        {
            cmd.env("RUST_LOG", "info");
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));

        TargetProcess {
            child,
            addr,
            target_name: opts.target_name.clone(),
            log_path,
            state_dir,
            own_control_socket,
            exit: None,
        }
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait on ramslog-target") {
                self.exit = Some(status);
                panic!(
                    "ramslog-target exited early ({status}) before accepting connections on {}; \
                     its output ({}):\n{}",
                    self.addr,
                    self.log_path.display(),
                    self.output()
                );
            }
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            if Instant::now() >= deadline {
                let _ = self.stop();
                panic!(
                    "ramslog-target did not accept connections on {} within {:?}; its output \
                     ({}):\n{}",
                    self.addr,
                    timeout,
                    self.log_path.display(),
                    self.output()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The listening address (127.0.0.1:PORT).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The listening port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The target's IQN.
    pub fn target_name(&self) -> &str {
        &self.target_name
    }

    /// `iscsi://127.0.0.1:PORT/IQN/LUN` (libiscsi URL syntax).
    pub fn url(&self, lun: u32) -> String {
        format!("iscsi://{}/{}/{}", self.addr, self.target_name, lun)
    }

    /// Process id of the target.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The state directory passed to a non-ephemeral target.
    pub fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    /// The control socket given to an ephemeral target (`--control-socket`).
    pub fn control_socket(&self) -> Option<&Path> {
        self.own_control_socket.as_deref()
    }

    /// File holding the target's stderr and stdout.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the target wrote to stderr/stdout so far.
    pub fn output(&self) -> String {
        fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log_path.display()))
    }

    /// The last `n` lines of [`TargetProcess::output`].
    pub fn output_tail(&self, n: usize) -> String {
        let out = self.output();
        let lines: Vec<&str> = out.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// `None` while running, else its exit status.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait on ramslog-target");
        }
        self.exit
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.try_exit_status().is_none()
    }

    /// SIGTERM, wait up to `STOP_GRACE` (60 s), then SIGKILL; returns the exit status.
    /// Idempotent.
    /// Panics (unless the test is already failing) if the daemon reported a
    /// page a write left counted in (see [`TargetOptions::page_checksums`]).
    pub fn stop(&mut self) -> ExitStatus {
        if let Some(s) = self.try_exit_status() {
            return s;
        }
        send_sigterm(self.child.id());
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Some(s) = self.try_exit_status() {
                self.assert_no_page_left_counted_in();
                return s;
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.kill()
    }

    /// Every write counted itself out of the page checksums: the daemon
    /// checks at a clean stop, once every connection is gone.
    fn assert_no_page_left_counted_in(&self) {
        const DEFECT: &str = "pages still counted in after every connection ended";
        if !thread::panicking() && self.output().contains(DEFECT) {
            panic!(
                "the daemon's page checksums were left counted in ({}):\n{}",
                self.log_path.display(),
                self.output_tail(30)
            );
        }
    }

    /// SIGKILL at once: a crash or a power cut, with no dump. Idempotent.
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(s) = self.try_exit_status() {
            return s;
        }
        let _ = self.child.kill();
        let s = self.child.wait().expect("wait for killed ramslog-target");
        self.exit = Some(s);
        s
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        self.stop();
        if let Some(socket) = &self.own_control_socket {
            let _ = fs::remove_file(socket);
        }
        if let Some(dir) = &self.state_dir {
            if std::env::var_os("RAMSLOG_KEEP_STATE").is_none() {
                let _ = fs::remove_dir_all(dir);
            }
        }
    }
}

fn send_sigterm(pid: u32) {
    send_signal(pid, Signal::TERM);
}

/// Send a signal to a process (a gone process is not an error).
pub fn send_signal(pid: u32, signal: Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Search `PATH` for an executable.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
