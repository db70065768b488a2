//! `ramslog-target`: serve pinned RAM as a SCSI disk over iSCSI.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::{Parser, Subcommand};
use ramslog_target::config::{
    check_file, default_control_sockets, Config, ConfigError, Problem, RunArgs,
};
use ramslog_target::control::{self, Control, Reply, Request, RestartReply};
use ramslog_target::core::{Core, FrontEndView};
use ramslog_target::handover::{self, Inherited};
use ramslog_target::iscsi::portal::{self, Acl, Portal, TargetDef};
use ramslog_target::lifecycle::{self, Ending, KeptMemory};
use ramslog_target::scsi::ScsiTarget;
use ramslog_target::signals;
use ramslog_target::systemd::{self, notify};
use ramslog_target::tcp;
use ramslog_target::volume::image;
use ramslog_target::volume::state::FailedStop;

/// The exit status of a stop whose dump failed (EX_IOERR). The unit names
/// it in RestartPreventExitStatus=: a stop that could not save the content
/// must not be undone by a restart that serves the LUNs NOT READY.
const EXIT_DUMP_FAILED: u8 = 74;

/// Why the daemon ended badly; the exit status says which.
enum Failure {
    /// Anything that kept it from starting or serving: exit 1.
    Other(String),
    /// A stop was asked for and a dump failed: [`EXIT_DUMP_FAILED`].
    DumpFailed(String),
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::Other(msg)
    }
}

/// How far ahead of now systemd's stop timeout is kept while a dump makes
/// progress.
const STOP_EXTENSION: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Parser)]
#[command(
    name = "ramslog-target",
    version,
    about = "Serve pinned RAM as a SCSI disk over iSCSI (a ZFS SLOG)"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show targets, LUNs (identity, readiness, I/O), sessions and limits
    /// of the running daemon.
    Status {
        /// Print everything as one JSON object (the facts --metrics serves).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Stop the daemon cleanly: refuse logins, close connections, dump every
    /// changed LUN to its image, exit. Waits for the dump and reports it.
    Stop(SocketArgs),
    /// Restart in place (an upgrade, `systemctl reload`): check the binary on
    /// disk with the daemon's flags, then fence, dump, and execute it in the
    /// same process, which takes each LUN's memory over instead of reading
    /// the image. Refused, the daemon keeps serving and says why.
    Restart {
        /// Wait until the new program answers and report its LUNs.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Check a config file without starting: the first TOML syntax error, or
    /// every semantic error, each as FILE:LINE:COLUMN (the daemon runs the same
    /// check at start).
    CheckConfig {
        /// The file to check (the daemon reads /etc/ramslog/ramslog.toml by default).
        file: PathBuf,
    },
    /// Write the man page and shell completions into DIR (for packaging).
    #[command(hide = true)]
    GenerateDocs { dir: PathBuf },
    /// Release kept memory that no configured LUN claims (`status` lists
    /// it) from systemd's fd store, freeing its RAM. Its content is gone.
    DiscardKept {
        /// The NAA `status` shows (with or without `naa.`).
        naa: String,
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Take over kept memory held back at start for a writer that has
    /// ended since (`status` advises it): the daemon ends as after a crash,
    /// and systemd starts it again with its fd store.
    TakeOver {
        #[command(flatten)]
        socket: SocketArgs,
    },
    /// Accept a LUN whose content was lost as an empty device: new identity, ready.
    AcceptEmpty {
        /// Target IQN.
        target: String,
        /// LUN number.
        lun: u64,
        #[command(flatten)]
        socket: SocketArgs,
    },
}

#[derive(clap::Args)]
struct SocketArgs {
    /// State directory of the daemon (its control socket is inside).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Control socket path, if the daemon was given --control-socket.
    #[arg(long)]
    control_socket: Option<PathBuf>,
}

impl SocketArgs {
    /// The socket named by the flags; without flags, the one default whose
    /// daemon answers (the default state directory's, or an ephemeral one's).
    fn path(&self) -> Result<PathBuf, String> {
        if let Some(socket) = &self.control_socket {
            return Ok(socket.clone());
        }
        if let Some(dir) = &self.state_dir {
            return Ok(dir.join("control.sock"));
        }
        // A socket file alone proves nothing (a killed daemon leaves one):
        // ask which daemons answer.
        let candidates = default_control_sockets();
        let answer = |p: &Path| std::os::unix::net::UnixStream::connect(p).map(|_| ());
        let tried: Vec<_> = candidates.iter().map(|p| (p, answer(p))).collect();
        let answering: Vec<_> = tried.iter().filter(|(_, r)| r.is_ok()).collect();
        let names = |l: &[&(&PathBuf, std::io::Result<()>)]| {
            l.iter()
                .map(|(p, _)| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" and ")
        };
        match answering.as_slice() {
            [(one, _)] => Ok((*one).clone()),
            [] => {
                let denied = tried.iter().any(|(_, r)| {
                    r.as_ref()
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
                });
                Err(format!(
                    "no ramslog-target control socket answers at {}; is the daemon running?{} \
                     Point at it with --state-dir or --control-socket",
                    names(&tried.iter().collect::<Vec<_>>()),
                    if denied { " (permission denied: run this as root)" } else { "" }
                ))
            }
            several => Err(format!(
                "several ramslog-target daemons answer, at {}: choose one with --state-dir or --control-socket",
                names(several)
            )),        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // Before any other thread runs: it takes the handover's variable out of
    // the environment.
    let (inherited, stored) = match cli.cmd {
        None => {
            mark_kept_memory_on_faults();
            if let Err(e) = signals::block_stop_signals() {
                eprintln!("ramslog-target: cannot block the stop signals: {e}");
                return ExitCode::FAILURE;
            }
            (handover::inherited(), systemd::listened())
        }
        Some(_) => (Ok(None), Ok(Vec::new())),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ramslog-target: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.cmd {
        None => match rt.block_on(run(cli.run, inherited, stored)) {
            Err(Failure::DumpFailed(msg)) => {
                eprintln!("ramslog-target: {msg}");
                return ExitCode::from(EXIT_DUMP_FAILED);
            }
            Err(Failure::Other(msg)) => Err(msg),
            Ok(()) => Ok(()),
        },
        Some(Cmd::Status { json, socket }) => rt.block_on(status(socket, json)),
        Some(Cmd::Stop(s)) => rt.block_on(stop(s)),
        Some(Cmd::Restart { wait, socket }) => rt.block_on(restart(socket, wait)),
        Some(Cmd::CheckConfig { file }) => check_config(&file),
        Some(Cmd::GenerateDocs { dir }) => generate_docs(&dir),
        Some(Cmd::AcceptEmpty {
            target,
            lun,
            socket,
        }) => rt.block_on(accept_empty(target, lun, socket)),
        Some(Cmd::DiscardKept { naa, socket }) => rt.block_on(discard_kept(naa, socket)),
        Some(Cmd::TakeOver { socket }) => rt.block_on(take_over(socket)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("ramslog-target: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// A panic anywhere, or a fault signal, marks every kept-memory record
/// before the process goes on (a panic in a connection's task ends only
/// that connection) or dies: a successor after a crash then does not serve
/// memory its writer may have damaged. A planned restart clears the mark:
/// the living process vouches for the memory it hands on.
fn mark_kept_memory_on_faults() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        ramslog_target::store::mark_faults(ramslog_target::store::PANIC_CAUSE);
        report(info);
    }));
    if let Err(e) = ramslog_target::store::install_fault_handlers() {
        tracing::warn!(
            "cannot install the fault-signal handlers ({e}): a crash by SIGSEGV, SIGBUS, \
             SIGILL, SIGABRT, SIGFPE or SIGSYS is judged as a kill -9"
        );
    }
}

/// Test builds only: with `RAMSLOG_TEST_ABORT_ON_HANGUP` set, a SIGHUP
/// aborts the process where it stands (`std::process::abort`, the path of
/// glibc's heap-corruption checks and of Rust's allocation failure), which
/// `kill -ABRT` from outside does not take.
#[cfg(debug_assertions)]
fn abort_on_hangup_if_asked() {
    if std::env::var_os("RAMSLOG_TEST_ABORT_ON_HANGUP").is_some() {
        std::process::abort();
    }
}

async fn status(s: SocketArgs, json: bool) -> Result<(), String> {
    match control::request(&s.path()?, &Request::Status).await? {
        Reply::Status(st) if json => {
            let text = serde_json::to_string_pretty(&st).map_err(|e| e.to_string())?;
            print_stdout(&(text + "\n"))
        }
        Reply::Status(st) => {
            let mut out = format!(
                "state directory: {}\n",
                st.state_dir.as_deref().unwrap_or("(none: --ephemeral)")
            );
            if st.state_dir.is_some() && !st.kept_memory.is_empty() {
                out += &format!("kept memory: {}\n", st.kept_memory);
            }
            if let Some(f) = &st.failed_stop {
                out += &format!(
                    "last stop: its dump failed at unix time {}: {} (the LUNs it did not save are NOT READY)\n",
                    f.at_unix, f.reason
                );
            }
            if let Some(f) = &st.failed_restart {
                out += &format!(
                    "last restart: failed at unix time {} ({} so far): {}; the daemon serves on\n",
                    f.at_unix, f.count, f.reason
                );
            }
            for t in &st.targets {
                out += &format!("target {}\n", t.name);
                for l in &t.luns {
                    let state = if l.ready {
                        "ready".to_string()
                    } else {
                        format!(
                            "NOT READY: {}; {}",
                            l.not_ready_reason.as_deref().unwrap_or("content lost"),
                            l.not_ready_advice.as_deref().unwrap_or(
                                "run accept-empty once ZFS no longer uses this half, then zpool replace"
                            )
                        )
                    };
                    out += &format!(
                        "  LUN {}  {} bytes, {}-byte blocks  naa.{}  serial {}  {}\n",
                        l.lun, l.size, l.block_size, l.naa, l.serial, state
                    );
                    out += &format!(
                        "    generation {}  written {} bytes (the next dump)\n",
                        l.generation, l.written_bytes
                    );
                    match (&l.previous_writer, &l.restored_from, l.restored_taken_unix) {
                        (Some(w), _, Some(taken)) => {
                            out += &format!(
                                "    restored from the memory kept from the previous run (taken over at unix \
                                 time {taken}): its writer, process {}, {}\n",
                                w.pid, w.ended
                            );
                        }
                        (None, Some(from), Some(taken)) => {
                            out +=
                                &format!("    restored from {from} (taken at unix time {taken})\n");
                        }
                        _ => {}
                    }
                    if !l.next_start.is_empty() {
                        out += &format!("    next start: {}\n", l.next_start);
                    }
                    let pr = &l.persistent_reservations;
                    if pr.registrations > 0 || pr.aptpl {
                        out += &format!(
                            "    persistent reservations: {} registration(s), {}; {}\n",
                            pr.registrations,
                            pr.reservation_type
                                .map_or("none held".into(), |t| format!("type {t} held")),
                            if pr.aptpl {
                                "APTPL: kept through a stop and a start (in the image)"
                            } else {
                                "no APTPL: kept through a restart or a crash with kept memory, dropped by a stop"
                            }
                        );
                    }
                    for k in l.io.kinds.iter().filter(|k| k.commands > 0) {
                        let at_most = |v: Option<f64>| v.map_or("-".into(), |v| format!("≤{v} µs"));
                        out += &format!(
                            "    {:<5} {} commands, {} bytes, service time p50 {} p99 {}\n",
                            k.kind,
                            k.commands,
                            k.bytes,
                            at_most(k.service_time_p50_micros_at_most),
                            at_most(k.service_time_p99_micros_at_most),
                        );
                    }
                    for e in &l.io.errors {
                        out += &format!("    errors: {} {} × {}\n", e.status, e.sense_key, e.count);
                    }
                }
            }
            for u in &st.unclaimed_kept {
                out += &format!(
                    "kept memory naa.{} claimed by no configured LUN ({}): held in systemd's fd store, not served; configure its LUN again or run discard-kept {}\n",
                    u.naa, u.what, u.naa
                );
            }
            let p = &st.portal;
            out += &format!(
                "connections: {} TCP, {} iSER; staging {} bytes; locked memory {} bytes, pinned for RDMA {} bytes, resident {} bytes\n",
                p.tcp_connections,
                p.iser_connections,
                p.staging_bytes,
                st.process.locked_bytes,
                st.process.pinned_bytes,
                st.process.resident_bytes
            );
            for (why, n) in p.logins_refused.iter().filter(|(_, n)| **n > 0) {
                out += &format!("logins refused ({why}): {n}\n");
            }
            for (limit, n) in p.limit_hits.iter().filter(|(_, n)| **n > 0) {
                out += &format!("limit hit ({limit}): {n}\n");
            }
            out += &format!("sessions: {}\n", st.sessions.len());
            for s in &st.sessions {
                out += &format!(
                    "  {} isid {} tsih {} from {} -> {}\n",
                    s.initiator, s.isid, s.tsih, s.peer, s.target
                );
            }
            print_stdout(&out)
        }
        Reply::Error(e) => Err(e),
        other => Err(format!("unexpected reply: {other:?}")),
    }
}

/// The man page and completions come from the clap definitions, so they
/// cannot drift from the flags.
fn generate_docs(dir: &Path) -> Result<(), String> {
    use clap::CommandFactory;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let man = dir.join("ramslog-target.8");
    let mut page = Vec::new();
    clap_mangen::Man::new(Cli::command())
        .section("8")
        .render(&mut page)
        .map_err(|e| format!("man page: {e}"))?;
    std::fs::write(&man, page).map_err(|e| format!("{}: {e}", man.display()))?;
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        clap_complete::generate_to(shell, &mut Cli::command(), "ramslog-target", dir)
            .map_err(|e| format!("{shell} completions: {e}"))?;
    }
    print_stdout(&format!("man page and completions in {}\n", dir.display()))
}

fn check_config(file: &Path) -> Result<(), String> {
    match check_file(file) {
        Ok(()) => print_stdout(&format!("{}: no problems found\n", file.display())),
        Err(ConfigError::File { problems, .. }) => {
            eprintln!("{}", Problem::list(file, &problems));
            let n = problems.len();
            Err(format!(
                "{n} problem{} in {}",
                if n == 1 { "" } else { "s" },
                file.display()
            ))
        }
        Err(e) => Err(e.to_string()),
    }
}

async fn stop(s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path()?, &Request::Stop).await? {
        Reply::Stopped(msg) => print_stdout(&format!("stopped: {msg}\n")),
        Reply::Error(e) => Err(e),
        other => Err(format!("unexpected reply: {other:?}")),
    }
}

/// How long `restart --wait` waits for the new program to answer while
/// nothing moves: the daemon's process lives but no image byte is written
/// and no new program answers (a dump of a large LUN takes as long as it
/// takes, and each byte it writes is progress).
const RESTART_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

async fn restart(s: SocketArgs, wait: bool) -> Result<(), String> {
    let path = s.path()?;
    let incarnation = |reply| match reply {
        Ok(Ok(Reply::Status(st))) => Some(st),
        _ => None,
    };
    let ask = |req| {
        let path = path.clone();
        async move {
            tokio::time::timeout(
                std::time::Duration::from_secs(5),
                control::request(&path, &req),
            )
            .await
        }
    };
    // The daemon's process, watched from its first answer: the pid stays
    // across the restart's exec, so its end is the restart's failure.
    let (before, daemon) = match tokio::time::timeout(
        std::time::Duration::from_secs(5),
        control::request_with_pidfd(&path, &Request::Status),
    )
    .await
    {
        Ok(Ok((Reply::Status(st), pidfd))) => (st, pidfd),
        _ => {
            return Err(format!(
                "the daemon at {} does not answer status",
                path.display()
            ))
        }
    };
    let started = std::time::Instant::now();
    match control::request(&path, &Request::Restart).await? {
        Reply::Restarting(msg) => print_stdout(&format!("restarting: {msg}\n"))?,
        Reply::Error(e) => return Err(e),
        other => return Err(format!("unexpected reply: {other:?}")),
    }
    if !wait {
        return Ok(());
    }
    let mut progress = (std::time::Instant::now(), before.bytes_dumped);
    while progress.0.elapsed() < RESTART_WAIT {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        if ramslog_target::volume::kept::pidfd_ended(&daemon) {
            return Err(format!(
                "the daemon ended during the restart (its new program did not come up): see its \
                 log (journalctl -u ramslog-target); its next start takes the LUN memory from the \
                 fd store or the images ({:.2} s after the request)",
                started.elapsed().as_secs_f64()
            ));
        }
        let Some(now) = incarnation(ask(Request::Status).await) else {
            continue;
        };
        if now.bytes_dumped != progress.1 {
            progress = (std::time::Instant::now(), now.bytes_dumped);
        }
        if now.incarnation == before.incarnation {
            match &now.failed_restart {
                Some(f) if now.failed_restart != before.failed_restart => {
                    return Err(format!(
                        "the restart failed; the daemon serves on: {}",
                        f.reason
                    ))
                }
                _ => continue,
            }
        }
        let luns: Vec<_> = now.targets.iter().flat_map(|t| &t.luns).collect();
        let ready = luns.iter().filter(|l| l.ready).count();
        let kept = luns
            .iter()
            .filter(|l| l.restored_from.as_deref() == Some(control::KEPT_MEMORY))
            .count();
        return print_stdout(&format!(
            "restarted in {:.2} s: {ready} of {} LUNs ready, {kept} kept in memory\n",
            started.elapsed().as_secs_f64(),
            luns.len()
        ));
    }
    Err(format!(
        "no new program answered at {} and nothing was dumped for {RESTART_WAIT:?}; see the \
         daemon's log",
        path.display()
    ))
}

async fn accept_empty(target: String, lun: u64, s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path()?, &Request::AcceptEmpty { target, lun }).await? {
        Reply::Accepted {
            target,
            lun,
            naa,
            serial,
        } => print_stdout(&format!(
            "{target} LUN {lun} accepted as empty: new identity naa.{naa} serial {serial}; it is ready\n"
        )),
        Reply::Error(e) => Err(e),
        other => Err(format!("unexpected reply: {other:?}")),
    }
}

async fn take_over(s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path()?, &Request::TakeOver).await? {
        Reply::TakingOver(msg) => print_stdout(&format!("{msg}\n")),
        Reply::Error(e) => Err(e),
        other => Err(format!("unexpected reply: {other:?}")),
    }
}

async fn discard_kept(naa: String, s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path()?, &Request::DiscardKept { naa }).await? {
        Reply::Discarded(msg) => print_stdout(&format!("{msg}\n")),
        Reply::Error(e) => Err(e),
        other => Err(format!("unexpected reply: {other:?}")),
    }
}

/// `--kept-memory=off`: what systemd's fd store kept from an earlier run
/// goes (the LUNs come from their images, or are NOT READY where no image
/// is current), so that no RAM stays held for memory never used.
fn release_stored(
    stored: Vec<(String, std::os::fd::OwnedFd)>,
) -> Vec<(String, std::os::fd::OwnedFd)> {
    if stored.is_empty() {
        return stored;
    }
    let names: std::collections::BTreeSet<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
    for name in &names {
        if let Err(e) = systemd::remove(name) {
            tracing::warn!("cannot remove {name} from systemd's fd store: {e}");
        }
    }
    tracing::warn!(
        descriptors = stored.len(),
        "--kept-memory=off: released the LUN memory systemd's fd store kept from the previous run; \
         each LUN comes from its image, or is NOT READY where no image is current"
    );
    Vec::new()
}

/// Subcommand output goes to scripts (`status | grep -q ready`): a reader
/// that stops early is not an error, and nothing may panic on it.
fn print_stdout(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write to standard output: {e}"))
        }
        _ => Ok(()),
    }
}

async fn run(
    args: RunArgs,
    inherited: Result<Option<Inherited>, String>,
    stored: Result<Vec<(String, std::os::fd::OwnedFd)>, String>,
) -> Result<(), Failure> {
    let cfg = Config::load(&args).map_err(|e| e.to_string())?;
    if args.handover_check {
        let report =
            serde_json::to_string(&handover::Report::of(&cfg)).map_err(|e| e.to_string())?;
        print_stdout(&format!("{report}\n"))?;
        return Ok(());
    }
    // What a restart executes again: this binary's path (the file there then,
    // after an upgrade the new one) with these arguments.
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    // A file renamed over the path after this program was opened (an
    // upgrade mid-restart) leaves "(deleted)" on the running one: the next
    // restart runs the path.
    let exe = match exe.to_str().and_then(|p| p.strip_suffix(" (deleted)")) {
        Some(path) => std::path::PathBuf::from(path),
        None => exe,
    };
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let inherited = inherited.unwrap_or_else(|e| {
        tracing::error!(
            "the previous program's handover is unusable ({e}): starting as after a stop"
        );
        None
    });
    let stored = stored.unwrap_or_else(|e| {
        tracing::error!("what systemd passed at start is unusable ({e}): no kept memory is used");
        Vec::new()
    });
    let stored = if cfg.kept_memory {
        stored
    } else {
        systemd::turn_kept_memory_off();
        release_stored(stored)
    };
    let restarted = inherited.is_some();
    let (kept, inherited_listeners, inherited_lock) = match inherited {
        Some(i) => {
            tracing::info!(
                luns = i.volumes.len(),
                "started by a restart: taking over the memory handed on"
            );
            (
                Some(KeptMemory::handed(i.token, i.volumes, i.rdma_descriptors)),
                i.listeners,
                i.state_lock,
            )
        }
        None => {
            if !stored.is_empty() {
                tracing::info!(
                    descriptors = stored.len(),
                    "systemd's fd store kept LUN memory from the previous run"
                );
            }
            (
                KeptMemory::stored(stored, handover::rdma_descriptors()),
                Vec::new(),
                None,
            )
        }
    };
    if cfg.state_dir.is_none() {
        tracing::warn!(
            "--ephemeral: no state directory, every start is a first start with a new identity. \
             Unsafe as a ZFS log: use it for demos and tests only"
        );
    }
    // Read first (they were blocked before any thread started): a stop
    // during the restore must not kill the daemon half-way, and must not
    // dump (the image on disk is still the valid one). A stray SIGHUP (a
    // closed terminal, a `systemctl reload` or `kill -HUP` by habit) must
    // not take a log half down: nothing here is reloadable while serving,
    // so it is logged and otherwise ignored.
    let mut stops =
        signals::StopSignals::open().map_err(|e| format!("cannot read the stop signals: {e}"))?;
    ramslog_target::test_pause::here("signals");
    let hangup_ignored = || {
        #[cfg(debug_assertions)]
        abort_on_hangup_if_asked();
        tracing::warn!(
            "SIGHUP ignored: nothing to reload; stop with SIGTERM or `ramslog-target stop`"
        )
    };
    // A start after a crash under systemd whose last writer has not let go
    // of the state directory yet (a leader still ending, a straggler in D
    // state) waits for it instead of exiting: a unit that ends `failed`
    // loses systemd's fd store, and with it the kept memory. systemd's
    // timeout is kept away meanwhile, and `systemctl status` says why. A
    // stop meanwhile is honoured once the lock is had: the start-up is
    // finished and what must be saved is dumped.
    let from_store = !restarted && kept.is_some();
    let mut inherited_lock = inherited_lock;
    let mut stop_while_waiting = None;
    let mut waiting_since: Option<std::time::Instant> = None;
    let persistence = loop {
        match lifecycle::open_persistence(&cfg, inherited_lock.take()) {
            Ok(p) => break p,
            Err(lifecycle::OpenError::Locked(why)) if from_store => {
                let since = *waiting_since.get_or_insert_with(|| {
                    tracing::warn!(
                        "{why}: waiting for it (after a crash, the previous daemon may still be ending); \
                         the kept LUN memory is taken over once this start holds the lock"
                    );
                    std::time::Instant::now()
                });
                notify(&format!(
                    "STATUS=waiting {} s for the state directory's lock (another process holds it)\nEXTEND_TIMEOUT_USEC={}",
                    since.elapsed().as_secs(),
                    STOP_EXTENSION.as_micros()
                ));
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    s = stops.recv() => match s {
                        signals::StopSignal::Hangup => hangup_ignored(),
                        stop => {
                            tracing::info!("{}: stopping once the state directory's lock is had", stop.name());
                            stop_while_waiting = Some(stop.name());
                        }
                    },
                }
            }
            Err(e) => return Err(String::from(e).into()),
        }
    };
    if let Some(since) = waiting_since {
        tracing::info!(
            waited_s = since.elapsed().as_secs_f64(),
            "the state directory's lock is this start's"
        );
    }
    ramslog_target::test_pause::here("locked");
    if let Some(f) = persistence
        .as_ref()
        .and_then(|p| p.state().failed_stop().cloned())
    {
        tracing::warn!(
            "the last stop's dump failed (unix time {}): {}. The LUNs it did not save are NOT READY",
            f.at_unix,
            f.reason
        );
    }
    // A restarted program listens for iSER at once, before it takes over
    // the memory: hosts told to come back a second after the old program
    // dropped them (rdma::driver) then wait in the queue instead of being
    // refused (TCP's listening sockets were handed on, queue included).
    let iser_listening = if cfg.iser && restarted {
        ramslog_target::rdma::Listening::on(&cfg.listen)
    } else {
        None
    };
    notify("STATUS=restoring LUN content");
    let cancelled = Arc::new(AtomicBool::new(false));
    let mut opening = {
        let (cfg, persistence, cancelled) = (cfg.clone(), persistence.clone(), cancelled.clone());
        tokio::task::spawn_blocking(move || {
            lifecycle::open_volumes(&cfg, persistence.as_ref(), &cancelled, kept)
        })
    };
    let stop_signal = loop {
        if let Some(stop) = stop_while_waiting.take() {
            break Err(stop);
        }
        break tokio::select! {
            r = &mut opening => Ok(r),
            s = stops.recv() => match s {
                signals::StopSignal::Hangup => {
                    hangup_ignored();
                    continue;
                }
                stop => Err(stop.name()),
            },
        };
    };
    let opened = match stop_signal {
        Ok(opened) => opened,
        // A stop during start-up: restores under way stop (their images stay
        // the valid copies), the rest of the start-up is finished, and what
        // must be saved is dumped: memory taken over from a previous run may
        // be the only copy of its LUN.
        Err(signal) => {
            cancelled.store(true, Ordering::Release);
            tracing::info!("{signal} during start-up: finishing it, then stopping");
            let opened = opening
                .await
                .map_err(|e| format!("start-up failed: {e}"))??;
            let outcome = lifecycle::stop_in_start_up(&opened.volumes);
            record_stop(persistence.as_deref(), &outcome);
            return match outcome {
                Ok(summary) => {
                    tracing::info!("stopped during start-up: {summary}");
                    Ok(())
                }
                Err(msg) => Err(Failure::DumpFailed(format!(
                    "stopped during start-up, but the content was not saved: {msg}"
                ))),
            };
        }
    };
    let lifecycle::Opened { volumes, unclaimed } =
        opened.map_err(|e| format!("start-up failed: {e}"))??;
    let unclaimed = Arc::new(std::sync::Mutex::new(unclaimed));

    let mut targets = Vec::new();
    for warning in cfg.warnings() {
        tracing::warn!("{warning}");
    }
    for t in &cfg.targets {
        let own = volumes.iter().filter(|v| v.target() == t.name).cloned();
        let scsi =
            ScsiTarget::try_new(own.collect()).map_err(|e| format!("target {}: {e}", t.name))?;
        let mut target = TargetDef::new(t.name.clone(), Arc::new(scsi));
        target.alias = t.alias.clone();
        target.acl = if t.open_access {
            Acl::Any
        } else {
            Acl::Only(t.allow.clone())
        };
        target.chap = t.chap.clone();
        target.mutual_chap = t.mutual_chap.clone();
        targets.push(target);
    }
    let exports = portal::lun_exports(&volumes);
    let mut core = Core::new(Arc::new(volumes), exports, cfg.core_limits.clone());
    core.service_times = cfg.metrics.is_some();
    if core.service_times {
        // Calibrate the TSC clock now, not on the first command's path.
        ramslog_target::metrics::clock();
    }
    let core = Arc::new(core);
    let mut portal = Portal::new(
        core.clone(),
        targets,
        cfg.limits.clone(),
        cfg.listen.clone(),
    );
    portal.discovery_chap = cfg.discovery_chap.clone();
    let portal = Arc::new(portal);
    let front_ends: Vec<Arc<dyn FrontEndView>> = vec![portal.clone()];

    let stop = Arc::new(tokio::sync::Notify::new());
    let (stopped_tx, stopped_rx) = tokio::sync::watch::channel(None);
    let (restart_tx, mut restart_rx) = tokio::sync::mpsc::channel::<RestartReply>(1);
    let control_failed_restart = Arc::new(std::sync::Mutex::new(None));
    let under_way = control::UnderWay::default();
    let stop_requested = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let control = Arc::new(Control {
            core: core.clone(),
            front_ends: front_ends.clone(),
            state_dir: cfg.state_dir.clone(),
            stop: stop.clone(),
            stopped: stopped_rx,
            restart: restart_tx,
            unclaimed: unclaimed.clone(),
            failed_restart: control_failed_restart.clone(),
            under_way: under_way.clone(),
            stop_requested: stop_requested.clone(),
        });
        let path = &cfg.control_socket;
        control::serve(path.clone(), control)
            .await
            .map_err(|e| format!("control socket {}: {e}", path.display()))?;
    }

    if let Some(addr) = cfg.metrics {
        ramslog_target::exposition::endpoint::serve(
            addr,
            cfg.metrics_allow.clone(),
            ramslog_target::exposition::Faces {
                core: core.clone(),
                front_ends: front_ends.clone(),
            },
        )
        .await
        .map_err(|e| format!("cannot serve metrics on {addr}: {e} (change --metrics)"))?;
    }
    // Every address is bound before any is served: a start that fails on
    // the second must not have accepted a host's write on the first. A
    // restart hands over the sockets it listened on (hosts' reconnects
    // waited in their queues meanwhile); the rest are closed.
    let mut inherited_listeners: Vec<std::net::TcpListener> =
        inherited_listeners.into_iter().map(Into::into).collect();
    let mut bound = Vec::new();
    for addr in &cfg.listen {
        let kept = inherited_listeners
            .iter()
            .position(|l| l.local_addr().ok() == Some(*addr))
            .map(|i| inherited_listeners.swap_remove(i));
        let listener = match kept {
            Some(l) => l
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(l)),
            None => tcp::listen(*addr),
        };
        bound.push(listener.map_err(|e| {
            format!("cannot listen on {addr}: {e} (is another target on that port? use --listen)")
        })?);
    }
    drop(inherited_listeners);
    // Second descriptors of the listening sockets: a restart aborts the
    // accept loops (which close theirs) and hands these on.
    let mut listener_fds = bound
        .iter()
        .map(|l| rustix::io::fcntl_dupfd_cloexec(l, 3))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot keep the listening sockets for a restart: {e}"))?;
    let mut tcp_listeners = Vec::new();
    for listener in bound {
        tracing::info!(
            "listening on {}",
            listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default()
        );
        tcp_listeners.push(tokio::spawn(tcp::serve(listener, portal.clone())));
    }
    ramslog_target::test_pause::here("listening");
    if cfg.iser {
        let opts = ramslog_target::rdma::IserOptions {
            spin: cfg.iser_spin,
        };
        match iser_listening {
            Some(listening) => listening.serve(portal.clone(), opts),
            None if restarted => {} // no RDMA device: logged at start-up
            None => ramslog_target::rdma::start(portal.clone(), &cfg.listen, opts),
        }
    }

    let running = handover::Report::of(&cfg);
    let failed_restart = control_failed_restart;
    notify("READY=1\nSTATUS=serving");
    // Serving; left for a stop, or for a planned restart whose exec
    // succeeded. One whose exec failed serves on.
    let (outcome, _stopping) = loop {
        let restart = loop {
            tokio::select! {
                s = stops.recv() => match s {
                    signals::StopSignal::Hangup => {
                        hangup_ignored();
                        continue;
                    }
                    stop => tracing::info!("{}: stopping", stop.name()),
                },
                _ = stop.notified() => tracing::info!("stop requested on the control socket"),
                Some(reply) = restart_rx.recv() => {
                    let restarting = match under_way.begin("restart") {
                        Ok(g) => g,
                        Err(why) => {
                            reply.answer(Err(why)).await;
                            continue;
                        }
                    };
                    // A stop asked for before the restart began comes first
                    // (one asked for later goes to the new program as a
                    // SIGTERM: Control::stop).
                    if stop_requested.load(Ordering::SeqCst) {
                        reply.answer(Err("a stop was requested: the restart is refused".into())).await;
                        drop(restarting);
                        tracing::info!("stop requested on the control socket");
                        break None;
                    }
                    // Checked while still serving: a refusal changes nothing.
                    let unclaimed_now = control::lock(&unclaimed).iter().map(|u| format!("naa.{}", u.naa)).collect::<Vec<_>>();
                    let checked = if persistence.is_none() {
                        Err("an --ephemeral target keeps nothing across a restart: stop and start it".into())
                    } else if !unclaimed_now.is_empty() {
                        // The new program could not list it: it would sit in
                        // the store out of sight until the next start.
                        Err(format!(
                            "kept memory no configured LUN claims is held ({}): configure its LUN again \
                             (then stop and start), or release it with `ramslog-target discard-kept NAA`",
                            unclaimed_now.join(", ")
                        ))
                    } else {
                        // Opened once: the file checked is the file executed.
                        let (exe, argv, running) = (exe.clone(), argv.clone(), running.clone());
                        tokio::task::spawn_blocking(move || {
                            let program = handover::NewProgram::open(&exe)?;
                            handover::check(&program, &argv, &running, std::time::Duration::from_secs(30))?;
                            Ok(program)
                        })
                        .await
                        .unwrap_or_else(|e| Err(format!("the handover check failed: {e}")))
                    };
                    match checked {
                        Ok(program) => {
                            // Between the check and the exec.
                            ramslog_target::test_pause::here("checked");
                            tracing::info!("restart requested: handing over to {}", exe.display());
                            break Some((reply, restarting, program));
                        }
                        Err(why) => {
                            tracing::warn!("restart refused, still serving: {why}");
                            reply.answer(Err(format!("restart refused, still serving: {why}"))).await;
                            continue;
                        }
                    }
                }
            }
            break None;
        };
        // A stop holds `under_way` from its fence to the exit; an
        // accept-empty or a discard-kept under way ends first.
        let stopping = match restart {
            Some(_) => None,
            None => loop {
                match under_way.begin("stop") {
                    Ok(g) => break Some(g),
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                }
            },
        };
        // A restart skips the dump when systemd's fd store holds every LUN's
        // memory and record and the writer's pidfd: a failure before the new
        // program has taken over then leaves the memory there for the next
        // start. Otherwise the image is made current first.
        let ending = match &restart {
            None => Ending::Stop,
            Some(_) => {
                let need = systemd::descriptors_kept(core.volumes.len());
                let unconfirmed = core.volumes.not_held_in_fd_store();
                let held = systemd::store_holds(need).and_then(|()| {
                    if unconfirmed.is_empty() {
                        Ok(())
                    } else {
                        Err(format!(
                            "the fd store is not confirmed to hold the memory of {}",
                            unconfirmed.join(", ")
                        ))
                    }
                });
                match held {
                    Ok(()) => Ending::Restart { dump: false },
                    Err(why) => {
                        tracing::info!("restart: dumping first ({why})");
                        Ending::Restart { dump: true }
                    }
                }
            }
        };
        notify(match ending {
            Ending::Restart { dump: false } => {
                "STATUS=restarting: fencing and handing over LUN memory"
            }
            Ending::Restart { dump: true } => {
                "STATUS=restarting: fencing, dumping and handing over LUN memory"
            }
            Ending::Stop => "STOPPING=1\nSTATUS=fencing and dumping LUN content",
        });
        // Close the listening sockets before anything else, so a host's reconnect
        // during the dump is refused by the kernel (a failure initiators retry)
        // instead of being accepted and dropped mid-login, which can wedge
        // open-iscsi's session for good. An aborted task's future, with its
        // listener, is dropped before its handle resolves.
        // A stop closes them for good; a restart keeps the second descriptors,
        // so that hosts' reconnects wait in the queue for the new program.
        if restart.is_none() {
            listener_fds.clear();
        }
        for listener in &tcp_listeners {
            listener.abort();
        }
        for listener in tcp_listeners.drain(..) {
            let _ = listener.await;
        }
        let outcome = {
            let core = core.clone();
            let mut shutdown =
                tokio::task::spawn_blocking(move || lifecycle::shutdown(&core, ending));
            // While the dump moves bytes, keep systemd's stop timeout at least
            // STOP_EXTENSION away, so a LUN larger than TimeoutStopSec planned
            // for is not killed mid-dump; a dump that stalls gets no more time.
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            let mut seen = None;
            loop {
                tokio::select! {
                    r = &mut shutdown => break r.unwrap_or_else(|e| Err(format!("shutdown failed: {e}"))),
                    _ = tick.tick() => {
                        let now = image::bytes_dumped();
                        if seen != Some(now) {
                            notify(&format!("EXTEND_TIMEOUT_USEC={}", STOP_EXTENSION.as_micros()));
                            seen = Some(now);
                        }
                    }
                }
            }
        };
        let Some((reply, _restarting, program)) = restart else {
            break (outcome, stopping);
        };
        // Returns only if the new program could not be executed: nothing was
        // lost (the memory is in place, and in the store or dumped), so this
        // program takes its LUNs back and serves on.
        let why = hand_over(
            &core,
            persistence.as_deref(),
            &listener_fds,
            outcome,
            reply,
            &program,
            &argv,
        )
        .await;
        tracing::error!("{why}: the restart is abandoned; serving on");
        for v in core.volumes.iter() {
            v.take_back();
        }
        core.gate.reopen();
        for fd in &listener_fds {
            let listener = rustix::io::fcntl_dupfd_cloexec(fd, 3)
                .map_err(std::io::Error::from)
                .map(std::net::TcpListener::from)
                .and_then(|l| {
                    l.set_nonblocking(true)?;
                    tokio::net::TcpListener::from_std(l)
                });
            match listener {
                Ok(l) => tcp_listeners.push(tokio::spawn(tcp::serve(l, portal.clone()))),
                Err(e) => {
                    return Err(format!(
                        "{why}; and the listening socket cannot be served again ({e}): exiting"
                    )
                    .into())
                }
            }
        }
        {
            let mut failed = control::lock(&failed_restart);
            *failed = Some(control::FailedRestart {
                count: failed.as_ref().map_or(1, |f| f.count + 1),
                at_unix: ramslog_target::volume::now_unix(),
                reason: why,
            });
        }
        notify("READY=1\nSTATUS=serving (the last restart failed: see the log)");
    };
    record_stop(persistence.as_deref(), &outcome);
    let _ = stopped_tx.send(Some(outcome.clone()));
    // Let a waiting `ramslog-target stop` read its answer.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let _ = std::fs::remove_file(&cfg.control_socket);
    match outcome {
        Ok(_) => {
            tracing::info!("stopped cleanly");
            Ok(())
        }
        Err(msg) => Err(Failure::DumpFailed(format!(
            "stopped, but the content was not saved: {msg}"
        ))),
    }
}

/// Record in the state directory how a stop ended: a failed dump is shown
/// by `status` and the next start until a stop succeeds.
fn record_stop(
    persistence: Option<&ramslog_target::volume::Persistence>,
    outcome: &Result<String, String>,
) {
    if let Some(p) = persistence {
        let failed = outcome.as_ref().err().map(|reason| FailedStop {
            at_unix: ramslog_target::volume::now_unix(),
            reason: reason.clone(),
        });
        if let Err(e) = p.state().record_stop(failed) {
            tracing::error!("cannot record in the state directory how this stop ended: {e}");
        }
    }
}

/// The rest of a planned restart, after the fence and the dump: record each
/// READY volume's memory as handed over, let it and the listening sockets
/// and the state directory's lock cross `execve`, answer the requester and
/// execute the binary again. Returns only when that failed, with the
/// reason: every descriptor is closed on exec again, for the caller to
/// take the LUNs back and serve on.
async fn hand_over(
    core: &Core,
    persistence: Option<&ramslog_target::volume::Persistence>,
    listener_fds: &[std::os::fd::OwnedFd],
    dumped: Result<String, String>,
    reply: RestartReply,
    program: &handover::NewProgram,
    argv: &[std::ffi::OsString],
) -> String {
    let exe = program.path();
    use std::os::fd::{AsFd, AsRawFd};
    match &dumped {
        Ok(msg) => tracing::info!("restart: {msg}"),
        // The memory still holds the content: handing it over keeps it,
        // exiting now would lose it.
        Err(msg) => tracing::error!(
            "restart: the dump failed ({msg}); handing the memory over, the only copy"
        ),
    }
    let token: u64 = rand::random();
    let mut handed = handover::Handed {
        token,
        ..Default::default()
    };
    let mut crossing: Vec<std::os::fd::BorrowedFd<'_>> = Vec::new();
    for v in core.volumes.iter() {
        match v.hand_over(token) {
            Ok(Some((memory, record))) => {
                handed
                    .volumes
                    .push((memory.as_raw_fd(), record.as_raw_fd()));
                crossing.extend([memory, record]);
            }
            Ok(None) => {
                tracing::warn!(target = %v.target(), lun = v.lun(), "not READY: its memory is not handed over; the new program starts it from its image")
            }
            // Its memory cannot go on: its image must be current before the
            // exec (a restart under the fd store did not dump), or there is
            // no restart.
            // (Blocking: the runtime is multi-threaded.)
            Err(e) => match tokio::task::block_in_place(|| v.dump(false)) {
                Ok(msg) => tracing::warn!(
                    target = %v.target(), lun = v.lun(),
                    "its memory cannot be handed over ({e}): dumped instead ({msg}); the new program restores it"
                ),
                Err(dump) => {
                    let why = format!(
                        "restart: {} LUN {}: its memory cannot be handed over ({e}) and its dump failed ({dump})",
                        v.target(),
                        v.lun()
                    );
                    reply.answer(Err(why.clone())).await;
                    return why;
                }
            },
        }
    }
    for fd in listener_fds {
        handed.listeners.push(fd.as_raw_fd());
        crossing.push(fd.as_fd());
    }
    // The state directory's lock, borrowed for a moment at a time: its
    // mutex is not held across the wait for the requester.
    let kept = crossing
        .iter()
        .try_for_each(|fd| handover::keep_across_exec(*fd).map(drop))
        .and_then(|()| {
            if let Some(p) = persistence {
                handed.state_lock = Some(handover::keep_across_exec(p.state().lock())?);
            }
            Ok(())
        });
    let failure = match kept {
        Err(e) => format!("restart: cannot pass a descriptor to the new program: {e}"),
        Ok(()) => {
            reply
                .answer(Ok(format!(
                    "{} of {} LUNs handed over in memory to {}",
                    handed.volumes.len(),
                    core.volumes.len(),
                    exe.display()
                )))
                .await;
            let err = handover::exec(program, argv, &handed);
            format!("restart: cannot execute {}: {err}", exe.display())
        }
    };
    let reclosed = crossing
        .into_iter()
        .try_for_each(handover::close_on_exec_again)
        .and_then(|()| {
            persistence.map_or(Ok(()), |p| handover::close_on_exec_again(p.state().lock()))
        });
    if let Err(e) = reclosed {
        tracing::warn!("a descriptor stays open across a later exec: {e}");
    }
    failure
}
