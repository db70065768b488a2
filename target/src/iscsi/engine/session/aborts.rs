//! Answers that wait for aborted transfers: a task management function or
//! a PREEMPT AND ABORT is answered only once no task it aborted has a
//! transfer in flight or can place another byte (see `admission::Transfers`).
//! The wait is bounded: transfers that do not finish within
//! [`ABORT_CUT_OFF`] have their connection ended, and the answer goes out
//! once that connection is released (its queue pair destroyed), never on a
//! plain timeout. Other commands of the session go on meanwhile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::iscsi::{Bhs, Residual};
use ramslog_common::scsi_wire::status;

use super::{Counting, Session};
use crate::admission::Transfers;
use crate::iscsi::engine::{Out, OutData};

/// How long aborted transfers may take before their connection is cut off.
pub const ABORT_CUT_OFF: Duration = Transfers::CUT_OFF;
/// How often a waiting answer looks again.
pub(crate) const ABORT_RECHECK: Duration = Duration::from_millis(1);

/// The answer a waiting abort owes.
pub(super) enum Answer {
    /// A task management response.
    Tmf { itt: u32, response: u8 },
    /// GOOD for a command (PREEMPT AND ABORT) and its counting.
    Good {
        itt: u32,
        residual: Residual,
        counting: Counting,
    },
}

pub(super) struct Deferred {
    answer: Answer,
    waits: Vec<Arc<Transfers>>,
    since: Instant,
    cut: bool,
}

impl Session {
    /// Send `answer` now if every transfer in `waits` is settled, else hold
    /// it until they are.
    pub(super) fn answer_after(
        &mut self,
        out: &mut Out,
        answer: Answer,
        waits: Vec<Arc<Transfers>>,
    ) {
        if self.deferred.is_empty() && waits.iter().all(|t| t.settled()) {
            self.answer(out, answer);
            return;
        }
        tracing::debug!(
            initiator = %self.initiator_name.escape_debug(),
            "abort answered once the aborted transfers are settled"
        );
        self.deferred.push(Deferred {
            answer,
            waits,
            since: self.now,
            cut: false,
        });
    }

    fn answer(&mut self, out: &mut Out, answer: Answer) {
        match answer {
            Answer::Tmf { itt, response } => {
                let b = Bhs::tmf_response(itt, response);
                self.push_status(out, b, OutData::None);
            }
            Answer::Good {
                itt,
                residual,
                counting,
            } => {
                self.counting = counting;
                self.respond(out, itt, status::GOOD, None, residual);
            }
        }
    }

    /// Send the answers whose transfers settled, in the order they were
    /// held; cut off the connections of transfers that take too long.
    /// Returns when to look again, if any answer still waits.
    pub fn release_deferred(&mut self, now: Instant, out: &mut Out) -> Option<Instant> {
        self.now = now;
        while let Some(first) = self.deferred.first_mut() {
            if first.waits.iter().all(|t| t.settled()) {
                let d = self.deferred.remove(0);
                self.answer(out, d.answer);
                continue;
            }
            if !first.cut && now.saturating_duration_since(first.since) >= ABORT_CUT_OFF {
                first.cut = true;
                tracing::warn!(
                    initiator = %self.initiator_name.escape_debug(),
                    "aborted transfers still in flight after {ABORT_CUT_OFF:?}: ending their connections before answering"
                );
                for t in first.waits.iter().filter(|t| !t.settled()) {
                    t.cut_off();
                }
            }
            return Some(now + ABORT_RECHECK);
        }
        None
    }

    /// The transfers this session's own aborts wait for: its own, and those
    /// of the nexuses it aborted.
    pub(super) fn aborted_transfers(&self, own: bool) -> Vec<Arc<Transfers>> {
        let mut waits = match &self.scsi {
            Some(s) => s.take_aborted_transfers(self.nexus),
            None => Vec::new(),
        };
        if own {
            waits.push(self.transfers.clone());
        }
        waits
    }

    /// Whether the RDMA READ `tag` may still be posted: its task stands and
    /// was not aborted. The driver raised [`Self::transfers`] before asking.
    pub fn may_post_rdma_read(&self, tag: u32) -> bool {
        let Some(scsi) = &self.scsi else {
            return false;
        };
        self.tasks
            .iter()
            .find(|t| t.fetch.reading(tag))
            .is_some_and(|t| !scsi.is_aborted(self.nexus, &t.plan))
    }

    pub fn transfers(&self) -> &Arc<Transfers> {
        &self.transfers
    }
}
