//! The staging budget: daemon-wide memory for write data a device must see
//! whole before it acts (SCSI parameter lists and compare data today; any
//! front end's alike), shared by every connection of every front end.

use std::sync::atomic::{AtomicU64, Ordering};

/// A byte budget shared by all connections: reservations never exceed it.
#[derive(Debug)]
pub struct StagingBudget {
    used: AtomicU64,
    limit: u64,
}

impl StagingBudget {
    pub fn new(limit: u64) -> StagingBudget {
        StagingBudget {
            used: AtomicU64::new(0),
            limit,
        }
    }

    /// Take `bytes` from the budget; false (and nothing taken) if they do not fit.
    pub fn reserve(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|n| *n <= self.limit)
            })
            .is_ok()
    }

    pub fn release(&self, bytes: u64) {
        if bytes > 0 {
            let _ = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    Some(used.saturating_sub(bytes))
                });
        }
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}
