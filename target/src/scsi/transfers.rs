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

use crate::admission::SessionControl;

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
