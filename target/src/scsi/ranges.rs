//! Exclusion by block range for the commands that read and change the
//! medium in one step (WRITE SAME, COMPARE AND WRITE, WRITE AND VERIFY):
//! each waits only for those whose blocks overlap its own, so a transport
//! worker running one never waits for another part of the LU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug, Default)]
pub(crate) struct RangeExclusion {
    /// Half-open block ranges held now: at most one per command executing,
    /// so as many as there are threads running commands.
    held: Mutex<Vec<(u64, u64)>>,
    released: Condvar,
    /// Commands waiting for a range now.
    waiting: AtomicUsize,
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
        if held.iter().any(overlaps) {
            drop(held);
            held = off_the_runtime(|| {
                let mut held = self.held();
                while held.iter().any(overlaps) {
                    self.waiting.fetch_add(1, Ordering::SeqCst);
                    held = self.released.wait(held).unwrap_or_else(|e| e.into_inner());
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                }
                held
            });
        }
        held.push(range);
        RangeGuard {
            exclusion: self,
            range,
        }
    }
}

/// Run `wait` (which blocks) where it stalls nobody else: on a worker of
/// the multi-threaded runtime (a TCP connection's task) the worker's other
/// tasks move to another thread first, so every other session is served
/// while this command waits; elsewhere (an RDMA connection's own thread)
/// it just runs.
fn off_the_runtime<R>(wait: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    impl RangeExclusion {
        fn waiting(&self) -> usize {
            self.waiting.load(Ordering::SeqCst)
        }
    }

    /// Overlapping WRITE SAMEs on as many TCP connections as the runtime
    /// has workers: both wait for the range, and a third connection's task
    /// must still run (a wait on a worker thread would stall every TCP
    /// session of the daemon until the range is free).
    #[test]
    fn waiting_for_a_range_leaves_the_runtime_serving() {
        let exclusion = Arc::new(RangeExclusion::default());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let held = exclusion.hold(0, 8);
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let e = exclusion.clone();
                rt.spawn(async move {
                    let _g = e.hold(4, 8);
                })
            })
            .collect();
        // The race is shown to happen: both wait, on the two workers.
        let deadline = Instant::now() + Duration::from_secs(10);
        while exclusion.waiting() < 2 {
            assert!(Instant::now() < deadline, "the commands never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(());
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(5)).is_ok(),
            "another connection's task waited behind two range waits: the runtime was blocked"
        );
        drop(held);
        for w in waiters {
            rt.block_on(w)
                .expect("the waiters end once the range is free");
        }
        assert_eq!(exclusion.waiting(), 0);
    }
}
