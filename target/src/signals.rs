//! The stop signals: blocked in every thread from the first instruction on
//! and read from a signalfd, so that one sent during a planned restart's
//! hand-over stays pending and reaches the new program.

/// The signals that stop the daemon (SIGTERM, SIGINT) or that it ignores
/// (SIGHUP). They are blocked in every thread and read from a signalfd:
/// one not read yet stays pending in the kernel, and a pending signal
/// survives `execve`. So a stop requested while a restart hands over
/// reaches the new program, which reads it as soon as its start-up does.
/// With handlers, the old program's would swallow it, and one arriving
/// before the new program installed its own would kill it by the default
/// action (an exit systemd counts as clean, which empties its fd store).
fn stop_signal_set() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Block the stop signals in this thread and every thread it starts from
/// now on: call first thing, before any thread exists.
pub fn block_stop_signals() -> std::io::Result<()> {
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_BLOCK,
        Some(&stop_signal_set()),
        None,
    )?;
    Ok(())
}

/// A stop signal, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    Terminate,
    Interrupt,
    Hangup,
}

impl StopSignal {
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Terminate => "SIGTERM",
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Hangup => "SIGHUP",
        }
    }
}

/// The stop signals sent to this process, read one at a time (see
/// [`block_stop_signals`]). A thread waits in poll(2) for the signalfd to
/// become readable and wakes the reader; only [`StopSignals::recv`] reads,
/// so a signal nobody asked for stays pending (and crosses a restart's
/// exec).
pub struct StopSignals {
    fd: std::sync::Arc<nix::sys::signalfd::SignalFd>,
    readable: std::sync::Arc<tokio::sync::Notify>,
    /// Lets the watching thread poll again once the reader has looked.
    poll_again: std::sync::mpsc::SyncSender<()>,
}

impl StopSignals {
    pub fn open() -> std::io::Result<StopSignals> {
        use nix::sys::signalfd::{SfdFlags, SignalFd};
        let fd = std::sync::Arc::new(SignalFd::with_flags(
            &stop_signal_set(),
            SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC,
        )?);
        let readable = std::sync::Arc::new(tokio::sync::Notify::new());
        let (poll_again, polled) = std::sync::mpsc::sync_channel(1);
        let (watched, wake) = (fd.clone(), readable.clone());
        std::thread::Builder::new()
            .name("stop-signals".into())
            .spawn(move || loop {
                let mut fds = [rustix::event::PollFd::new(
                    &*watched,
                    rustix::event::PollFlags::IN,
                )];
                match rustix::event::poll(&mut fds, None) {
                    Ok(_) => {
                        wake.notify_one();
                        if polled.recv().is_err() {
                            break;
                        }
                    }
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => {
                        break tracing::error!(
                            "the stop signals cannot be waited for ({e}): stop with `ramslog-target stop`"
                        )
                    }
                }
            })?;
        Ok(StopSignals {
            fd,
            readable,
            poll_again,
        })
    }

    /// The next stop signal. Cancel-safe: one is consumed only when
    /// returned. If the signalfd fails (it does not), this logs why and
    /// waits for ever: the control socket's `stop` still works.
    pub async fn recv(&mut self) -> StopSignal {
        loop {
            match self.fd.read_signal() {
                Ok(Some(info)) => match info.ssi_signo as i32 {
                    libc::SIGTERM => return StopSignal::Terminate,
                    libc::SIGINT => return StopSignal::Interrupt,
                    libc::SIGHUP => return StopSignal::Hangup,
                    _ => continue,
                },
                Ok(None) => {
                    self.readable.notified().await;
                    let _ = self.poll_again.try_send(());
                }
                Err(e) => {
                    tracing::error!(
                        "the stop signals cannot be read ({e}): stop with `ramslog-target stop`"
                    );
                    return std::future::pending().await;
                }
            }
        }
    }
}
