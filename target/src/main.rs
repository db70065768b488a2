//! `ramslog-target`: serve pinned RAM as a SCSI disk over iSCSI.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ramslog_target::config::{check_file, default_control_sockets, ConfigError, Problem, RunArgs};
use ramslog_target::control::{self, print_stdout, Reply, Request};
use ramslog_target::daemon;

/// The exit status of a stop whose dump failed (EX_IOERR). The unit names
/// it in RestartPreventExitStatus=: a stop that could not save the content
/// must not be undone by a restart that serves the LUNs NOT READY.
const EXIT_DUMP_FAILED: u8 = 74;

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
    let Some(cmd) = cli.cmd else {
        // The daemon. Prepared before any other thread runs: it takes the
        // handover's variable out of the environment.
        let prepared = match daemon::prepare() {
            Ok(p) => p,
            Err(e) => return failed(&e),
        };
        let rt = match runtime() {
            Ok(rt) => rt,
            Err(e) => return failed(&e),
        };
        return match rt.block_on(daemon::run(cli.run, prepared)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(daemon::Failure::DumpFailed(msg)) => {
                eprintln!("ramslog-target: {msg}");
                ExitCode::from(EXIT_DUMP_FAILED)
            }
            Err(daemon::Failure::Other(msg)) => failed(&msg),
        };
    };
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return failed(&e),
    };
    let result = match cmd {
        Cmd::Status { json, socket } => rt.block_on(status(socket, json)),
        Cmd::Stop(s) => rt.block_on(stop(s)),
        Cmd::Restart { wait, socket } => rt.block_on(restart(socket, wait)),
        Cmd::CheckConfig { file } => check_config(&file),
        Cmd::GenerateDocs { dir } => generate_docs(&dir),
        Cmd::AcceptEmpty {
            target,
            lun,
            socket,
        } => rt.block_on(accept_empty(target, lun, socket)),
        Cmd::DiscardKept { naa, socket } => rt.block_on(discard_kept(naa, socket)),
        Cmd::TakeOver { socket } => rt.block_on(take_over(socket)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => failed(&msg),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

fn failed(msg: &str) -> ExitCode {
    eprintln!("ramslog-target: {msg}");
    ExitCode::FAILURE
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
