//! How the daemon ends a connection and learns that it let go: the control
//! its permit watches and its driver polls.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// How a connection is ended from outside (session reinstatement, shutdown,
/// eviction) and how others learn that it is gone. The driver makes one per
/// connection and hands it to its [`Permit`](super::Permit), which marks it released when
/// dropped: after the engine ended and, on RDMA, after the queue pair was
/// destroyed, so no byte of that connection can land in LUN memory any more.
pub struct SessionControl {
    terminated: AtomicBool,
    /// The termination is a planned restart's: the driver tells the
    /// initiator when to reconnect before it closes (taken once).
    restart_notice: AtomicBool,
    released: AtomicBool,
    /// The permit watching it (0: none, e.g. an engine without a transport).
    pub(super) permit: AtomicU64,
    /// Wakes a driver that waits for termination (TCP's select).
    wake: Notify,
    /// Nothing moves bytes for it (tests, benchmarks): it is released as
    /// soon as it is terminated.
    transportless: bool,
    /// An eventfd written at termination, for a driver that sleeps in
    /// poll(2) (iSER) rather than on `wake`.
    wake_fd: Option<OwnedFd>,
}

impl SessionControl {
    /// The control of a connection with a transport behind it.
    pub fn new() -> Arc<SessionControl> {
        Arc::new(SessionControl::with_transport(true))
    }

    /// The control of an engine driven without a transport.
    pub fn without_transport() -> Arc<SessionControl> {
        Arc::new(SessionControl::with_transport(false))
    }

    /// The control of a connection whose driver sleeps in poll(2): its
    /// termination also makes [`Self::wake_fd`] readable, so the driver
    /// acts on it at once (a planned restart waits for it only briefly).
    /// Without an eventfd it still ends, at its next wake-up.
    pub fn with_wake_fd() -> Arc<SessionControl> {
        let mut control = SessionControl::with_transport(true);
        control.wake_fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| tracing::warn!("no eventfd to wake the connection's driver: {e}"))
        .ok();
        Arc::new(control)
    }

    /// What the driver sleeps on besides its queues: readable once
    /// terminated.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.wake_fd.as_ref().map(AsFd::as_fd)
    }

    /// Read the wake-up (the driver saw it), so the next sleep sleeps.
    pub fn take_wake(&self) {
        if let Some(fd) = &self.wake_fd {
            let mut count = [0u8; 8];
            let _ = rustix::io::read(fd, &mut count);
        }
    }

    fn with_transport(transport: bool) -> SessionControl {
        SessionControl {
            wake_fd: None,
            terminated: AtomicBool::new(false),
            restart_notice: AtomicBool::new(false),
            released: AtomicBool::new(false),
            permit: AtomicU64::new(0),
            wake: Notify::new(),
            transportless: !transport,
        }
    }

    /// Ask the connection to end.
    pub fn terminate(&self) {
        self.terminated.store(true, Ordering::Release);
        if self.transportless {
            self.release();
        }
        self.wake.notify_one();
        if let Some(fd) = &self.wake_fd {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }

    /// Ask the connection to end for a planned restart: it first tells
    /// the initiator when the new program takes its login.
    pub fn terminate_for_restart(&self) {
        self.restart_notice.store(true, Ordering::Release);
        self.terminate();
    }

    /// For the engine: whether to tell the initiator of a restart before
    /// closing; true once.
    pub fn take_restart_notice(&self) -> bool {
        self.restart_notice.swap(false, Ordering::AcqRel)
    }

    pub fn is_terminated(&self) -> bool {
        self.terminated.load(Ordering::Acquire)
    }

    /// Resolves once [`Self::terminate`] was called (or at once if it was).
    pub async fn terminated(&self) {
        if !self.is_terminated() {
            self.wake.notified().await;
        }
    }

    /// Everything the connection held is released.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Its permit is gone (or, without a transport, it was terminated).
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::Release);
    }

    /// For tests that stand in for a driver: the connection is gone.
    #[cfg(test)]
    pub fn release_for_test(&self) {
        self.release();
    }
}
