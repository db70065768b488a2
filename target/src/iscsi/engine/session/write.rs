//! Write data: R2Ts or RDMA READs to solicit it, Data-Out placement, and
//! the write's completion once every byte is in place.

use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::{Bhs, Residual};
use ramslog_common::scsi_wire::status;

use super::aborts::Answer;
use super::datapath::{Fetch, RdmaReadInFlight};
use super::{Session, Task, WriteFailure, POOLED_BUFFER_MAX, SPARE_BUFFERS};
use crate::iscsi::engine::{is_reserved, Out};
use crate::scsi::{OutPlacement, ScsiTarget, SenseReason};

/// The data of a Data-Out PDU as it arrived.
pub(super) enum DataOutPayload<'a> {
    Sound(&'a [u8]),
    /// Failed its digest: the header is sound, so the bytes count for the
    /// sequence, but none of them may be placed.
    Damaged,
}

impl Session {
    /// After any event of a write: complete it, fail it, or ask for more
    /// data and keep waiting.
    pub(super) fn advance(&mut self, out: &mut Out, scsi: &Arc<ScsiTarget>, mut task: Task) {
        self.counting = task.counting;
        if self.drop_if_aborted(scsi, &task) {
            self.finish_task(task);
            return;
        }
        let residual = Residual::between(task.edtl, task.plan.data_out_len);
        if task.failure.is_none() && task.unsolicited.is_none() && !self.solicit(out, &mut task) {
            task.fail(WriteFailure::DataPhase);
        }
        if !task.transfer_quiet() {
            self.tasks.push(task);
            return;
        }
        match task.failure {
            Some(why) => {
                let itt = task.itt;
                self.finish_task(task);
                let reason = match why {
                    WriteFailure::DataPhase => SenseReason::DataPhaseError,
                    WriteFailure::Digest => SenseReason::ProtocolServiceCrcError,
                    WriteFailure::Placement => SenseReason::InternalTargetFailure,
                };
                self.fail(out, itt, reason, residual);
            }
            None if task.solicit_next >= task.moved => {
                self.complete_write(out, scsi, task, residual)
            }
            // Quiet but not whole cannot happen: solicit() asked for the rest.
            None => self.tasks.push(task),
        }
    }

    /// Copy data-out bytes at `offset` into the LUN or the task buffer,
    /// ignoring what lies past the bytes the command consumes. Each byte of
    /// the transfer belongs to exactly one sequence, so nothing is placed twice.
    pub(super) fn place(&self, task: &mut Task, offset: u32, data: &[u8]) -> bool {
        let end = (u64::from(offset) + data.len() as u64).min(u64::from(task.moved));
        if u64::from(offset) >= end {
            return true;
        }
        let useful = &data[..(end - u64::from(offset)) as usize];
        match task.plan.out_placement {
            // The policy for both transports: LUN writes land in the LUN as
            // they arrive (iSER's RDMA READ does the same). A write that is
            // never answered GOOD may leave its blocks partly written, as on
            // any disk; GOOD comes only when every byte is in place.
            OutPlacement::Store { offset: base, .. } => {
                let Some(scsi) = self.scsi.as_ref() else {
                    return false;
                };
                // Counted before the abort check, so an abort racing this
                // copy on another connection waits for it (admission::Transfers).
                let _copying = self.transfers.copying();
                if scsi.is_aborted(self.nexus, &task.plan) {
                    return false;
                }
                scsi.lu_of(&task.plan).is_some_and(|lu| {
                    lu.volume()
                        .store()
                        .write(base + u64::from(offset), useful)
                        .is_ok()
                })
            }
            OutPlacement::Buffer => match task.buf.get_mut(offset as usize..end as usize) {
                Some(dst) => {
                    dst.copy_from_slice(useful);
                    true
                }
                None => false,
            },
            OutPlacement::None => true,
        }
    }

    /// iSER: an RDMA READ finished. A task aborted meanwhile is gone, and its
    /// late data is dropped.
    pub fn rdma_read_done(&mut self, now: Instant, tag: u32, data: &[u8], out: &mut Out) {
        self.now = now;
        let Some(idx) = self.tasks.iter().position(|t| t.fetch.reading(tag)) else {
            return;
        };
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut task = self.tasks.swap_remove(idx);
        let Fetch::RdmaRead { in_flight, .. } = &mut task.fetch else {
            return;
        };
        let Some(RdmaReadInFlight { offset, len, .. }) = in_flight.take() else {
            return;
        };
        // For the store the HCA already placed the bytes in LUN memory.
        if matches!(task.plan.out_placement, OutPlacement::Buffer)
            && task.failure.is_none()
            && !self.place(&mut task, offset, &data[..data.len().min(len as usize)])
        {
            task.fail(WriteFailure::Placement);
        }
        self.advance(out, &scsi, task);
    }

    pub(super) fn data_out(&mut self, bhs: &Bhs, payload: DataOutPayload, out: &mut Out) {
        let Some(idx) = self.tasks.iter().position(|t| t.itt == bhs.itt()) else {
            // Data for a command that already ended (aborted, or failed before
            // any data was asked for) may still be in flight: drop it.
            return;
        };
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut task = self.tasks.swap_remove(idx);
        if self.drop_if_aborted(&scsi, &task) {
            // Aborted from another session: its data must not land.
            self.finish_task(task);
            return;
        }
        let offset = bhs.buffer_offset();
        let (data, len) = match payload {
            DataOutPayload::Sound(data) => (Some(data), data.len() as u32),
            DataOutPayload::Damaged => {
                // First, so that the sequence's own verdict does not hide it.
                task.fail(WriteFailure::Digest);
                (None, bhs.data_segment_len())
            }
        };
        let datasn = bhs.datasn();
        let ttt = bhs.ttt();
        let last = bhs.final_bit();
        let failing_already = task.failure.is_some();
        let placed_ok = if is_reserved(ttt) {
            match task.unsolicited.as_mut() {
                Some(seq) => {
                    let fits = seq.take(offset, len, datasn);
                    if last {
                        if !seq.broken && seq.next < seq.end {
                            // Unsolicited data may end early: what is missing
                            // is solicited with ordinary R2Ts.
                            task.solicit_next = seq.next;
                        }
                        if seq.broken {
                            task.fail(WriteFailure::DataPhase);
                        }
                        task.unsolicited = None;
                    }
                    fits
                }
                None => false,
            }
        } else if let Fetch::R2ts { outstanding, .. } = &mut task.fetch {
            match outstanding.iter().position(|r| r.ttt == ttt) {
                Some(ri) => {
                    let seq = &mut outstanding[ri].seq;
                    let fits = seq.take(offset, len, datasn);
                    if last {
                        // A solicited burst must deliver what its R2T asked
                        // for: ending early is a data-sequence error.
                        let short = seq.broken || seq.next < seq.end;
                        outstanding.swap_remove(ri);
                        if short {
                            task.fail(WriteFailure::DataPhase);
                        }
                    }
                    fits
                }
                None => false,
            }
        } else {
            // Over iSER nothing is solicited with a TTT.
            false
        };
        if !placed_ok {
            if !failing_already {
                // Once per task: a peer must not be able to fill the log.
                tracing::warn!(
                    itt = task.itt,
                    datasn,
                    offset,
                    "Data-Out out of sequence; the command will fail once its transfer is over"
                );
            }
            task.fail(WriteFailure::DataPhase);
        } else if let Some(data) = data.filter(|_| task.failure.is_none()) {
            if !self.place(&mut task, offset, data) {
                task.fail(WriteFailure::Placement);
            }
        }
        self.advance(out, &scsi, task);
    }

    /// Whether another nexus aborted this task (PREEMPT AND ABORT, a reset)
    /// since it arrived. With TAS=0 in the Control mode page an aborted task
    /// ends without status; the initiator learns of it from the unit
    /// attention and its own task management.
    pub(super) fn drop_if_aborted(&self, scsi: &ScsiTarget, task: &Task) -> bool {
        let aborted = scsi.is_aborted(self.nexus, &task.plan);
        if aborted {
            tracing::info!(
                initiator = %self.initiator_name.escape_debug(),
                itt = task.itt,
                "write aborted by another initiator; its data is dropped"
            );
        }
        aborted
    }

    pub(super) fn complete_write(
        &mut self,
        out: &mut Out,
        scsi: &Arc<ScsiTarget>,
        task: Task,
        residual: Residual,
    ) {
        let moved = task.moved as usize;
        let data: &[u8] = match task.plan.out_placement {
            OutPlacement::Buffer => task.buf.get(..moved).unwrap_or(&[]),
            _ => &[],
        };
        let result = scsi.execute(self.nexus, &task.plan, data, &mut self.data_in);
        self.counting.bytes = task.moved;
        let (itt, aborts) = (task.itt, task.plan.aborts_tasks());
        self.finish_task(task);
        match result {
            Ok(_) if aborts => {
                let waits = self.aborted_transfers(false);
                let counting = self.counting;
                let answer = Answer::Good {
                    itt,
                    residual,
                    counting,
                };
                self.answer_after(out, answer, waits);
            }
            Ok(_) => self.respond(out, itt, status::GOOD, None, residual),
            Err(failure) => self.fail_command(out, itt, failure, residual),
        }
    }

    pub(super) fn finish_task(&mut self, mut task: Task) {
        if task.in_window {
            self.waiting_in_window = self.waiting_in_window.saturating_sub(1);
        }
        let cap = task.buf.capacity();
        // Kept only while the budget is at most half used, so that idle
        // sessions' pools never hold more than half of it.
        let keep = cap > 0
            && cap as u64 == task.staged
            && cap <= POOLED_BUFFER_MAX
            && self.spare_bufs.len() < SPARE_BUFFERS
            && self.portal.core.staging.used() <= self.portal.core.staging.limit() / 2;
        if keep {
            // The task's share of the budget moves to the pool.
            task.buf.clear();
            self.spare_bufs.push(std::mem::take(&mut task.buf));
            self.pooled_bytes += task.staged;
        } else {
            self.portal.core.staging.release(task.staged);
        }
        task.staged = 0;
    }

    /// A buffer of `len` bytes whose whole capacity is taken from the
    /// daemon's staging budget: a pooled one if it is large enough (its
    /// share moves with it), else a new one of exactly `len`. None when the
    /// budget has no room.
    pub(super) fn staging_buffer(&mut self, len: usize) -> Option<Vec<u8>> {
        if let Some(mut buf) = self.spare_bufs.pop() {
            let cap = buf.capacity() as u64;
            self.pooled_bytes -= cap;
            if buf.capacity() >= len {
                buf.resize(len, 0);
                return Some(buf);
            }
            self.portal.core.staging.release(cap);
        }
        if !self.portal.core.staging.reserve(len as u64) {
            return None;
        }
        Some(vec![0; len])
    }
}
