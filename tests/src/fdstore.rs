//! A supervisor speaking systemd's notification and fd-store protocol, for
//! tests of what the daemon keeps across a crash: it holds what the daemon
//! pushes (`FDSTORE=1`, `FDNAME=`), drops what it removes
//! (`FDSTOREREMOVE=1`), answers barriers (`BARRIER=1`: it closes the pipe
//! end it was given once everything before is processed) and starts the
//! next daemon with the held descriptors as systemd does: from 3 on, named
//! in `LISTEN_FDNAMES`, with `LISTEN_PID` that daemon's pid. Like
//! systemd, it watches each descriptor stored without `FDPOLL=0` and drops
//! it once it reports POLLHUP or POLLERR; and the daemon's `writer` pidfd
//! must come with `FDPOLL=0` (systemd would drop it when its process ends,
//! the very moment a successor needs it): a push without it fails the next
//! launch. Like systemd, it keeps one copy of a file pushed again (the
//! same file, here by its device and inode; systemd suppresses the
//! duplicate). A test can
//! also put in what systemd never would (a second memfd under a name, a
//! pidfd of a live process), to reproduce the bad orders.

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};

use crate::TargetOptions;

/// What the supervisor holds and has been told.
#[derive(Default)]
struct Held {
    stored: Vec<(String, OwnedFd)>,
    /// The stored descriptors systemd would watch (pushed without
    /// `FDPOLL=0`), by their raw numbers here.
    polled: Vec<std::os::fd::RawFd>,
    /// What the daemon sent that systemd would not keep as it meant.
    violations: Vec<String>,
    /// Every notification's text, in order (the descriptors left out).
    messages: Vec<String>,
    /// Hold barriers unanswered (the daemon waits in its barrier).
    hold_barriers: bool,
    held_barriers: Vec<OwnedFd>,
}

impl Held {
    /// Watch no number whose descriptor is no longer held (a number is
    /// reused by the next descriptor opened).
    fn forget_closed(&mut self) {
        let live: Vec<_> = self.stored.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        self.polled.retain(|fd| live.contains(fd));
    }
}

pub struct FdStoreSupervisor {
    path: PathBuf,
    held: Arc<Mutex<Held>>,
}

impl FdStoreSupervisor {
    /// Listen on a notification socket in `dir` (created).
    pub fn new(dir: &Path) -> FdStoreSupervisor {
        std::fs::create_dir_all(dir).expect("mkdir");
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind the notification socket");
        let held = Arc::new(Mutex::new(Held::default()));
        let h = held.clone();
        std::thread::spawn(move || serve(socket, h));
        FdStoreSupervisor { path, held }
    }

    /// What it holds, after dropping the watched descriptors that report
    /// POLLHUP or POLLERR, as systemd does.
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let Held { stored, polled, .. } = &mut *held;
        stored.retain(|(_, fd)| !(polled.contains(&fd.as_raw_fd()) && hung_up(fd)));
        held.forget_closed();
        held
    }

    /// The notification socket's path (what `$NOTIFY_SOCKET` names).
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The names held now, in the order they would be passed.
    pub fn names(&self) -> Vec<String> {
        self.held().stored.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Every notification received so far.
    pub fn messages(&self) -> Vec<String> {
        self.held().messages.clone()
    }

    /// Wait until a descriptor named `name` is held.
    pub fn wait_for(&self, name: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.names().iter().any(|n| n == name) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Wait until nothing is held under `name` (a removal is a datagram
    /// this supervisor reads in its own time).
    pub fn wait_gone(&self, name: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if !self.names().iter().any(|n| n == name) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// A copy of the first descriptor held under `name`.
    pub fn get(&self, name: &str) -> Option<OwnedFd> {
        let held = self.held();
        let (_, fd) = held.stored.iter().find(|(n, _)| n == name)?;
        fd.try_clone().ok()
    }

    /// Hold `fd` under `name` beside what is there (what systemd does with a
    /// second push under one name).
    pub fn put(&self, name: &str, fd: BorrowedFd<'_>) {
        let copy = fd.try_clone_to_owned().expect("dup");
        self.held().stored.push((name.into(), copy));
    }

    /// Drop everything held under `name`.
    pub fn remove(&self, name: &str) {
        self.held().stored.retain(|(n, _)| n != name);
    }

    /// Leave barriers unanswered from now on (the daemon then waits in its
    /// barrier, up to its bound: a point in its start-up to stop it at), or
    /// answer them again, the held ones at once.
    pub fn hold_barriers(&self, hold: bool) {
        let mut held = self.held();
        held.hold_barriers = hold;
        if !hold {
            held.held_barriers.clear();
        }
    }

    /// How many barriers are held unanswered now.
    pub fn barriers_held(&self) -> usize {
        self.held().held_barriers.len()
    }

    /// Drop everything (a `systemctl stop` then `start` on systemd 252).
    pub fn clear(&self) {
        self.held().stored.clear();
    }

    /// `base` started under this supervisor, with what it holds passed in.
    /// Keep the returned descriptors until the daemon has started (they are
    /// the copies the daemon inherits).
    pub fn launch(&self, base: TargetOptions) -> (TargetOptions, Vec<OwnedFd>) {
        let start = self.start();
        let mut options = base;
        options.env.extend(start.env);
        options.wrapper = start.wrapper;
        (options, start.inherited)
    }

    /// How to start a program under this supervisor as systemd would,
    /// passing what it holds now.
    pub fn start(&self) -> Start {
        let held = self.held();
        assert!(
            held.violations.is_empty(),
            "the daemon broke the fd-store protocol: {:?}",
            held.violations
        );
        // Copies above the numbers they get in the daemon, inheritable.
        let inherited: Vec<OwnedFd> = held
            .stored
            .iter()
            .map(|(_, fd)| rustix::io::fcntl_dupfd_cloexec(fd, 100).expect("dup"))
            .collect();
        for c in &inherited {
            rustix::io::fcntl_setfd(c, rustix::io::FdFlags::empty()).expect("inheritable");
        }
        let mut script = String::new();
        for (i, c) in inherited.iter().enumerate() {
            script += &format!("exec {}<&{}; ", 3 + i, c.as_raw_fd());
        }
        for c in &inherited {
            script += &format!("exec {}<&-; ", c.as_raw_fd());
        }
        let names: Vec<&str> = held.stored.iter().map(|(n, _)| n.as_str()).collect();
        if !inherited.is_empty() {
            script += &format!(
                "export LISTEN_PID=$$ LISTEN_FDS={} LISTEN_FDNAMES={}; ",
                inherited.len(),
                names.join(":")
            );
        }
        script += "exec \"$@\"";
        Start {
            wrapper: vec!["bash".into(), "-c".into(), script, "fdstore".into()],
            env: vec![
                ("NOTIFY_SOCKET".into(), self.path.display().to_string()),
                // The store's size, as systemd 254 and later pass it.
                ("FDSTORE".into(), "512".into()),
            ],
            inherited,
        }
    }
}

/// A start under the supervisor: run `wrapper` followed by the program and
/// its arguments, with `env`; drop `inherited` once it has started.
pub struct Start {
    pub wrapper: Vec<String>,
    pub env: Vec<(String, String)>,
    pub inherited: Vec<OwnedFd>,
}

/// The name the daemon stores its own pidfd under.
const WRITER_NAME: &str = "writer";

/// Whether `a` and `b` are the same memfd (what systemd's duplicate check
/// finds for LUN memory pushed twice). Only memfds are compared: each has
/// an inode of its own, while pidfds share one on older kernels.
fn same_file(a: &OwnedFd, b: &OwnedFd) -> bool {
    let memfd = |fd: &OwnedFd| {
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:"))
    };
    if !(memfd(a) && memfd(b)) {
        return false;
    }
    match (rustix::fs::fstat(a), rustix::fs::fstat(b)) {
        (Ok(x), Ok(y)) => (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino),
        _ => false,
    }
}

/// Whether `fd` reports POLLHUP or POLLERR now (what systemd watches).
fn hung_up(fd: &OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(fd, PollFlags::empty())];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&zero))
        .map(|n| n > 0 && fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR))
        .unwrap_or(false)
}

/// Receive notifications until the socket fails (the test ended).
fn serve(socket: UnixDatagram, held: Arc<Mutex<Held>>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let Ok(msg) = rustix::net::recvmsg(
            socket.as_fd(),
            &mut iov,
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) else {
            return;
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        let text = String::from_utf8_lossy(&buf[..msg.bytes]).into_owned();
        let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
        held.forget_closed();
        held.messages.push(text.clone());
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .map(String::from)
        };
        let name = field("FDNAME").unwrap_or_else(|| "stored".into());
        if field("FDSTORE").as_deref() == Some("1") {
            let poll = field("FDPOLL").as_deref() != Some("0");
            if poll && name == WRITER_NAME {
                held.violations.push(format!(
                    "{WRITER_NAME} stored without FDPOLL=0: systemd drops it when its process ends"
                ));
            }
            // One copy of a file already held, whatever its name.
            let fds: Vec<OwnedFd> = fds
                .into_iter()
                .filter(|fd| !held.stored.iter().any(|(_, h)| same_file(h, fd)))
                .collect();
            if poll {
                held.polled.extend(fds.iter().map(|fd| fd.as_raw_fd()));
            }
            held.stored
                .extend(fds.into_iter().map(|fd| (name.clone(), fd)));
        } else if field("FDSTOREREMOVE").as_deref() == Some("1") {
            held.stored.retain(|(n, _)| *n != name);
        } else if field("BARRIER").as_deref() == Some("1") && held.hold_barriers {
            held.held_barriers.extend(fds);
        }
        // A barrier's pipe end (and anything else not stored) is closed
        // here, after everything sent before it was processed.
    }
}
