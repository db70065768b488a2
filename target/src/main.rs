//! `ramslog-target`: serve pinned RAM as a SCSI disk over iSCSI.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::{Parser, Subcommand};
use ramslog_target::config::{Config, RunArgs, DEFAULT_STATE_DIR};
use ramslog_target::control::{self, Control, Reply, Request};
use ramslog_target::portal::{Acl, Portal, TargetDef};
use ramslog_target::scsi::{LuConfig, Readiness, ScsiTarget};
use ramslog_target::state::{naa_hex, Recall, StateDir};
use ramslog_target::store::Store;
use ramslog_target::tcp;

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
    /// Show targets, LUNs (identity, readiness) and sessions of the running daemon.
    Status(SocketArgs),
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
    fn path(&self) -> PathBuf {
        self.control_socket.clone().unwrap_or_else(|| {
            self.state_dir
                .clone()
                .unwrap_or_else(|| DEFAULT_STATE_DIR.into())
                .join("control.sock")
        })
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
        None => rt.block_on(run(cli.run)),
        Some(Cmd::Status(s)) => rt.block_on(status(s)),
        Some(Cmd::AcceptEmpty {
            target,
            lun,
            socket,
        }) => rt.block_on(accept_empty(target, lun, socket)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("ramslog-target: {msg}");
            ExitCode::FAILURE
        }
    }
}

async fn status(s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path(), &Request::Status).await? {
        Reply::Status(st) => {
            let mut out = format!(
                "state directory: {}\n",
                st.state_dir.as_deref().unwrap_or("(none: --ephemeral)")
            );
            for t in &st.targets {
                out += &format!("target {}\n", t.name);
                for l in &t.luns {
                    let state = if l.ready {
                        "ready"
                    } else {
                        "NOT READY: content lost, run accept-empty"
                    };
                    out += &format!(
                        "  LUN {}  {} bytes, {}-byte blocks  naa.{}  serial {}  {}\n",
                        l.lun, l.size, l.block_size, l.naa, l.serial, state
                    );
                }
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

async fn accept_empty(target: String, lun: u64, s: SocketArgs) -> Result<(), String> {
    match control::request(&s.path(), &Request::AcceptEmpty { target, lun }).await? {
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

async fn run(args: RunArgs) -> Result<(), String> {
    let cfg = Config::load(&args).map_err(|e| e.to_string())?;
    let mut state = match &cfg.state_dir {
        Some(dir) => Some(StateDir::open(dir).map_err(|e| e.to_string())?),
        None => {
            tracing::warn!(
                "--ephemeral: no state directory, every start is a first start with a new identity. \
                 Unsafe as a ZFS log: use it for demos and tests only"
            );
            None
        }
    };

    let mut targets = Vec::new();
    for t in &cfg.targets {
        let mut lus = Vec::new();
        for l in &t.luns {
            let store = Store::new(l.size, cfg.hugepages)
                .map_err(|e| format!("target {} LUN {}: {e}", t.name, l.lun))?;
            tracing::info!(target = %t.name, lun = l.lun, size = l.size, "LUN memory locked in RAM ({})", store.page_kind());
            let (identity, readiness) = match state.as_mut() {
                Some(s) => match s.recall(&t.name, l.lun).map_err(|e| e.to_string())? {
                    Recall::New(id) => {
                        tracing::info!(target = %t.name, lun = l.lun, naa = %naa_hex(&id.naa), serial = %id.serial, "new LUN identity");
                        (id, Readiness::Ready)
                    }
                    Recall::ContentLost(id) => {
                        tracing::warn!(
                            target = %t.name, lun = l.lun, naa = %naa_hex(&id.naa),
                            "LUN content did not survive the restart: it answers NOT READY (manual intervention \
                             required) until `ramslog-target accept-empty {} {}`",
                            t.name, l.lun
                        );
                        (id, Readiness::NeedsAcceptance)
                    }
                },
                None => (ramslog_target::scsi::Identity::generate(), Readiness::Ready),
            };
            lus.push((
                LuConfig {
                    lun: l.lun,
                    block_size: l.block_size,
                    identity,
                    readiness,
                },
                Arc::new(store),
            ));
        }
        if t.open_access && !cfg.listen.iter().all(|a| a.ip().is_loopback()) && t.chap.is_none() {
            tracing::warn!(target = %t.name, "--allow-any: any initiator that reaches this portal may write to the LUN");
        }
        targets.push(TargetDef {
            name: t.name.clone(),
            alias: t.alias.clone(),
            scsi: Arc::new(ScsiTarget::new(lus)),
            acl: if t.open_access {
                Acl::Any
            } else {
                Acl::Only(t.allow.clone())
            },
            chap: t.chap.clone(),
            mutual_chap: t.mutual_chap.clone(),
        });
    }
    let mut portal = Portal::new(targets, cfg.limits.clone(), cfg.listen.clone());
    portal.discovery_chap = cfg.discovery_chap.clone();
    let portal = Arc::new(portal);

    if let Some(path) = &cfg.control_socket {
        let control = Arc::new(Control {
            portal: portal.clone(),
            state: state.map(Mutex::new),
        });
        control::serve(path.clone(), control)
            .await
            .map_err(|e| format!("control socket {}: {e}", path.display()))?;
    }

    for addr in &cfg.listen {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            format!("cannot listen on {addr}: {e} (is another target on that port? use --listen)")
        })?;
        tracing::info!(
            "listening on {}",
            listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default()
        );
        tokio::spawn(tcp::serve(listener, portal.clone()));
    }
    if cfg.iser {
        ramslog_target::rdma::start(
            portal.clone(),
            &cfg.listen,
            ramslog_target::rdma::IserOptions {
                spin: cfg.iser_spin,
            },
        );
    }

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot install SIGTERM handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: closing sessions");
    portal.terminate_all();
    if let Some(path) = &cfg.control_socket {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
