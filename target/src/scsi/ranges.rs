//! Exclusion by block range for the commands that read and change the
//! medium in one step (WRITE SAME, COMPARE AND WRITE, WRITE AND VERIFY):
//! each waits only for those whose blocks overlap its own, so a transport
//! worker running one never waits for another part of the LU.

use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug, Default)]
pub(crate) struct RangeExclusion {
    /// Half-open block ranges held now: at most one per command executing,
    /// so as many as there are threads running commands.
    held: Mutex<Vec<(u64, u64)>>,
    released: Condvar,
}

/// Holds blocks [start, end) until dropped.
pub(crate) struct RangeGuard<'a> {
    exclusion: &'a RangeExclusion,
    range: (u64, u64),
}

impl RangeExclusion {
    fn held(&self) -> MutexGuard<'_, Vec<(u64, u64)>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until no held range overlaps the `blocks` blocks at `lba`, then
    /// hold them.
    pub(crate) fn hold(&self, lba: u64, blocks: u64) -> RangeGuard<'_> {
        let range = (lba, lba.saturating_add(blocks));
        let overlaps = |&(start, end): &(u64, u64)| start < range.1 && range.0 < end;
        let mut held = self.held();
        while held.iter().any(overlaps) {
            held = self.released.wait(held).unwrap_or_else(|e| e.into_inner());
        }
        held.push(range);
        RangeGuard {
            exclusion: self,
            range,
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.exclusion.held();
        if let Some(i) = held.iter().position(|r| *r == self.range) {
            held.swap_remove(i);
        }
        drop(held);
        self.exclusion.released.notify_all();
    }
}
