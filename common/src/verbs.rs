//! Safe wrapper over the RDMA verbs (libibverbs) and the RDMA connection
//! manager (librdmacm), on top of the raw `rdma-sys` bindings. Feature `rdma`.
//!
//! What is here is what an iSER target and initiator need, no more: rdma_cm
//! event channels and ids (RC, `RDMA_PS_TCP`) with private data, protection
//! domains, memory regions, completion channels and queues, and SEND / RDMA
//! WRITE / RDMA READ / RECV work requests.
//!
//! # Ownership
//! Every handle frees its resource on drop and never panics there; a
//! failure to free is ignored. Lifetimes the C libraries require are kept
//! with `Arc`s, so safe code cannot free things in the wrong order:
//! - a [`CmId`] keeps its [`EventChannel`] alive (librdmacm writes to the
//!   channel when the id is destroyed), and, once it has a QP, the
//!   [`ProtectionDomain`] and [`CompletionQueue`] the QP uses;
//! - a [`MemoryRegion`] keeps its protection domain alive;
//! - a [`CompletionQueue`] keeps its [`CompletionChannel`] alive;
//! - protection domains, CQs and completion channels keep their
//!   [`Device`] open.
//!
//! # Memory the adapter writes
//! Rust holds a reference into registered memory only where the type
//! system proves the adapter is not using it: a [`SlotBuffer`]'s [`Slot`]
//! is taken by the request posted on it and given back by that request's
//! completion alone. Everything else ([`RegisteredBuffer`]: remote windows,
//! bounce buffers) is copied in and out with volatile accesses, sound while
//! the adapter or a peer writes the same bytes.
//!
//! # Data path
//! [`CmId::post_send`], [`CmId::post_recv`] and [`CompletionQueue::poll`]
//! build the C work requests and completions on the stack: no allocation,
//! no lock of ours. (They call the provider through the context's ops table,
//! as the `static inline` functions in `<infiniband/verbs.h>` do.)
//!
//! # Devices
//! A [`Device`] is the `ibv_context` librdmacm opened for an id, held open
//! by the handle. librdmacm keeps a context open while an id or such a
//! handle counts on it; after a device is hot-removed
//! (`RDMA_CM_EVENT_DEVICE_REMOVAL`; with SoftRoCE, `rdma link delete`) it
//! closes the context once the last of them is gone, and the kernel may
//! wait for that to finish the removal. Protection domains, CQs and
//! completion channels each keep a handle, so nothing made from a device can
//! outlive its context; on removal, drop them and the ids on the device
//! ([`Device::is_removed`] tells).
//!
//! # Errors
//! Every failure is an [`Error`]: the C call that failed and the OS error.
//! Where the host kernel has no RDMA at all, [`device_count`] fails with
//! ENOSYS and the rdma_cm calls with ENODEV: [`Error::is_no_rdma`] tells.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

mod cm;
mod ib;
mod slots;
pub mod wait;

pub use cm::{CmEvent, CmEventKind, CmId, CmWaitError, ConnParam, EventChannel, QpCaps};
pub use ib::rescan_devices;
pub use ib::{
    Access, CompletionChannel, CompletionQueue, Device, DeviceAttrs, MemoryRegion, PostError,
    ProtectionDomain, RecvWr, RegisteredBuffer, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion, WrId, MAX_POLL_BATCH,
};
pub use slots::{SendFailed, Slot, SlotBuffer};

/// Result of every fallible call in this module.
pub type Result<T> = std::result::Result<T, Error>;

/// A failed verbs / rdma_cm / system call: which call, and the OS error.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct Error {
    /// The C function (or step) that failed, e.g. `"rdma_create_id"`.
    pub op: &'static str,
    #[source]
    pub source: io::Error,
}

impl Error {
    pub fn new(op: &'static str, source: io::Error) -> Error {
        Error { op, source }
    }

    /// From an errno value, e.g. `Error::from_errno("ibv_post_send", libc::ENOMEM)`.
    pub fn from_errno(op: &'static str, errno: i32) -> Error {
        Error::new(op, io::Error::from_raw_os_error(errno))
    }

    /// From the calling thread's `errno`, after a call that reported failure.
    /// An errno of 0 (a library that failed without setting it) becomes EIO.
    pub fn last_os_error(op: &'static str) -> Error {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(0) | None => Error::from_errno(op, libc::EIO),
            Some(_) => Error::new(op, e),
        }
    }

    /// From a verbs return code: `-1` means "see errno"; any other non-zero
    /// value is an errno value, positive or negated (providers differ).
    pub(crate) fn from_rc(op: &'static str, rc: i32) -> Error {
        if rc == -1 {
            Error::last_os_error(op)
        } else {
            let errno = i32::try_from(rc.unsigned_abs()).unwrap_or(libc::EIO);
            Error::from_errno(op, if errno == 0 { libc::EIO } else { errno })
        }
    }

    /// The errno value, if the error came from the OS.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }

    /// True when the host has no RDMA at all (kernel without RDMA support:
    /// ENOSYS from `ibv_get_device_list`; no device: ENODEV from rdma_cm).
    /// Callers report "no RDMA device" and carry on with TCP.
    pub fn is_no_rdma(&self) -> bool {
        matches!(self.errno(), Some(libc::ENOSYS) | Some(libc::ENODEV))
    }

    /// True for EAGAIN / EWOULDBLOCK from a non-blocking channel.
    pub fn is_would_block(&self) -> bool {
        self.source.kind() == io::ErrorKind::WouldBlock
    }
}

/// Number of RDMA devices libibverbs sees (`ibv_get_device_list`).
///
/// On a kernel without RDMA this fails with ENOSYS ([`Error::is_no_rdma`]).
pub fn device_count() -> Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the duration of the call.
    let list = unsafe { rdma_sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(Error::last_os_error("ibv_get_device_list"));
    }
    // SAFETY: `list` came from ibv_get_device_list, is freed exactly once
    // here and not used afterwards.
    unsafe { rdma_sys::ibv_free_device_list(list) };
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Most file descriptors [`wait_readable`] takes in one call.
pub const WAIT_MAX_FDS: usize = 16;

/// Sleep in poll(2) until one of `fds` is readable (or reports an error or
/// hang-up, which the next read will surface), or `timeout` passes (`None`:
/// no timeout). On return, `ready[i]` says whether `fds[i]` woke us; a
/// timeout or a signal (EINTR) returns `Ok` with nothing ready. Negative
/// descriptors are ignored. At most [`WAIT_MAX_FDS`] descriptors, and
/// `ready` must be at least as long as `fds` (else EINVAL).
///
/// Used to sleep on a completion channel and a CM event channel together.
pub fn wait_readable(fds: &[RawFd], timeout: Option<Duration>, ready: &mut [bool]) -> Result<()> {
    if fds.len() > WAIT_MAX_FDS || ready.len() < fds.len() {
        return Err(Error::from_errno("poll", libc::EINVAL));
    }
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; WAIT_MAX_FDS];
    for (p, &fd) in pfds.iter_mut().zip(fds) {
        p.fd = fd;
        p.events = libc::POLLIN;
    }
    for r in ready.iter_mut().take(fds.len()) {
        *r = false;
    }
    let ms: libc::c_int = match timeout {
        None => -1,
        Some(d) => {
            // Round up, so a 100 µs timeout does not become a busy loop.
            let ms = d.as_nanos().div_ceil(1_000_000);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    };
    // fds.len() <= WAIT_MAX_FDS, so this cannot truncate.
    let nfds = fds.len() as libc::nfds_t;
    // SAFETY: `pfds` is a valid array of at least `nfds` pollfd entries that
    // lives across the call.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), nfds, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(());
        }
        return Err(Error::new("poll", e));
    }
    for (r, p) in ready.iter_mut().zip(&pfds[..fds.len()]) {
        if p.revents & libc::POLLNVAL != 0 {
            return Err(Error::from_errno("poll", libc::EBADF));
        }
        *r = p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
    }
    Ok(())
}

/// Set or clear O_NONBLOCK on a descriptor we own.
fn set_fd_nonblocking(fd: RawFd, on: bool) -> Result<()> {
    // SAFETY: F_GETFL on a descriptor owned by the caller's live object; no
    // memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::last_os_error("fcntl(F_GETFL)"));
    }
    let new = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    if new != flags {
        // SAFETY: as above; F_SETFL takes an int argument.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, new) };
        if rc < 0 {
            return Err(Error::last_os_error("fcntl(F_SETFL)"));
        }
    }
    Ok(())
}

// The C layouts this module relies on, as rdma-core 44 defines them on
// 64-bit Linux (checked with offsetof in C). rdma-sys hand-writes the
// structs with unions (ibv_wc, ibv_send_wr, rdma_cm_event, rdma_addr), so
// make a mismatch a build error rather than memory corruption.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
const _: () = {
    use rdma_sys as f;
    use std::mem::{offset_of, size_of};
    assert!(size_of::<f::ibv_wc>() == 48);
    assert!(offset_of!(f::ibv_wc, vendor_err) == 16);
    assert!(offset_of!(f::ibv_wc, byte_len) == 20);
    assert!(size_of::<f::ibv_send_wr>() == 128);
    assert!(offset_of!(f::ibv_send_wr, send_flags) == 32);
    assert!(offset_of!(f::ibv_send_wr, wr) == 40);
    assert!(size_of::<f::ibv_recv_wr>() == 32);
    assert!(size_of::<f::rdma_cm_id>() == 416);
    assert!(offset_of!(f::rdma_cm_id, qp) == 24);
    assert!(offset_of!(f::rdma_cm_id, route) == 32);
    assert!(offset_of!(f::rdma_cm_id, ps) == 344);
    assert!(size_of::<f::rdma_addr>() == 296);
    assert!(offset_of!(f::rdma_addr, dst_addr_union) == 128);
    assert!(size_of::<f::rdma_cm_event>() == 80);
    assert!(offset_of!(f::rdma_cm_event, param) == 24);
    assert!(size_of::<f::rdma_conn_param>() == 24);
    assert!(size_of::<f::ibv_qp_init_attr>() == 64);
    assert!(size_of::<f::ibv_device_attr>() == 232);
    assert!(offset_of!(f::ibv_device_attr, max_qp_rd_atom) == 144);
    assert!(offset_of!(f::ibv_context, ops) == 8);
    assert!(offset_of!(f::ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(f::ibv_context_ops, req_notify_cq) == 96);
    assert!(offset_of!(f::ibv_context_ops, post_send) == 200);
    assert!(offset_of!(f::ibv_context_ops, post_recv) == 208);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_safety_markers() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<CmId>();
        send::<CmEvent>();
        send_sync::<EventChannel>();
        send_sync::<Device>();
        send_sync::<ProtectionDomain>();
        send_sync::<MemoryRegion>();
        send_sync::<RegisteredBuffer>();
        send_sync::<CompletionChannel>();
        send_sync::<CompletionQueue>();
        send_sync::<Error>();
    }

    #[test]
    fn device_count_is_ok_or_no_rdma() {
        match device_count() {
            Ok(_) => {}
            Err(e) => assert!(e.is_no_rdma(), "unexpected error: {e}"),
        }
    }

    #[test]
    fn event_channel_is_ok_or_no_rdma() {
        match EventChannel::new() {
            Ok(ch) => assert!(ch.fd() >= 0),
            Err(e) => assert!(e.is_no_rdma(), "unexpected error: {e}"),
        }
    }

    #[test]
    fn error_classification() {
        assert!(Error::from_errno("x", libc::ENOSYS).is_no_rdma());
        assert!(Error::from_errno("x", libc::ENODEV).is_no_rdma());
        assert!(!Error::from_errno("x", libc::EINVAL).is_no_rdma());
        assert!(Error::from_errno("x", libc::EAGAIN).is_would_block());
        assert_eq!(
            Error::from_rc("x", -libc::ENOMEM).errno(),
            Some(libc::ENOMEM)
        );
        assert_eq!(
            Error::from_rc("x", libc::ENOMEM).errno(),
            Some(libc::ENOMEM)
        );
        let e = Error::from_errno("rdma_create_id", libc::ENODEV);
        assert!(e.to_string().starts_with("rdma_create_id: "));
    }

    #[test]
    fn access_bits() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert!(a.contains(Access::LOCAL_WRITE));
        assert!(a.contains(Access::REMOTE_READ));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert_eq!(a.bits(), 1 | 4);
        let mut b = Access::empty();
        assert!(b.is_empty());
        b |= Access::REMOTE_WRITE;
        assert_eq!(b.bits(), 2);
        assert_eq!((a | b).bits(), 7);
        assert_eq!((a & Access::REMOTE_READ), Access::REMOTE_READ);
        assert_eq!(Access::default(), Access::empty());
    }

    #[test]
    fn sge_bounds() {
        let s = ib::sge_in(0x1000, 4096, 7, 0, 4096).unwrap();
        assert_eq!((s.addr(), s.len(), s.lkey()), (0x1000, 4096, 7));
        let s = ib::sge_in(0x1000, 4096, 7, 4000, 96).unwrap();
        assert_eq!(s.addr(), 0x1000 + 4000);
        assert!(ib::sge_in(0x1000, 4096, 7, 4000, 97).is_none());
        assert!(ib::sge_in(0x1000, 4096, 7, 4097, 0).is_none());
        assert!(ib::sge_in(0x1000, 4096, 7, 4096, 0).is_some());
        assert!(ib::sge_in(0x1000, 4096, 7, usize::MAX, 1).is_none());
        assert!(ib::sge_in(u64::MAX - 10, 4096, 7, 100, 1).is_none());
    }

    #[test]
    fn wait_readable_pipe() {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe(2) to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let mut ready = [true; 2];
        wait_readable(&[fds[0], -1], Some(Duration::from_millis(1)), &mut ready).unwrap();
        assert_eq!(ready, [false, false]);
        // SAFETY: writes one byte from a valid buffer to our pipe.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        wait_readable(&[-1, fds[0]], None, &mut ready).unwrap();
        assert_eq!(ready, [false, true]);
        assert!(wait_readable(&[fds[0]; WAIT_MAX_FDS + 1], None, &mut [false; 32]).is_err());
        assert!(wait_readable(&[fds[0], fds[0]], None, &mut [false; 1]).is_err());
        set_fd_nonblocking(fds[0], true).unwrap();
        set_fd_nonblocking(fds[0], false).unwrap();
        // SAFETY: closing the two descriptors pipe(2) gave us, once.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }

    #[test]
    fn work_completion_defaults() {
        let wc = WorkCompletion::default();
        assert!(wc.is_ok());
        assert_eq!(wc.opcode, WcOpcode::Send);
        assert_eq!(wc.status_str(), "success");
        let bad = WorkCompletion {
            status: WcStatus::Flushed,
            ..wc
        };
        assert!(!bad.is_ok());
        assert_eq!(bad.status_str(), "Work Request Flushed Error");
    }

    #[test]
    fn work_request_ids_and_statuses_survive_their_raw_forms() {
        for id in [
            WrId::new(0, 0),
            WrId::new(5, 319),
            // Kinds from 2^31 up are reserved (SlotBuffer's; posting refuses them).
            WrId::new((1 << 31) - 1, u32::MAX),
        ] {
            assert_eq!(WrId::from_raw(id.to_raw()), id);
        }
        assert_eq!(WrId::new(2, 7).to_raw(), (2 << 32) | 7);
        for raw in 0..32 {
            assert_eq!(WcStatus::from_raw(raw).raw(), raw);
        }
        assert_eq!(WcStatus::from_raw(1), WcStatus::LocalLength);
        assert_eq!(WcStatus::from_raw(5), WcStatus::Flushed);
    }
}
