//! A planned restart after its check: fenced (dumped first unless systemd's
//! fd store holds the memory), handed over across `execve`; or, when the
//! new program cannot be executed, taken back and served on.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use crate::control::{self, FailedRestart, RestartReply};
use crate::core::Core;
use crate::handover;
use crate::systemd::notify;
use crate::tcp;
use crate::volume::Persistence;

use super::serving::{Restart, Serving};
use super::Failure;

impl Serving {
    /// Fence, hand over and execute the new program. Returns only when the
    /// exec failed: nothing was lost (the memory is in place, and in the
    /// store or dumped), so the volumes are taken back and served on.
    pub(super) async fn restart(&mut self, restart: Restart) -> Result<(), Failure> {
        let ending = self.restart_ending();
        let dumped = self.fence(ending).await;
        let Restart {
            reply,
            _under_way,
            program,
        } = restart;
        let why = hand_over(
            &self.core,
            self.persistence.as_deref(),
            &self.listener_fds,
            dumped,
            reply,
            &program,
            &self.argv,
        )
        .await;
        tracing::error!("{why}: the restart is abandoned; serving on");
        self.take_back(why)
    }

    /// After a failed exec: every volume serves again, logins are let in,
    /// the kept listening sockets are served again, and `status` says why
    /// the restart failed.
    fn take_back(&mut self, why: String) -> Result<(), Failure> {
        for v in self.core.volumes.iter() {
            v.take_back();
        }
        self.core.gate.reopen();
        for fd in &self.listener_fds {
            let listener = rustix::io::fcntl_dupfd_cloexec(fd, 3)
                .map_err(std::io::Error::from)
                .map(std::net::TcpListener::from)
                .and_then(|l| {
                    l.set_nonblocking(true)?;
                    tokio::net::TcpListener::from_std(l)
                });
            match listener {
                Ok(l) => self
                    .tcp_listeners
                    .push(tokio::spawn(tcp::serve(l, self.portal.clone()))),
                Err(e) => {
                    return Err(format!(
                        "{why}; and the listening socket cannot be served again ({e}): exiting"
                    )
                    .into())
                }
            }
        }
        {
            let mut failed = control::lock(&self.failed_restart);
            *failed = Some(FailedRestart {
                count: failed.as_ref().map_or(1, |f| f.count + 1),
                at_unix: crate::volume::now_unix(),
                reason: why,
            });
        }
        notify("READY=1\nSTATUS=serving (the last restart failed: see the log)");
        Ok(())
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
    persistence: Option<&Persistence>,
    listener_fds: &[OwnedFd],
    dumped: Result<String, String>,
    reply: RestartReply,
    program: &handover::NewProgram,
    argv: &[std::ffi::OsString],
) -> String {
    let exe = program.path();
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
    let mut crossing: Vec<BorrowedFd<'_>> = Vec::new();
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
