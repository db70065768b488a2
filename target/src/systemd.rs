//! systemd's notification protocol (sd_notify): with `Type=notify` the unit
//! is started once every LUN is restored and the portal listens, and
//! `systemctl status` shows what the daemon is doing. Its file-descriptor
//! store keeps each LUN's memory while the daemon is restarted or after it
//! crashed: `FDSTORE=1` pushes a descriptor under a name, the next start
//! finds it in `LISTEN_FDS`/`LISTEN_FDNAMES` (docs/restarts.md). Without
//! `$NOTIFY_SOCKET` (not under systemd) every call does nothing. The
//! descriptors systemd passes at start (`LISTEN_FDS`) are read here too,
//! and the unit's cgroup. A leaf: it names nothing else of the crate but
//! the store, where a passed descriptor becomes owned (the volumes use it).

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

/// The name of the descriptor that tells a successor whether the process
/// that last wrote the LUN memory is gone (a pidfd, pushed with `FDPOLL=0`
/// so systemd keeps it after that process exits).
pub const WRITER_NAME: &str = "writer";

/// The longest a barrier waits for systemd to have processed what was sent.
pub const BARRIER_WAIT: Duration = Duration::from_secs(5);

/// Send one notification, e.g. `READY=1`; failures are logged, never fatal.
pub fn notify(state: &str) {
    if let Err(e) = send(state, None) {
        tracing::warn!("cannot notify systemd ({state}): {e}");
    }
}

/// Whether the fd store may hold LUN memory: a notification socket is
/// there (the daemon runs under systemd or a supervisor speaking its
/// protocol) and the admin did not turn kept memory off.
pub fn has_holder() -> bool {
    KEPT_MEMORY.load(Ordering::Relaxed) && std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// `--kept-memory=off`, set once at start: nothing is pushed into the fd
/// store from then on, and a restart dumps first.
pub fn turn_kept_memory_off() {
    KEPT_MEMORY.store(false, Ordering::Relaxed);
}

static KEPT_MEMORY: AtomicBool = AtomicBool::new(true);

/// Where a crash leaves the LUN memory, for `status`.
pub fn kept_memory_mode() -> &'static str {
    if !KEPT_MEMORY.load(Ordering::Relaxed) {
        "off (--kept-memory=off): a crash loses what no image has; a restart dumps first"
    } else if has_holder() {
        "held in systemd's fd store: a crash or a restart keeps it"
    } else {
        "no fd store (not run by systemd): a crash loses what no image has; a restart dumps first"
    }
}

/// The notification socket, connected; `None` when there is none.
fn connect() -> std::io::Result<Option<UnixDatagram>> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(None);
    };
    let socket = UnixDatagram::unbound()?;
    match path.as_encoded_bytes().strip_prefix(b"@") {
        // An abstract socket: '@' stands for the leading NUL byte.
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.connect_addr(&addr)?;
        }
        None => socket.connect(&path)?,
    }
    Ok(Some(socket))
}

/// Send `state`, with `fd` attached when given. `Ok(false)` when there is
/// no notification socket.
fn send(state: &str, fd: Option<BorrowedFd<'_>>) -> std::io::Result<bool> {
    let Some(socket) = connect()? else {
        return Ok(false);
    };
    let fds = fd.as_slice();
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("no room for the descriptor"));
    }
    let sent = rustix::net::sendmsg(
        &socket,
        &[IoSlice::new(state.as_bytes())],
        &mut control,
        SendFlags::empty(),
    )?;
    if sent != state.len() {
        return Err(std::io::Error::other("the notification was cut short"));
    }
    Ok(true)
}

/// A name systemd accepts for a stored descriptor: at most 255 characters,
/// printable, no ':' (it separates the names in `LISTEN_FDNAMES`).
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 255 && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// Push `fd` into the fd store under `name`. With `poll` false systemd
/// keeps it even when it signals an error or hang-up (a pidfd of an exited
/// process does). `Ok(false)` when there is no holder. Not acknowledged:
/// follow with [`barrier`].
pub fn store(name: &str, fd: BorrowedFd<'_>, poll: bool) -> std::io::Result<bool> {
    if !valid_name(name) {
        return Err(std::io::Error::other(format!(
            "{name:?} is not a valid fd store name"
        )));
    }
    let mut state = format!("FDSTORE=1\nFDNAME={name}");
    if !poll {
        state += "\nFDPOLL=0";
    }
    send(&state, Some(fd))
}

/// Drop every descriptor stored under `name`.
pub fn remove(name: &str) -> std::io::Result<bool> {
    if !valid_name(name) {
        return Err(std::io::Error::other(format!(
            "{name:?} is not a valid fd store name"
        )));
    }
    send(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), None)
}

/// Wait until systemd has processed every notification sent before
/// (`BARRIER=1`: it closes the pipe's write end it was given), at most
/// `limit`. `Ok(false)` when there is no holder.
pub fn barrier(limit: Duration) -> std::io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags};
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    if !send("BARRIER=1", Some(write_end.as_fd()))? {
        return Ok(false);
    }
    drop(write_end);
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("systemd did not confirm the fd store within {limit:?}"),
            ));
        }
        let mut fds = [PollFd::new(&read_end, PollFlags::IN)];
        let timeout = rustix::time::Timespec::try_from(left).ok();
        match poll(&mut fds, timeout.as_ref()) {
            Ok(0) => continue,
            Ok(_) if fds[0].revents().contains(PollFlags::HUP) => return Ok(true),
            // Data on the pipe: not the protocol; read it away and go on.
            Ok(_) => {
                let mut sink = [0u8; 64];
                if rustix::io::read(&read_end, &mut sink)? == 0 {
                    return Ok(true);
                }
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Push this process's pidfd as [`WRITER_NAME`] and wait for systemd to
/// have it. With `replace`, the ones stored before go (only when each was
/// proven gone: one still running must stay to fail the next start too).
pub fn store_writer(replace: bool) -> std::io::Result<bool> {
    if !has_holder() {
        return Ok(false);
    }
    let me = rustix::process::getpid();
    let pidfd = rustix::process::pidfd_open(me, rustix::process::PidfdFlags::empty())?;
    if replace {
        remove(WRITER_NAME)?;
    }
    store(WRITER_NAME, pidfd.as_fd(), false)?;
    barrier(BARRIER_WAIT)
}

/// The descriptors a daemon serving `luns` LUNs keeps in systemd's fd
/// store: each LUN's memory and its record, and its own pidfd (`writer`).
pub fn descriptors_kept(luns: usize) -> usize {
    2 * luns + 1
}

/// What the store must be able to take (`FileDescriptorStoreMax=`) for
/// `luns` LUNs: what [`descriptors_kept`] counts, and room for the pidfds
/// of earlier writers, kept beside this one's while they still run.
pub fn descriptors_to_take(luns: usize) -> usize {
    descriptors_kept(luns) + 3
}

/// Whether the fd store holds at least `need` descriptors of this
/// service, so that a restart may skip the dump (a failure during the
/// handover leaves the memory there for the next start). systemd is asked
/// for the count (`systemctl show -P NFileDescriptorStore UNIT`, the unit
/// found from this process's cgroup); where that cannot be asked, systemd
/// 254 and later (and the tests' supervisor) give the store's size in
/// `$FDSTORE`. `Err` says why it is not known to hold them.
pub fn store_holds(need: usize) -> Result<(), String> {
    if !KEPT_MEMORY.load(Ordering::Relaxed) {
        return Err("--kept-memory=off".into());
    }
    if !has_holder() {
        return Err("no systemd notification socket".into());
    }
    if let Some(unit) = own_unit() {
        let out = std::process::Command::new("systemctl")
            .args(["show", "-P", "NFileDescriptorStore", &unit])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output();
        if let Some(out) = out.ok().filter(|o| o.status.success()) {
            let held: usize = String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .map_err(|_| format!("systemctl show {unit} gave no descriptor count"))?;
            return if held >= need {
                Ok(())
            } else {
                Err(format!(
                    "systemd holds {held} descriptors of {unit}, not the {need} the LUNs need \
                     (is FileDescriptorStoreMax= set in the unit?)"
                ))
            };
        }
    }
    match std::env::var("FDSTORE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(max) if max >= need => Ok(()),
        Some(max) => Err(format!(
            "the fd store takes {max} descriptors, the LUNs need {need}"
        )),
        None => Err("cannot tell whether the fd store holds the LUN memory".into()),
    }
}

/// The systemd unit this process runs in (`NAME.service`), from its cgroup.
pub fn own_unit() -> Option<String> {
    let path = service_cgroup()?;
    path.rsplit('/').next().map(str::to_string)
}

/// The path of this process's cgroup (cgroup v2, under the hierarchy's
/// root) when it is a service's (`/system.slice/NAME.service`): where
/// systemd runs the unit. `None` outside one.
pub fn service_cgroup() -> Option<String> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    path.ends_with(".service").then(|| path.to_string())
}

/// Descriptors systemd passed at start (`LISTEN_FDS`, from 3 on, named by
/// `LISTEN_FDNAMES`), owned from now on and close-on-exec; the variables
/// are removed. Call before any other thread runs. Empty when the
/// variables are absent or name another process (`LISTEN_PID`).
pub fn listened() -> Result<Vec<(String, std::os::fd::OwnedFd)>, String> {
    let var = |name| std::env::var(name).ok();
    let (pid, count, names) = (var("LISTEN_PID"), var("LISTEN_FDS"), var("LISTEN_FDNAMES"));
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    let (Some(pid), Some(count)) = (pid, count) else {
        return Ok(Vec::new());
    };
    if pid.parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(Vec::new());
    }
    let count: std::os::fd::RawFd = count
        .parse()
        .ok()
        .filter(|&n| (0..=4096).contains(&n))
        .ok_or_else(|| format!("LISTEN_FDS={count:?} is not a descriptor count"))?;
    let names: Vec<String> = match names {
        Some(n) => n.split(':').map(String::from).collect(),
        None => vec!["unknown".into(); count as usize],
    };
    if names.len() != count as usize {
        return Err(format!(
            "LISTEN_FDNAMES names {} descriptors, LISTEN_FDS says {count}",
            names.len()
        ));
    }
    let raws: Vec<std::os::fd::RawFd> = (3..3 + count).collect();
    let fds = crate::store::inherited_fds(&raws)?;
    Ok(names.into_iter().zip(fds).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_systemd_accepts_are_sent() {
        assert!(valid_name("lun-3a1b2c3d4e5f6071"));
        assert!(valid_name(WRITER_NAME));
        for bad in ["", "a:b", "with space", "tab\t", &"x".repeat(256)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
