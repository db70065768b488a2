//! The root-only control socket: `ramslog-target status`, `accept-empty`
//! and `stop`. One JSON request per line, one JSON reply.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use std::sync::{Mutex, MutexGuard, PoisonError};

mod client;
mod status;
pub use client::{print_stdout, request, request_with_pidfd};
pub use status::{
    FailedRestart, LunStatus, PortalStatus, PrStatus, PreviousWriter, SessionStatus, Status,
    TargetStatus,
};

use crate::admission::FrontEnd;
use crate::core::{Core, Export, FrontEndView, VolumeHooks};
use crate::lifecycle::UnclaimedKept;
use crate::metrics::{LimitHit, LoginRefusal, ProcessMemory};
use crate::volume::{naa_hex, Identity};
use status::{kept_memory_line, lun_status};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    Status,
    AcceptEmpty {
        target: String,
        lun: u64,
    },
    /// Fence, dump and exit; the reply comes when the dump is done.
    Stop,
    /// Hand the LUN memory over to the binary on disk, executed in this
    /// process; the reply comes when the handover starts (or was refused).
    Restart,
    /// Release kept memory no configured LUN claims from systemd's fd store.
    DiscardKept {
        naa: String,
    },
    /// Kept memory held back for a writer that has ended since: end as
    /// after a crash, so that systemd passes the fd store to the next start.
    TakeOver,
}

/// `restored_from` of a LUN whose content is the memory a restart kept.
pub use crate::volume::KEPT_MEMORY;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reply {
    Status(Box<Status>),
    Accepted {
        target: String,
        lun: u64,
        naa: String,
        serial: String,
    },
    Stopped(String),
    /// The handover to the new program began.
    Restarting(String),
    /// Unclaimed kept memory was released.
    Discarded(String),
    /// The daemon ends for a take-over.
    TakingOver(String),
    Error(String),
}

pub struct Control {
    pub core: Arc<Core>,
    /// Every front end: its sessions for `status`, its hooks for
    /// accept-empty.
    pub front_ends: Vec<Arc<dyn FrontEndView>>,
    pub state_dir: Option<PathBuf>,
    /// Asks the daemon to stop; the outcome of the dump comes back on
    /// `stopped`.
    pub stop: Arc<tokio::sync::Notify>,
    pub stopped: tokio::sync::watch::Receiver<Option<Result<String, String>>>,
    /// Asks the daemon for a planned restart; it answers on the sender it
    /// is given when the handover starts, or why it refused.
    pub restart: tokio::sync::mpsc::Sender<RestartReply>,
    /// Kept memory no configured LUN claimed at start.
    pub unclaimed: Arc<Mutex<Vec<UnclaimedKept>>>,
    /// Why the last planned restart failed after the fence, if it did.
    pub failed_restart: Arc<Mutex<Option<FailedRestart>>>,
    /// The administrative operation under way.
    pub under_way: UnderWay,
    /// A stop was asked for on this socket: a restart that begins from
    /// then on gives way to it.
    pub stop_requested: Arc<std::sync::atomic::AtomicBool>,
}

/// The one administrative operation that changes what the LUNs hold or
/// who holds them (an accept-empty, a discard-kept, a restart, a stop's
/// dump) under way, if any: two at once could, say, hand over a LUN half
/// given a new identity.
#[derive(Clone, Default)]
pub struct UnderWay(Arc<Mutex<Option<&'static str>>>);

/// [`UnderWay`] taken for one operation, until dropped.
pub struct UnderWayGuard(Arc<Mutex<Option<&'static str>>>);

impl UnderWay {
    /// Begin `what`, or say which operation is under way.
    pub fn begin(&self, what: &'static str) -> Result<UnderWayGuard, String> {
        let mut now = lock(&self.0);
        match *now {
            Some(other) => Err(format!(
                "{other} is under way: {what} is refused; try again once it is done"
            )),
            None => {
                *now = Some(what);
                Ok(UnderWayGuard(self.0.clone()))
            }
        }
    }

    /// The operation under way, if any.
    pub fn now(&self) -> Option<&'static str> {
        *lock(&self.0)
    }
}

impl Drop for UnderWayGuard {
    fn drop(&mut self) {
        *lock(&self.0) = None;
    }
}

/// What a control's shared value holds, even after a panic elsewhere held
/// the lock.
pub fn lock<T>(shared: &Mutex<T>) -> MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One restart request, as the daemon sees it.
pub struct RestartReply {
    answer: tokio::sync::oneshot::Sender<Result<String, String>>,
    delivered: tokio::sync::oneshot::Receiver<()>,
}

impl RestartReply {
    /// Answer the requester, and for an `Ok` wait (bounded) until the
    /// answer is written to its socket: the program that executes next
    /// cannot write it any more.
    pub async fn answer(self, result: Result<String, String>) {
        let wait = result.is_ok();
        if self.answer.send(result).is_ok() && wait {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), self.delivered).await;
        }
    }
}

impl Control {
    pub fn handle(&self, req: Request) -> Reply {
        match req {
            Request::Status => Reply::Status(Box::new(self.status())),
            Request::AcceptEmpty { target, lun } => self.accept_empty(&target, lun),
            Request::Stop => Reply::Error("stop is answered when the dump is done".into()),
            Request::Restart => Reply::Error("restart is answered when the handover starts".into()),
            Request::DiscardKept { naa } => self.discard_kept(&naa),
            Request::TakeOver => {
                Reply::Error("take-over is answered on its connection, then the daemon ends".into())
            }
        }
    }

    /// Ask the daemon for a planned restart and wait until it begins; the
    /// sender is to be told once the reply is written.
    async fn restart(&self) -> (Reply, tokio::sync::oneshot::Sender<()>) {
        let (answer, rx) = tokio::sync::oneshot::channel();
        let (written, delivered) = tokio::sync::oneshot::channel();
        let reply = if let Some(other) = self.under_way.now() {
            Reply::Error(format!(
                "{other} is under way: the restart is refused; try again once it is done"
            ))
        } else if self
            .restart
            .try_send(RestartReply { answer, delivered })
            .is_err()
        {
            Reply::Error(
                "a restart or a stop is already under way; see `ramslog-target status`".into(),
            )
        } else {
            match rx.await {
                Ok(Ok(msg)) => Reply::Restarting(msg),
                Ok(Err(msg)) => Reply::Error(msg),
                Err(_) => Reply::Error("the daemon is stopping; it did not restart".into()),
            }
        };
        (reply, written)
    }

    /// Ask the daemon to stop and wait for the dump's outcome.
    async fn stop(&self) -> Reply {
        self.stop_requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if self.under_way.now() == Some("restart") {
            // The serving loop is handing over and reads no request before
            // the exec. A SIGTERM is blocked in every thread and stays
            // pending across the exec (or for this program, if the exec
            // fails): the program that reads it takes the memory over,
            // dumps it and exits.
            let pid = rustix::process::getpid();
            return match rustix::process::kill_process(pid, rustix::process::Signal::TERM) {
                Ok(()) => Reply::Error(
                    "a restart is under way: this stop is passed on to the program it starts, \
                     which takes the LUN memory over, dumps it and exits; `ramslog-target stop` \
                     again waits for that"
                        .into(),
                ),
                Err(e) => Reply::Error(format!(
                    "a restart is under way and this stop could not be passed on ({e}): stop \
                     again once it is done"
                )),
            };
        }
        self.stop.notify_one();
        let mut rx = self.stopped.clone();
        let outcome = rx.wait_for(Option::is_some).await.map(|v| v.clone());
        match outcome {
            Ok(Some(Ok(msg))) => Reply::Stopped(msg),
            Ok(Some(Err(msg))) => Reply::Error(format!("stopped, but: {msg}")),
            _ => Reply::Error("the daemon ended without reporting its dump".into()),
        }
    }

    fn status(&self) -> Status {
        let mut targets: Vec<TargetStatus> = Vec::new();
        for (v, exports) in self.core.exported() {
            let facts = v.facts();
            for e in exports.iter().filter(|e| e.front_end == FrontEnd::Iscsi) {
                let lun = lun_status(e.unit, &facts);
                match targets.iter_mut().find(|t| t.name == e.owner) {
                    Some(t) => t.luns.push(lun),
                    None => targets.push(TargetStatus {
                        name: e.owner.clone(),
                        luns: vec![lun],
                    }),
                }
            }
        }
        let sessions = self
            .front_ends
            .iter()
            .flat_map(|f| f.sessions())
            .map(|s| SessionStatus {
                initiator: s.host,
                isid: s.instance,
                target: s.owner,
                tsih: s.handle,
                peer: s.peer.to_string(),
            })
            .collect();
        let state_dir = self.state_dir.as_ref().map(|d| d.display().to_string());
        let counters = &self.core.counters;
        let open = self.core.gate.counts_now();
        let portal = PortalStatus {
            tcp_connections: open.tcp(),
            iser_connections: open.rdma,
            front_end_connections: FrontEnd::ALL
                .into_iter()
                .map(|f| (f.label().to_string(), open.of(f)))
                .collect(),
            staging_bytes: self.core.staging.used(),
            logins_refused: LoginRefusal::ALL
                .into_iter()
                .map(|r| (r.label().to_string(), counters.logins_refused(r)))
                .collect(),
            limit_hits: LimitHit::ALL
                .into_iter()
                .map(|h| (h.label().to_string(), counters.limit_hits(h)))
                .collect(),
        };
        Status {
            state_dir,
            targets,
            sessions,
            portal,
            process: ProcessMemory::now(),
            incarnation: crate::volume::kept::this_process().incarnation,
            bytes_dumped: crate::volume::image::bytes_dumped(),
            failed_stop: self
                .core
                .volumes
                .iter()
                .find_map(|v| v.persistence())
                .and_then(|p| p.state().failed_stop().cloned()),
            unclaimed_kept: lock(&self.unclaimed).clone(),
            kept_memory: kept_memory_line(&self.core.volumes),
            failed_restart: lock(&self.failed_restart).clone(),
        }
    }

    fn discard_kept(&self, naa: &str) -> Reply {
        let _one_at_a_time = match self.under_way.begin("discard-kept") {
            Ok(g) => g,
            Err(why) => return Reply::Error(why),
        };
        let wanted = naa.trim_start_matches("naa.").to_ascii_lowercase();
        let configured = self.core.exported().find_map(|(v, exports)| {
            let e = exports.first()?;
            (naa_hex(&v.status().identity.naa) == wanted).then(|| (e.owner.clone(), e.unit))
        });
        if let Some((target, lun)) = configured {
            return Reply::Error(format!(
                "naa.{wanted} is {target} LUN {lun}: its memory is that LUN's content, not \
                 unclaimed. A LUN whose content is not wanted is started afresh with \
                 `ramslog-target accept-empty {target} {lun}` once it is NOT READY"
            ));
        }
        match crate::lifecycle::discard_unclaimed(&mut lock(&self.unclaimed), &wanted) {
            Ok(msg) => Reply::Discarded(msg),
            Err(e) => Reply::Error(e),
        }
    }

    /// A LUN whose kept memory was held back at start because its writer
    /// still ran, that writer now ended: the memory is in systemd's fd
    /// store, and only a start is given the store. So the daemon ends the
    /// way a crash does (SIGKILL: no dump, no clean exit, which would make
    /// systemd 252 empty the store), and systemd's Restart= starts it again
    /// with the store; that start judges the memory anew and takes it over.
    /// Refused unless every READY LUN's memory is confirmed in the store
    /// (it would be lost), and while another operation is under way.
    fn take_over(&self) -> (Reply, Option<UnderWayGuard>) {
        let refuse = |why: String| (Reply::Error(why), None);
        let one_at_a_time = match self.under_way.begin("take-over") {
            Ok(g) => g,
            Err(why) => return refuse(why),
        };
        let waiting: Vec<String> = self
            .core
            .volumes
            .iter()
            .filter(|v| v.held_writers_ended())
            .map(|v| format!("{} LUN {}", v.target(), v.lun()))
            .collect();
        if waiting.is_empty() {
            return refuse(
                "no LUN's kept memory waits for a writer that has ended: `status` says why each \
                 NOT READY LUN is, and what to run"
                    .into(),
            );
        }
        if !crate::systemd::has_holder() {
            return refuse(
                "not run under systemd's fd store: no start after this one would be given the \
                 kept memory"
                    .into(),
            );
        }
        let unkept = self.core.volumes.not_held_in_fd_store();
        if !unkept.is_empty() {
            return refuse(format!(
                "the memory of {} is not confirmed in systemd's fd store: ending now would lose \
                 it. Stop the daemon (it dumps) and start it again instead",
                unkept.join(", ")
            ));
        }
        tracing::warn!(
            "take-over of {}: ending as after a crash (SIGKILL), so that systemd starts the \
             daemon again with its fd store",
            waiting.join(", ")
        );
        (
            Reply::TakingOver(format!(
                "the daemon ends now as after a crash; systemd starts it again with its fd \
                 store, and that start takes over the kept memory of {}",
                waiting.join(", ")
            )),
            Some(one_at_a_time),
        )
    }

    fn accept_empty(&self, target: &str, lun: u64) -> Reply {
        let _one_at_a_time = match self.under_way.begin("accept-empty") {
            Ok(g) => g,
            Err(why) => return Reply::Error(why),
        };
        let named =
            |e: &Export| e.front_end == FrontEnd::Iscsi && e.owner.eq_ignore_ascii_case(target);
        let mut served = self
            .core
            .exported()
            .filter(|(_, exports)| exports.iter().any(named))
            .peekable();
        if served.peek().is_none() {
            return Reply::Error(format!(
                "no target named {target}; `ramslog-target status` lists them"
            ));
        }
        let Some((volume, owner)) = served.find_map(|(v, exports)| {
            let e = exports.iter().find(|e| named(e) && e.unit == lun)?;
            Some((v, e.owner.clone()))
        }) else {
            return Reply::Error(format!("target {target} has no LUN {lun}"));
        };
        if volume.is_ready() {
            return Reply::Error(format!(
                "{target} LUN {lun} is ready: its content is intact, and accept-empty would \
                 hand it out empty under a new identity. It is only for a LUN that \
                 `status` shows NOT READY"
            ));
        }
        let id = Identity::generate();
        let hooks: Vec<&dyn VolumeHooks> = self
            .front_ends
            .iter()
            .map(|f| f.as_ref() as &dyn VolumeHooks)
            .collect();
        if let Err(e) = crate::core::accept_empty(volume, &hooks, id.clone()) {
            return Reply::Error(e);
        }
        tracing::warn!(
            target = %owner, lun, naa = %naa_hex(&id.naa), serial = %id.serial,
            "accept-empty: LUN accepted as an empty device under a new identity; it is ready"
        );
        Reply::Accepted {
            target: owner,
            lun,
            naa: naa_hex(&id.naa),
            serial: id.serial,
        }
    }
}

/// Longest request line the control socket reads.
const MAX_REQUEST_LINE: usize = 64 * 1024;

/// Bind the control socket (mode 0600, the daemon's user only) and serve it
/// forever.
pub async fn serve(path: PathBuf, control: Arc<Control>) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    crate::private_dir::check_socket_dir(dir).map_err(std::io::Error::other)?;
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; move it away or choose another --control-socket",
                    path.display()
                ),
            ));
        }
        Ok(_) => {
            if UnixStream::connect(&path).await.is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!(
                        "{} is in use by another running ramslog-target; give this one its own --control-socket or --state-dir",
                        path.display()
                    ),
                ));
            }
            // A socket left by a daemon that is gone.
            std::fs::remove_file(&path)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = bind_private(&path)?;
    let owner = std::fs::metadata(&path)?.uid();
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("control socket: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            // The socket's mode already keeps others out; the peer's
            // credentials say so again, whatever the directory allows.
            match stream.peer_cred() {
                Ok(c) if c.uid() == owner || c.uid() == 0 => {}
                Ok(c) => {
                    tracing::warn!(
                        uid = c.uid(),
                        "control socket: refusing a client of another user"
                    );
                    let reply = Reply::Error(format!(
                        "refused: uid {} may not use this control socket; run as root or uid {owner}",
                        c.uid()
                    ));
                    // Best effort and off the accept loop: a reader that never
                    // reads must not hold it.
                    tokio::spawn(async move {
                        let (_, mut wr) = stream.into_split();
                        let _ = tokio::time::timeout(
                            std::time::Duration::from_secs(1),
                            write_reply(&mut wr, &reply),
                        )
                        .await;
                    });
                    continue;
                }
                Err(e) => {
                    tracing::warn!("control socket: no peer credentials: {e}");
                    continue;
                }
            }
            let control = control.clone();
            tokio::spawn(serve_client(stream, control));
        }
    });
    Ok(())
}

/// Bind in a private directory beside `path` and move the socket into place:
/// it is never reachable with looser permissions than 0600.
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let private = dir.join(format!(".control-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("sock");
    let bound = UnixListener::bind(&staged).and_then(|l| {
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&staged, path)?;
        Ok(l)
    });
    let _ = std::fs::remove_dir_all(&private);
    bound
}

async fn serve_client(stream: UnixStream, control: Arc<Control>) {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut rd)
            .take(MAX_REQUEST_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let complete = line.last() == Some(&b'\n');
        if !complete && n > MAX_REQUEST_LINE {
            let reply = Reply::Error("request longer than 64 KiB".into());
            let _ = write_reply(&mut wr, &reply).await;
            return;
        }
        let reply = match std::str::from_utf8(&line)
            .map_err(|e| e.to_string())
            .and_then(|l| serde_json::from_str::<Request>(l.trim_end()).map_err(|e| e.to_string()))
        {
            Ok(Request::Stop) => control.stop().await,
            Ok(Request::TakeOver) => {
                let (reply, ending) = control.take_over();
                let sent = write_reply(&mut wr, &reply).await;
                if let Some(_one_at_a_time) = ending {
                    // The answer is in the socket's buffer (the requester
                    // reads it after this process is gone); no other
                    // operation began meanwhile (`_one_at_a_time` is held).
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                }
                if sent.is_err() || !complete {
                    return;
                }
                continue;
            }
            Ok(Request::Restart) => {
                let (reply, written) = control.restart().await;
                let sent = write_reply(&mut wr, &reply).await;
                let _ = written.send(());
                if sent.is_err() || !complete {
                    return;
                }
                continue;
            }
            // accept-empty zeroes the LUN, waits for the old identity's
            // transfers and writes an image: not on an async worker.
            Ok(req @ Request::AcceptEmpty { .. }) => {
                let control = control.clone();
                tokio::task::spawn_blocking(move || control.handle(req))
                    .await
                    .unwrap_or_else(|e| Reply::Error(format!("accept-empty failed: {e}")))
            }
            Ok(req) => control.handle(req),
            Err(e) => Reply::Error(format!("bad request: {e}")),
        };
        if write_reply(&mut wr, &reply).await.is_err() || !complete {
            return;
        }
    }
}

async fn write_reply(
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    reply: &Reply,
) -> std::io::Result<()> {
    let mut out = serde_json::to_string(reply).map_err(std::io::Error::other)?;
    out.push('\n');
    wr.write_all(out.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One operation at a time; the refusal names the one under way, and
    /// the next may begin once its guard is gone.
    #[test]
    fn one_operation_is_under_way_at_a_time() {
        let under_way = UnderWay::default();
        let accepting = under_way.begin("accept-empty").expect("nothing under way");
        assert_eq!(under_way.now(), Some("accept-empty"));
        let refused = under_way.begin("restart").err().expect("refused");
        assert!(
            refused.starts_with("accept-empty is under way: restart is refused"),
            "{refused}"
        );
        drop(accepting);
        assert_eq!(under_way.now(), None);
        let _restarting = under_way.clone().begin("restart").expect("free again");
        assert!(
            under_way.begin("discard-kept").is_err(),
            "a clone shares it"
        );
    }
}
