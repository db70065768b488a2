//! Waiting for completions, the one way every RDMA loop here does it: poll;
//! while a spin budget lasts, poll again; then arm the queues that should
//! wake the loop, poll once more (a completion that raced the arming raises
//! no event, so only this poll finds it), and sleep on the completion
//! channel, together with an rdma_cm channel when the loop watches one.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::time::Duration;

use super::cm::EventChannel;
use super::ib::{CompletionChannel, CompletionQueue};
use super::{wait_readable, Result};

/// Empty polls in a row, against a budget of spins before sleeping.
#[derive(Debug, Clone, Copy)]
pub struct SpinBudget {
    budget: u32,
    empty: u32,
}

impl SpinBudget {
    pub const fn new(budget: u32) -> SpinBudget {
        SpinBudget { budget, empty: 0 }
    }

    /// After a poll that found `found` completions: `true` to poll again at
    /// once (it found some, or the budget is not spent yet: then after a
    /// spin-loop hint), `false` when it is time to arm and sleep.
    pub fn poll_again(&mut self, found: usize) -> bool {
        if found > 0 {
            self.empty = 0;
            return true;
        }
        self.empty = self.empty.saturating_add(1);
        if self.empty <= self.budget {
            std::hint::spin_loop();
            return true;
        }
        false
    }

    /// Start counting afresh (after a sleep, or any other progress).
    pub fn reset(&mut self) {
        self.empty = 0;
    }
}

/// Ask each queue in `cqs` for an event at its next completion. Poll once
/// more before [`sleep`].
pub fn arm(cqs: &[&CompletionQueue]) -> Result<()> {
    for cq in cqs {
        cq.req_notify()?;
    }
    Ok(())
}

/// What ended a [`sleep`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Woken {
    /// Bit `i` set: `armed[i]` raised its event (which is acknowledged).
    pub fired: u32,
    /// An event of a queue on the channel that `armed` does not list (left
    /// over from an earlier arming); acknowledged, no completion implied.
    pub stray: bool,
    /// The rdma_cm channel has events to read.
    pub cm: bool,
    /// The wake descriptor given to [`sleep_or_wake`] is readable.
    pub wake: bool,
}

impl Woken {
    pub fn completion(&self) -> bool {
        self.fired != 0
    }

    /// Nothing at all woke the sleep.
    pub fn timed_out(&self) -> bool {
        self.fired == 0 && !self.stray && !self.cm && !self.wake
    }
}

/// Sleep until a queue armed with [`arm`] raises its event, `cm` has an
/// event, or `timeout` passes (`None`: no timeout). Every pending event of
/// `armed` (at most one per queue) is consumed and acknowledged, and the
/// result says which queues fired; `cm`'s events are left for the caller.
/// The completion channel must be non-blocking.
pub fn sleep(
    comp: &CompletionChannel,
    armed: &[&CompletionQueue],
    cm: Option<&EventChannel>,
    timeout: Option<Duration>,
) -> Result<Woken> {
    sleep_or_wake(comp, armed, cm, None, timeout)
}

/// [`sleep`], also woken when `wake` (an eventfd another thread writes to)
/// is readable; reading it is the caller's.
pub fn sleep_or_wake(
    comp: &CompletionChannel,
    armed: &[&CompletionQueue],
    cm: Option<&EventChannel>,
    wake: Option<BorrowedFd<'_>>,
    timeout: Option<Duration>,
) -> Result<Woken> {
    let fds: [RawFd; 3] = [
        comp.fd(),
        cm.map_or(-1, |c| c.fd()),
        wake.map_or(-1, |w| w.as_raw_fd()),
    ];
    let mut ready = [false; 3];
    wait_readable(&fds, timeout, &mut ready)?;
    let mut woken = Woken {
        fired: 0,
        stray: false,
        cm: ready[1],
        wake: ready[2],
    };
    if ready[0] {
        for _ in 0..armed.len().max(1) {
            match comp.consume_event(armed)? {
                Some(i) if i < armed.len() && i < 32 => woken.fired |= 1 << i,
                Some(_) => woken.stray = true,
                None => break,
            }
        }
    }
    Ok(woken)
}
