//! A connection's timers: one deadline slot each; the earliest is what
//! `poll_timeout` reports.

use std::time::Instant;

/// Timers, one slot each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Timer {
    /// The login must reach full feature phase by then.
    Login = 0,
    /// Idle: send a NOP-In ping when this fires.
    NopInterval = 1,
    /// A ping is outstanding: drop the connection when this fires.
    NopResponse = 2,
    /// Look again whether the sessions this login reinstated are gone.
    Reinstatement = 3,
    /// A discovery session's lifetime since its last Text exchange ran
    /// out: ask for a logout, and close when that is not heeded.
    DiscoveryIdle = 4,
    /// Look again whether the transfers a held abort answer waits for
    /// are settled.
    Deferred = 5,
    /// A restart's notice was not confirmed within the restart drain:
    /// close without the receipt.
    NoticeReceipt = 6,
}

#[derive(Default)]
pub(super) struct TimerTable([Option<Instant>; 7]);

impl TimerTable {
    pub(super) fn set(&mut self, t: Timer, at: Instant) {
        self.0[t as usize] = Some(at);
    }
    pub(super) fn clear(&mut self, t: Timer) {
        self.0[t as usize] = None;
    }
    pub(super) fn is_set(&self, t: Timer) -> bool {
        self.0[t as usize].is_some()
    }
    pub(super) fn expired(&self, t: Timer, now: Instant) -> bool {
        self.0[t as usize].is_some_and(|at| at <= now)
    }
    pub(super) fn next(&self) -> Option<Instant> {
        self.0.iter().flatten().min().copied()
    }
}
