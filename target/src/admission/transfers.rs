//! A nexus's data transfers into LUN memory that are under way, so that a
//! command aborting its tasks (ABORT TASK, a reset, PREEMPT AND ABORT) is
//! answered only once none of them can place another byte.
//!
//! Every placement raises the count before it checks whether its task was
//! aborted, and lowers it when the bytes are in (a copy) or the transfer
//! completed or was flushed (an RDMA READ). The aborting side first marks
//! the tasks aborted, then waits for the count to reach zero; both sides use
//! sequentially consistent order, so either the placement sees the abort or
//! the aborter sees the placement. A transfer that does not finish (a hung
//! or partitioned host) is cut off by ending its connection: once that is
//! released (on iSER, its queue pair destroyed) nothing more can land.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::SessionControl;

pub struct Transfers {
    in_flight: AtomicU64,
    connection: Arc<SessionControl>,
}

impl Transfers {
    /// The transfers of the session whose connection `connection` controls.
    pub fn new(connection: Arc<SessionControl>) -> Arc<Transfers> {
        Arc::new(Transfers {
            in_flight: AtomicU64::new(0),
            connection,
        })
    }

    /// A transfer begins (an RDMA READ into LUN memory is about to be
    /// posted): raise the count before checking that its task still stands.
    pub fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// A transfer begun with [`Self::begin`] completed, failed, was dropped
    /// before posting, or its queue pair was destroyed.
    pub fn end(&self) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// A copy into LUN memory, for as long as the guard lives.
    pub fn copying(&self) -> CopyGuard<'_> {
        self.begin();
        CopyGuard(self)
    }

    /// No transfer of this nexus can place a byte any more: none is under
    /// way, or its connection is gone.
    pub fn settled(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) == 0 || self.connection.is_released()
    }

    /// The transfers do not finish: end the connection they belong to.
    pub fn cut_off(&self) {
        self.connection.terminate();
    }

    /// Wait, blocking, until every one of `all` is settled: cut off the
    /// connections of those not settled within the abort cut-off, then
    /// wait for them to be released. False if they still are not after
    /// [`Transfers::GIVE_UP`] (nothing may then be done that assumes they
    /// ended).
    pub fn wait_settled(all: &[Arc<Transfers>]) -> bool {
        let start = std::time::Instant::now();
        let mut cut = false;
        while !all.iter().all(|t| t.settled()) {
            let waited = start.elapsed();
            if waited >= Transfers::GIVE_UP {
                return false;
            }
            if !cut && waited >= Transfers::CUT_OFF {
                cut = true;
                for t in all.iter().filter(|t| !t.settled()) {
                    t.cut_off();
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    /// How long transfers may take before their connection is cut off.
    pub const CUT_OFF: std::time::Duration = std::time::Duration::from_secs(2);
    /// How long a blocking wait goes on after that.
    pub const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(12);

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// Lowers the count when a copy is done.
pub struct CopyGuard<'a>(&'a Transfers);

impl Drop for CopyGuard<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}
