//! The serving phase: every front end, listener and face up; left for a
//! stop, or for a planned restart (`restart.rs`). Both go through the fence:
//! logins refused, connections ended, volumes fenced and dumped where
//! needed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::control::{self, Control, FailedRestart, RestartReply, UnderWay, UnderWayGuard};
use crate::core::{Core, FrontEndView};
use crate::exposition::Faces;
use crate::handover;
use crate::iscsi::portal::{self, Acl, Portal, TargetDef};
use crate::lifecycle::{self, Ending, UnclaimedKept};
use crate::scsi::ScsiTarget;
use crate::signals::{StopSignal, StopSignals};
use crate::systemd::{self, notify};
use crate::tcp;
use crate::volume::{image, Persistence};

use super::{hangup_ignored, record_stop, Failure, Ready, ADVERTISED, STOP_EXTENSION};

/// How a spell of serving ended.
pub(super) enum Next {
    /// A stop signal, or `stop` on the control socket.
    Stop,
    /// A planned restart whose new program passed the check.
    Restart(Restart),
}

/// A planned restart, checked while still serving (a refusal changes
/// nothing): the requester waits for its answer, the operation is under
/// way, and the new program is open (the file checked is the file
/// executed).
pub(super) struct Restart {
    pub(super) reply: RestartReply,
    pub(super) _under_way: UnderWayGuard,
    pub(super) program: handover::NewProgram,
}

/// Serving: the core, iSCSI's portal, the control socket, the metrics
/// endpoint and the TCP listeners up.
pub struct Serving {
    pub(super) cfg: Config,
    pub(super) exe: std::path::PathBuf,
    pub(super) argv: Vec<std::ffi::OsString>,
    stops: StopSignals,
    pub(super) persistence: Option<Arc<Persistence>>,
    pub(super) core: Arc<Core>,
    pub(super) portal: Arc<Portal>,
    /// Asks for a stop from the control socket.
    stop: Arc<tokio::sync::Notify>,
    /// The stop's outcome, for a waiting `ramslog-target stop`.
    stopped: tokio::sync::watch::Sender<Option<Result<String, String>>>,
    restart_requests: tokio::sync::mpsc::Receiver<RestartReply>,
    unclaimed: Arc<Mutex<Vec<UnclaimedKept>>>,
    pub(super) failed_restart: Arc<Mutex<Option<FailedRestart>>>,
    under_way: UnderWay,
    stop_requested: Arc<AtomicBool>,
    /// What `--handover-check` of this binary says: what a new one must
    /// keep.
    running: handover::Report,
    /// Second descriptors of the listening sockets: a restart aborts the
    /// accept loops (which close theirs) and hands these on.
    pub(super) listener_fds: Vec<std::os::fd::OwnedFd>,
    pub(super) tcp_listeners: Vec<tokio::task::JoinHandle<()>>,
    /// A stop holds the operation from its fence to the exit.
    stopping: Option<UnderWayGuard>,
}

impl Serving {
    /// Bring every front end, face and listener up over the opened volumes.
    pub(super) async fn start(ready: Box<Ready>) -> Result<Serving, Failure> {
        let Ready {
            starting,
            persistence,
            opened,
            iser_listening,
        } = *ready;
        let super::Starting {
            cfg,
            exe,
            argv,
            inherited_listeners,
            restarted,
            stops,
            ..
        } = starting;
        let lifecycle::Opened { volumes, unclaimed } = opened;
        let unclaimed = Arc::new(Mutex::new(unclaimed));

        let mut targets = Vec::new();
        for warning in cfg.warnings() {
            tracing::warn!("{warning}");
        }
        for t in &cfg.targets {
            let own = volumes.iter().filter(|v| v.target() == t.name).cloned();
            let scsi = ScsiTarget::try_new(own.collect())
                .map_err(|e| format!("target {}: {e}", t.name))?;
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
            crate::metrics::clock();
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
        let (stopped, stopped_rx) = tokio::sync::watch::channel(None);
        let (restart_tx, restart_requests) = tokio::sync::mpsc::channel::<RestartReply>(1);
        let failed_restart = Arc::new(Mutex::new(None));
        let under_way = UnderWay::default();
        let stop_requested = Arc::new(AtomicBool::new(false));
        {
            let control = Arc::new(Control {
                core: core.clone(),
                front_ends: front_ends.clone(),
                state_dir: cfg.state_dir.clone(),
                stop: stop.clone(),
                stopped: stopped_rx,
                restart: restart_tx,
                unclaimed: unclaimed.clone(),
                failed_restart: failed_restart.clone(),
                under_way: under_way.clone(),
                stop_requested: stop_requested.clone(),
            });
            let path = &cfg.control_socket;
            control::serve(path.clone(), control)
                .await
                .map_err(|e| format!("control socket {}: {e}", path.display()))?;
        }

        if let Some(addr) = cfg.metrics {
            crate::exposition::endpoint::serve(
                addr,
                cfg.metrics_allow.clone(),
                Faces {
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
                format!(
                    "cannot listen on {addr}: {e} (is another target on that port? use --listen)"
                )
            })?);
        }
        drop(inherited_listeners);
        let listener_fds = bound
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
        crate::test_pause::here("listening");
        if cfg.iser {
            let opts = crate::rdma::IserOptions {
                spin: cfg.iser_spin,
            };
            match iser_listening {
                Some(listening) => listening.serve(portal.clone(), opts),
                None if restarted => {} // no RDMA device: logged at start-up
                None => crate::rdma::start(portal.clone(), &cfg.listen, opts),
            }
        }

        let running = handover::Report::of(&cfg, ADVERTISED);
        notify("READY=1\nSTATUS=serving");
        Ok(Serving {
            cfg,
            exe,
            argv,
            stops,
            persistence,
            core,
            portal,
            stop,
            stopped,
            restart_requests,
            unclaimed,
            failed_restart,
            under_way,
            stop_requested,
            running,
            listener_fds,
            tcp_listeners,
            stopping: None,
        })
    }

    /// Serve until a stop, or a planned restart that passed its check (one
    /// refused is answered and serving goes on).
    pub(super) async fn until_stop_or_restart(&mut self) -> Next {
        loop {
            tokio::select! {
                s = self.stops.recv() => match s {
                    StopSignal::Hangup => {
                        hangup_ignored();
                        continue;
                    }
                    stop => tracing::info!("{}: stopping", stop.name()),
                },
                _ = self.stop.notified() => tracing::info!("stop requested on the control socket"),
                Some(reply) = self.restart_requests.recv() => {
                    match self.check_restart(reply).await {
                        Some(Next::Restart(r)) => return Next::Restart(r),
                        Some(Next::Stop) => {}
                        None => continue,
                    }
                }
            }
            return Next::Stop;
        }
    }

    /// A restart request: `Some(Restart)` when the new program passed the
    /// check, `Some(Stop)` when a stop asked for before it comes first,
    /// `None` when it was refused (answered; serving goes on).
    async fn check_restart(&self, reply: RestartReply) -> Option<Next> {
        let restarting = match self.under_way.begin("restart") {
            Ok(g) => g,
            Err(why) => {
                reply.answer(Err(why)).await;
                return None;
            }
        };
        // A stop asked for before the restart began comes first (one asked
        // for later goes to the new program as a SIGTERM: Control::stop).
        if self.stop_requested.load(Ordering::SeqCst) {
            reply
                .answer(Err("a stop was requested: the restart is refused".into()))
                .await;
            drop(restarting);
            tracing::info!("stop requested on the control socket");
            return Some(Next::Stop);
        }
        // Checked while still serving: a refusal changes nothing.
        let unclaimed_now = control::lock(&self.unclaimed)
            .iter()
            .map(|u| format!("naa.{}", u.naa))
            .collect::<Vec<_>>();
        let checked = if self.persistence.is_none() {
            Err("an --ephemeral target keeps nothing across a restart: stop and start it".into())
        } else if !unclaimed_now.is_empty() {
            // The new program could not list it: it would sit in the store
            // out of sight until the next start.
            Err(format!(
                "kept memory no configured LUN claims is held ({}): configure its LUN again \
                 (then stop and start), or release it with `ramslog-target discard-kept NAA`",
                unclaimed_now.join(", ")
            ))
        } else {
            // Opened once: the file checked is the file executed.
            let (exe, argv, running) = (self.exe.clone(), self.argv.clone(), self.running.clone());
            tokio::task::spawn_blocking(move || {
                let program = handover::NewProgram::open(&exe)?;
                handover::check(
                    &program,
                    &argv,
                    &running,
                    ADVERTISED,
                    std::time::Duration::from_secs(30),
                )?;
                Ok(program)
            })
            .await
            .unwrap_or_else(|e| Err(format!("the handover check failed: {e}")))
        };
        match checked {
            Ok(program) => {
                // Between the check and the exec.
                crate::test_pause::here("checked");
                tracing::info!("restart requested: handing over to {}", self.exe.display());
                Some(Next::Restart(Restart {
                    reply,
                    _under_way: restarting,
                    program,
                }))
            }
            Err(why) => {
                tracing::warn!("restart refused, still serving: {why}");
                reply
                    .answer(Err(format!("restart refused, still serving: {why}")))
                    .await;
                None
            }
        }
    }

    /// A stop's fence: it holds `under_way` from here to the exit (an
    /// accept-empty or a discard-kept under way ends first); every changed
    /// volume is dumped.
    pub(super) async fn fence_for_stop(&mut self) -> Result<String, String> {
        let stopping = loop {
            match self.under_way.begin("stop") {
                Ok(g) => break g,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        };
        self.stopping = Some(stopping);
        self.fence(Ending::Stop).await
    }

    /// Refuse logins, close the listening sockets, end every connection,
    /// fence the volumes and dump what `ending` asks for.
    pub(super) async fn fence(&mut self, ending: Ending) -> Result<String, String> {
        notify(match ending {
            Ending::Restart { dump: false } => {
                "STATUS=restarting: fencing and handing over LUN memory"
            }
            Ending::Restart { dump: true } => {
                "STATUS=restarting: fencing, dumping and handing over LUN memory"
            }
            Ending::Stop => "STOPPING=1\nSTATUS=fencing and dumping LUN content",
        });
        // Close the listening sockets before anything else, so a host's
        // reconnect during the dump is refused by the kernel (a failure
        // initiators retry) instead of being accepted and dropped mid-login,
        // which can wedge open-iscsi's session for good. An aborted task's
        // future, with its listener, is dropped before its handle resolves.
        // A stop closes them for good; a restart keeps the second
        // descriptors, so that hosts' reconnects wait in the queue for the
        // new program.
        if ending == Ending::Stop {
            self.listener_fds.clear();
        }
        for listener in &self.tcp_listeners {
            listener.abort();
        }
        for listener in self.tcp_listeners.drain(..) {
            let _ = listener.await;
        }
        let core = self.core.clone();
        let mut shutdown = tokio::task::spawn_blocking(move || lifecycle::shutdown(&core, ending));
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
    }

    /// The end: the stop's outcome recorded and told to a waiting
    /// `ramslog-target stop`, the control socket removed.
    pub(super) async fn exit(self, outcome: Result<String, String>) -> Result<(), Failure> {
        record_stop(self.persistence.as_deref(), &outcome);
        let _ = self.stopped.send(Some(outcome.clone()));
        // Let a waiting `ramslog-target stop` read its answer.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let _ = std::fs::remove_file(&self.cfg.control_socket);
        drop(self.stopping);
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

    /// Whether systemd's fd store holds every LUN's memory and record and
    /// the writer's pidfd: a restart then skips the dump.
    pub(super) fn restart_ending(&self) -> Ending {
        let need = systemd::descriptors_kept(self.core.volumes.len());
        let unconfirmed = self.core.volumes.not_held_in_fd_store();
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
}
