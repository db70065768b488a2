//! The daemon's life, phase by phase. Each phase is a type that holds what
//! it needs and yields the next:
//!
//! ```text
//! Starting ─ lock ─▶ Locked ─ open ─▶ Serving ──▶ Fenced ─▶ exited (a stop)
//!     │                  │              ▲   │
//!     └ --handover-check └ stop:        │   └ restart: checking ─▶ Fenced ─▶ handing over ─▶ exec
//!       (prints, exits)    finish the   │                                          │
//!                          start, dump, └──────────── taken back (the exec failed) ┘
//!                          exit
//! ```
//!
//! `Starting` reads the configuration, what a restart handed on and what
//! systemd's fd store kept; `Locked` holds the state directory's lock
//! (waiting for it after a crash) and opens the volumes; `Serving` is every
//! front end, listener and face up, until a stop or a restart; `Fenced`
//! (`serving.rs`) is the volumes fenced and dumped where needed, on the
//! way out or across the hand-over (`restart.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::config::{Config, RunArgs};
use crate::handover::{self, Inherited};
use crate::lifecycle::{self, KeptMemory};
use crate::signals::{StopSignal, StopSignals};
use crate::systemd::{self, notify};
use crate::volume::state::FailedStop;
use crate::volume::Persistence;

mod restart;
mod serving;

pub use serving::Serving;

/// How far ahead of now systemd's stop timeout is kept while a dump makes
/// progress, or while a start waits for the state directory's lock.
const STOP_EXTENSION: std::time::Duration = std::time::Duration::from_secs(30);

/// What each front end advertises that a planned restart must not lower.
const ADVERTISED: &[&dyn crate::core::Advertised] = &[&crate::scsi::BlockLimitsAdvertised];

/// Why the daemon ended badly; the exit status says which.
#[derive(Debug)]
pub enum Failure {
    /// Anything that kept it from starting or serving.
    Other(String),
    /// A stop was asked for and a dump failed.
    DumpFailed(String),
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::Other(msg)
    }
}

/// What a start takes before any other thread runs: fault marking armed,
/// the stop signals blocked, what a restart handed on (its variable taken
/// out of the environment) and what systemd passed.
pub struct Prepared {
    pub inherited: Result<Option<Inherited>, String>,
    pub stored: Result<Vec<(String, std::os::fd::OwnedFd)>, String>,
}

/// Call first thing in `main`, before any thread exists.
pub fn prepare() -> Result<Prepared, String> {
    mark_kept_memory_on_faults();
    crate::signals::block_stop_signals()
        .map_err(|e| format!("cannot block the stop signals: {e}"))?;
    Ok(Prepared {
        inherited: handover::inherited(),
        stored: systemd::listened(),
    })
}

/// A panic anywhere, or a fault signal, marks every kept-memory record
/// before the process goes on (a panic in a connection's task ends only
/// that connection) or dies: a successor after a crash then does not serve
/// memory its writer may have damaged. A planned restart clears the mark:
/// the living process vouches for the memory it hands on.
fn mark_kept_memory_on_faults() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        crate::store::mark_faults(crate::store::PANIC_CAUSE);
        report(info);
    }));
    if let Err(e) = crate::store::install_fault_handlers() {
        tracing::warn!(
            "cannot install the fault-signal handlers ({e}): a crash by SIGSEGV, SIGBUS, \
             SIGILL, SIGABRT, SIGFPE or SIGSYS is judged as a kill -9"
        );
    }
}

/// Serve until stopped: the daemon's whole life.
pub async fn run(args: RunArgs, prepared: Prepared) -> Result<(), Failure> {
    let Some(starting) = Starting::new(args, prepared.inherited, prepared.stored)? else {
        return Ok(());
    };
    let locked = starting.lock().await?;
    let mut serving = match locked.open().await? {
        Opened::Ready(opened) => Serving::start(opened).await?,
        Opened::StoppedInStartUp => return Ok(()),
    };
    loop {
        match serving.until_stop_or_restart().await {
            serving::Next::Stop => {
                let outcome = serving.fence_for_stop().await;
                return serving.exit(outcome).await;
            }
            serving::Next::Restart(restart) => {
                // Returns only when the exec failed: the volumes are taken
                // back and served on.
                serving.restart(restart).await?;
            }
        }
    }
}

/// The first phase: the configuration read, what a restart handed on or
/// systemd's fd store kept sorted out, the stop signals open.
struct Starting {
    cfg: Config,
    /// What a restart executes again: this binary's path (the file there
    /// then, after an upgrade the new one) and these arguments.
    exe: std::path::PathBuf,
    argv: Vec<std::ffi::OsString>,
    kept: Option<KeptMemory>,
    inherited_listeners: Vec<std::os::fd::OwnedFd>,
    inherited_lock: Option<std::os::fd::OwnedFd>,
    /// Started by a planned restart (handed memory and listeners).
    restarted: bool,
    stops: StopSignals,
}

impl Starting {
    /// `None` for `--handover-check`, which only prints what this binary
    /// would serve.
    fn new(
        args: RunArgs,
        inherited: Result<Option<Inherited>, String>,
        stored: Result<Vec<(String, std::os::fd::OwnedFd)>, String>,
    ) -> Result<Option<Starting>, Failure> {
        let cfg = Config::load(&args).map_err(|e| e.to_string())?;
        if args.handover_check {
            let report = serde_json::to_string(&handover::Report::of(&cfg, ADVERTISED))
                .map_err(|e| e.to_string())?;
            crate::control::print_stdout(&format!("{report}\n"))?;
            return Ok(None);
        }
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
        // A file renamed over the path after this program was opened (an
        // upgrade mid-restart) leaves "(deleted)" on the running one: the
        // next restart runs the path.
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
            tracing::error!(
                "what systemd passed at start is unusable ({e}): no kept memory is used"
            );
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
        let stops =
            StopSignals::open().map_err(|e| format!("cannot read the stop signals: {e}"))?;
        crate::test_pause::here("signals");
        Ok(Some(Starting {
            cfg,
            exe,
            argv,
            kept,
            inherited_listeners,
            inherited_lock,
            restarted,
            stops,
        }))
    }

    /// Take the state directory's lock. A start after a crash under systemd
    /// whose last writer has not let go of it yet (a leader still ending, a
    /// straggler in D state) waits for it instead of exiting: a unit that
    /// ends `failed` loses systemd's fd store, and with it the kept memory.
    /// systemd's timeout is kept away meanwhile, and `systemctl status`
    /// says why. A stop meanwhile is honoured once the lock is had: the
    /// start-up is finished and what must be saved is dumped.
    async fn lock(mut self) -> Result<Locked, Failure> {
        let from_store = !self.restarted && self.kept.is_some();
        let mut stop_while_waiting = None;
        let mut waiting_since: Option<std::time::Instant> = None;
        let persistence = loop {
            match lifecycle::open_persistence(&self.cfg, self.inherited_lock.take()) {
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
                        s = self.stops.recv() => match s {
                            StopSignal::Hangup => hangup_ignored(),
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
        crate::test_pause::here("locked");
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
        Ok(Locked {
            starting: self,
            persistence,
            stop_while_waiting,
        })
    }
}

/// The state directory's lock is held: the volumes can be opened.
struct Locked {
    starting: Starting,
    persistence: Option<Arc<Persistence>>,
    /// A stop signal that came while the lock was awaited.
    stop_while_waiting: Option<&'static str>,
}

/// What opening the volumes came to.
enum Opened {
    Ready(Box<Ready>),
    /// A stop came during start-up; the start-up was finished and what had
    /// to be saved was dumped.
    StoppedInStartUp,
}

/// The volumes are open and restored: everything [`Serving::start`] needs.
pub(crate) struct Ready {
    starting: Starting,
    persistence: Option<Arc<Persistence>>,
    opened: lifecycle::Opened,
    iser_listening: Option<crate::rdma::Listening>,
}

impl Locked {
    /// Open and restore the volumes, off the runtime's workers. A stop
    /// during it: restores under way stop (their images stay the valid
    /// copies), the rest of the start-up is finished, and what must be
    /// saved is dumped: memory taken over from a previous run may be the
    /// only copy of its LUN.
    async fn open(self) -> Result<Opened, Failure> {
        let Locked {
            mut starting,
            persistence,
            mut stop_while_waiting,
        } = self;
        let cfg = &starting.cfg;
        // A restarted program listens for iSER at once, before it takes over
        // the memory: hosts told to come back a second after the old program
        // dropped them (the engine's restart notice) then wait in the queue
        // instead of being refused (TCP's listening sockets were handed on,
        // queue included).
        let iser_listening = if cfg.iser && starting.restarted {
            crate::rdma::Listening::on(&cfg.listen)
        } else {
            None
        };
        notify("STATUS=restoring LUN content");
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut opening = {
            let (cfg, persistence, cancelled) =
                (cfg.clone(), persistence.clone(), cancelled.clone());
            let kept = starting.kept.take();
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
                s = starting.stops.recv() => match s {
                    StopSignal::Hangup => {
                        hangup_ignored();
                        continue;
                    }
                    stop => Err(stop.name()),
                },
            };
        };
        let opened = match stop_signal {
            Ok(opened) => opened,
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
                        Ok(Opened::StoppedInStartUp)
                    }
                    Err(msg) => Err(Failure::DumpFailed(format!(
                        "stopped during start-up, but the content was not saved: {msg}"
                    ))),
                };
            }
        };
        let opened = opened.map_err(|e| format!("start-up failed: {e}"))??;
        Ok(Opened::Ready(Box::new(Ready {
            starting,
            persistence,
            opened,
            iser_listening,
        })))
    }
}

fn hangup_ignored() {
    #[cfg(debug_assertions)]
    abort_on_hangup_if_asked();
    tracing::warn!("SIGHUP ignored: nothing to reload; stop with SIGTERM or `ramslog-target stop`")
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

/// Record in the state directory how a stop ended: a failed dump is shown
/// by `status` and the next start until a stop succeeds.
fn record_stop(persistence: Option<&Persistence>, outcome: &Result<String, String>) {
    if let Some(p) = persistence {
        let failed = outcome.as_ref().err().map(|reason| FailedStop {
            at_unix: crate::volume::now_unix(),
            reason: reason.clone(),
        });
        if let Err(e) = p.state().record_stop(failed) {
            tracing::error!("cannot record in the state directory how this stop ended: {e}");
        }
    }
}
