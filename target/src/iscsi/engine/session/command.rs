//! SCSI Command: checks, the plan, execution, Data-In and the status.

use std::sync::Arc;

use ramslog_common::iscsi::{parse_ahs, scsi_cmd, Bhs, RejectReason, Residual, AHS_EXTENDED_CDB};
use ramslog_common::iser::RemoteBuffer;
use ramslog_common::lun::Lun;
use ramslog_common::scsi_wire::{status, Sense};

use super::datapath::Fetch;
use super::{Counting, DataSource, Sequence, Session, Task, WriteFailure, NO_SLOT};
use crate::iscsi::engine::{Out, OutData, RemoteBuffers};
use crate::metrics::{self, LimitHit};
use crate::scsi::{command_kind, DataIn, Failure, OutPlacement, Plan, ScsiTarget, SenseReason};

impl Session {
    pub(super) fn scsi_command(
        &mut self,
        bhs: &Bhs,
        ahs: &[u8],
        data: &[u8],
        buffers: &RemoteBuffers,
        out: &mut Out,
    ) {
        let itt = bhs.itt();
        if self.tasks.iter().any(|t| t.itt == itt) {
            self.reject(out, bhs, RejectReason::InvalidPduField);
            return;
        }
        let Some(scsi) = self.scsi.clone() else {
            return;
        };
        let mut cdb_buf = [0u8; 16 + 260];
        let mut cdb_len = 16;
        cdb_buf[..16].copy_from_slice(bhs.cdb());
        for entry in parse_ahs(ahs) {
            match entry {
                Ok(a) if a.ahs_type == AHS_EXTENDED_CDB => {
                    let Some(dst) = cdb_buf.get_mut(16..16 + a.data.len()) else {
                        self.reject(out, bhs, RejectReason::InvalidPduField);
                        return;
                    };
                    dst.copy_from_slice(a.data);
                    cdb_len = 16 + a.data.len();
                }
                Ok(_) => {}
                Err(_) => {
                    self.reject(out, bhs, RejectReason::InvalidPduField);
                    return;
                }
            }
        }
        let cdb = &cdb_buf[..cdb_len];
        let flags = bhs.flags();
        let edtl = bhs.expected_data_len();
        self.counting = Counting {
            slot: NO_SLOT,
            kind: command_kind(cdb[0]),
            arrived: if self.timed {
                metrics::clock().raw()
            } else {
                0
            },
            bytes: 0,
        };
        let Some(lun) = Lun::from_wire(bhs.lun()) else {
            self.fail(out, itt, SenseReason::LuNotSupported, Residual::None);
            return;
        };
        // RFC 7143 11.3.1: with neither R nor W set the EDTL must be 0, and
        // data travels only with W.
        if (data.len() as u32) > edtl
            || (!data.is_empty() && flags & scsi_cmd::WRITE == 0)
            || (flags & (scsi_cmd::READ | scsi_cmd::WRITE) == 0 && edtl != 0)
        {
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if !data.is_empty()
            && (!self.params.immediate_data || data.len() as u32 > self.params.first_burst_len)
        {
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if flags & scsi_cmd::READ != 0 && !self.data_path.can_return(edtl, buffers) {
            // iSER reads are RDMA-written to a buffer the command must name.
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        // The command's one LUN search: its counters' slot is its LU's index.
        let lu_index = scsi.lu_index(lun.number());
        self.counting.slot = lu_index
            .and_then(|i| u16::try_from(i).ok())
            .filter(|&i| self.metrics.slot(i).is_some())
            .unwrap_or(NO_SLOT);
        let plan = match scsi.prepare(self.nexus, lun.number(), lu_index, cdb) {
            Ok(p) => p,
            Err(reason) => {
                self.fail(out, itt, reason, Residual::None);
                return;
            }
        };
        let edtl_out = if flags & scsi_cmd::WRITE != 0 {
            edtl
        } else {
            0
        };
        if let Err(reason) = plan.check_expected_len(edtl_out) {
            let residual = Residual::between(edtl_out, plan.data_out_len);
            self.fail(out, itt, reason, residual);
            return;
        }
        if plan.data_out_len == 0 {
            let edtl_in = if flags & scsi_cmd::READ != 0 { edtl } else { 0 };
            self.execute(
                out,
                &scsi,
                itt,
                lun,
                &plan,
                &[],
                edtl_in,
                Residual::between(edtl, 0),
                buffers.read,
            );
            return;
        }
        let need = plan.data_out_len;
        // Only a parameter list may arrive shorter than the CDB says
        // (check_expected_len refused every other mismatch).
        let moved = need.min(edtl_out);
        let residual = Residual::between(edtl_out, need);
        let unsol_end = if flags & 0x80 != 0 || self.params.initial_r2t {
            data.len() as u32
        } else {
            self.params
                .first_burst_len
                .min(edtl_out)
                .max(data.len() as u32)
        };
        if self.tasks.len() >= self.cmd_window as usize {
            // More commands waiting for data than the window allows: the
            // initiator is ignoring MaxCmdSN or flooding immediate commands.
            self.portal.core.counters.limit_hit(LimitHit::CommandWindow);
            self.respond(out, itt, status::TASK_SET_FULL, None, residual);
            return;
        }
        // Immediate data is the unsolicited sequence's first piece; Data-Out
        // PDUs continue it from DataSN 0.
        let unsolicited = Sequence::new(data.len() as u32, unsol_end);
        let mut task = Task {
            itt,
            lun,
            plan,
            moved,
            edtl: edtl_out,
            unsolicited: Some(unsolicited),
            solicit_next: unsol_end,
            fetch: self.data_path.fetch(buffers, unsol_end),
            buf: Vec::new(),
            staged: 0,
            failure: None,
            in_window: !bhs.immediate(),
            counting: self.counting,
            // Before the first byte may land (the immediate data below).
            _placing: scsi.will_place(&plan),
        };
        if unsol_end == data.len() as u32 {
            task.unsolicited = None;
        }
        if unsol_end < moved && matches!(task.fetch, Fetch::RdmaRead { remote: None, .. }) {
            // The rest must be RDMA-read, but the command named no buffer.
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if matches!(task.plan.out_placement, OutPlacement::Buffer)
            && self
                .data_path
                .buffered_fetch_max()
                .is_some_and(|max| moved.saturating_sub(unsol_end) > max)
        {
            // The driver reads such data into a buffer of its own, which
            // has this size: refuse the command rather than the connection.
            self.fail(
                out,
                itt,
                SenseReason::TransferTooLargeForTransport,
                residual,
            );
            return;
        }
        if matches!(task.plan.out_placement, OutPlacement::Buffer) {
            let Some(buf) = self.staging_buffer(moved as usize) else {
                tracing::debug!(itt, moved, "staging budget exhausted: TASK SET FULL");
                self.portal.core.counters.limit_hit(LimitHit::StagingBudget);
                self.respond(out, itt, status::TASK_SET_FULL, None, residual);
                return;
            };
            task.staged = buf.capacity() as u64;
            task.buf = buf;
        }
        if task.in_window {
            // Released by finish_task, before the command's status is stamped.
            self.waiting_in_window += 1;
        }
        if !data.is_empty() && !self.place(&mut task, 0, data) {
            task.fail(WriteFailure::Placement);
        }
        self.advance(out, &scsi, task);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn execute(
        &mut self,
        out: &mut Out,
        scsi: &Arc<ScsiTarget>,
        itt: u32,
        lun: Lun,
        plan: &Plan,
        data_out: &[u8],
        edtl_in: u32,
        residual: Residual,
        read_buffer: Option<RemoteBuffer>,
    ) {
        let mut data_in = std::mem::take(&mut self.data_in);
        let result = scsi.execute(self.nexus, plan, data_out, &mut data_in);
        match result {
            Ok(DataIn::None) => self.respond(out, itt, status::GOOD, None, residual),
            Ok(DataIn::Store {
                volume,
                offset,
                len,
            }) => {
                let src = DataSource::Store { volume, offset };
                self.send_data_in(out, itt, lun, src, len, edtl_in, read_buffer)
            }
            Ok(DataIn::Buffer { len }) => {
                let len = len.min(data_in.len() as u32);
                let src = DataSource::Buffer(&data_in);
                self.send_data_in(out, itt, lun, src, len, edtl_in, read_buffer);
            }
            Err(failure) => self.fail_command(out, itt, failure, residual),
        }
        self.data_in = data_in;
    }

    /// A command that failed in execution: its status, or, for a write
    /// that met the shutdown fence, no status and the end of the
    /// connection: the host then retries the write after the restart
    /// instead of seeing it fail.
    pub(super) fn fail_command(
        &mut self,
        out: &mut Out,
        itt: u32,
        failure: Failure,
        residual: Residual,
    ) {
        match failure {
            Failure::Status(reason) => self.fail(out, itt, reason, residual),
            Failure::Fenced => {
                tracing::info!(
                    itt,
                    "write met the shutdown fence: no status, closing the connection"
                );
                out.close();
            }
        }
    }

    /// A command that failed: its CHECK CONDITION (or other status).
    pub(super) fn fail(
        &mut self,
        out: &mut Out,
        itt: u32,
        reason: SenseReason,
        residual: Residual,
    ) {
        self.respond(out, itt, reason.status(), reason.sense(), residual);
    }

    pub(super) fn respond(
        &mut self,
        out: &mut Out,
        itt: u32,
        st: u8,
        sense: Option<Sense>,
        residual: Residual,
    ) {
        let mut b = Bhs::scsi_response(itt, st, residual);
        let served = self.count_status(st, sense.as_ref());
        let data = match sense {
            Some(s) => {
                let enc = s.encode_fixed();
                let mut v = Vec::with_capacity(2 + enc.len());
                v.extend_from_slice(&(enc.len() as u16).to_be_bytes());
                v.extend_from_slice(&enc);
                OutData::Owned(v)
            }
            None => OutData::None,
        };
        b.set_statsn(out.take_statsn());
        self.stamp(&mut b);
        let mut pdu = self.pdu(b, data);
        pdu.served = served;
        out.push(pdu);
    }

    // ---- task management -------------------------------------------------
}
