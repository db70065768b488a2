//! Task management, text (SendTargets), logout.

use ramslog_common::iscsi::{text, tmf, Bhs, RejectReason, RESERVED_TAG};
use ramslog_common::lun::Lun;

use super::aborts::Answer;
use super::{fmt_addr, portal_addresses, Flow, Session, Task};
use crate::iscsi::engine::login::SessionKind;
use crate::iscsi::engine::{is_reserved, Out, OutData};

impl Session {
    pub(super) fn task_mgmt(&mut self, bhs: &Bhs, out: &mut Out) {
        let function = bhs.flags() & 0x7f;
        // The LUN the request names, if this target has it.
        let known_lun = Lun::from_wire(bhs.lun()).filter(|l| {
            self.scsi
                .as_ref()
                .is_some_and(|s| s.lu(l.number()).is_some())
        });
        let response = match function {
            tmf::ABORT_TASK => {
                let rtt = bhs.ttt();
                match self.tasks.iter().position(|t| t.itt == rtt) {
                    Some(i) => {
                        let t = self.tasks.swap_remove(i);
                        self.finish_task(t);
                        tmf::RSP_COMPLETE
                    }
                    None => tmf::RSP_NO_TASK,
                }
            }
            tmf::ABORT_TASK_SET | tmf::CLEAR_TASK_SET | tmf::LOGICAL_UNIT_RESET => {
                if let Some(l) = known_lun {
                    self.abort_tasks(|t| t.lun == l);
                    if function == tmf::LOGICAL_UNIT_RESET {
                        if let Some(s) = &self.scsi {
                            s.reset(crate::scsi::ResetScope::Lu(l.number()), self.nexus);
                        }
                        tracing::info!(initiator = %self.initiator_name, lun = %l, "logical unit reset");
                    }
                    tmf::RSP_COMPLETE
                } else {
                    tmf::RSP_NO_LUN
                }
            }
            tmf::TARGET_WARM_RESET => {
                self.abort_tasks(|_| true);
                if let Some(s) = &self.scsi {
                    s.reset(crate::scsi::ResetScope::Target, self.nexus);
                }
                tracing::info!(initiator = %self.initiator_name, "target warm reset");
                tmf::RSP_COMPLETE
            }
            tmf::TASK_REASSIGN => tmf::RSP_NO_REASSIGN,
            _ => tmf::RSP_NOT_SUPPORTED,
        };
        // Function Complete for an abort means its tasks place nothing more:
        // it waits for their transfers, this session's and those of the
        // sessions a reset aborted.
        let aborted = response == tmf::RSP_COMPLETE
            && matches!(
                function,
                tmf::ABORT_TASK
                    | tmf::ABORT_TASK_SET
                    | tmf::CLEAR_TASK_SET
                    | tmf::LOGICAL_UNIT_RESET
                    | tmf::TARGET_WARM_RESET
            );
        let waits = if aborted {
            self.aborted_transfers(true)
        } else {
            Vec::new()
        };
        let answer = Answer::Tmf {
            itt: bhs.itt(),
            response,
        };
        self.answer_after(out, answer, waits);
    }

    pub(super) fn abort_tasks(&mut self, pred: impl Fn(&Task) -> bool) {
        let mut i = 0;
        while i < self.tasks.len() {
            if pred(&self.tasks[i]) {
                let t = self.tasks.swap_remove(i);
                self.finish_task(t);
            } else {
                i += 1;
            }
        }
    }

    // ---- text and logout -------------------------------------------------

    pub(super) fn text_request(&mut self, bhs: &Bhs, data: &[u8], out: &mut Out) {
        let ttt = bhs.ttt();
        if !is_reserved(ttt) {
            // Continuation of a long response.
            match self.text_tx.take() {
                Some((tag, rest)) if tag == ttt => self.send_text(out, bhs.itt(), rest),
                _ => self.reject(out, bhs, RejectReason::InvalidPduField),
            }
            return;
        }
        self.text_tx = None;
        self.text_rx.extend_from_slice(data);
        if self.text_rx.len() > 64 * 1024 {
            self.text_rx.clear();
            self.reject(out, bhs, RejectReason::ProtocolError);
            return;
        }
        if bhs.flags() & 0x40 != 0 {
            // C bit: more text follows; acknowledge with an empty response.
            self.send_text_pdu(out, bhs.itt(), Vec::new(), false, RESERVED_TAG);
            return;
        }
        let rx = std::mem::take(&mut self.text_rx);
        let pairs = match text::decode(&rx) {
            Ok(p) => p,
            Err(e) => {
                tracing::info!("malformed text request: {e}");
                self.reject(out, bhs, RejectReason::ProtocolError);
                return;
            }
        };
        let mut resp = Vec::new();
        for p in pairs {
            if p.key == "SendTargets" {
                self.send_targets(p.value, &mut resp);
            } else {
                text::encode_pair(&mut resp, p.key, "NotUnderstood");
            }
        }
        self.send_text(out, bhs.itt(), resp);
    }

    pub(super) fn send_targets(&self, which: &str, resp: &mut Vec<u8>) {
        let portal = &self.portal;
        for t in &portal.targets {
            let wanted = match (self.kind, which) {
                (SessionKind::Discovery, "All") => true,
                (_, "") => self
                    .target_name
                    .as_deref()
                    .is_some_and(|n| n.eq_ignore_ascii_case(&t.name)),
                (_, name) => {
                    name.eq_ignore_ascii_case(&t.name)
                        && (self.kind == SessionKind::Discovery
                            || self
                                .target_name
                                .as_deref()
                                .is_some_and(|n| n.eq_ignore_ascii_case(name)))
                }
            };
            if !wanted || !t.acl.allows(&self.initiator_name, self.info.peer.ip()) {
                continue;
            }
            text::encode_pair(resp, "TargetName", &t.name);
            for addr in portal_addresses(&portal.listen, self.info.local) {
                text::encode_pair(
                    resp,
                    "TargetAddress",
                    &format!("{},{}", fmt_addr(addr), portal.tpgt),
                );
            }
        }
    }

    pub(super) fn send_text(&mut self, out: &mut Out, itt: u32, mut resp: Vec<u8>) {
        let limit = self.params.initiator_mrdsl as usize;
        if resp.len() > limit {
            let rest = resp.split_off(limit);
            let tag = self.new_ttt();
            self.text_tx = Some((tag, rest));
            self.send_text_pdu(out, itt, resp, false, tag);
        } else {
            self.send_text_pdu(out, itt, resp, true, RESERVED_TAG);
        }
    }

    pub(super) fn send_text_pdu(
        &mut self,
        out: &mut Out,
        itt: u32,
        data: Vec<u8>,
        last: bool,
        ttt: u32,
    ) {
        let b = Bhs::text_response(itt, ttt, last);
        self.push_status(out, b, OutData::bytes(data));
    }

    pub(super) fn logout(&mut self, bhs: &Bhs, out: &mut Out) -> Flow {
        let reason = bhs.flags() & 0x7f;
        let response = match reason {
            0 => 0,
            1 if bhs.cid() == self.cid => 0,
            1 => 1,
            // Connection recovery needs ErrorRecoveryLevel 2.
            _ => 2,
        };
        let b = Bhs::logout_response(bhs.itt(), response);
        self.push_status(out, b, OutData::None);
        if response == 0 {
            self.abort_tasks(|_| true);
            tracing::info!(initiator = %self.initiator_name, "logout");
            out.close();
            return Flow::Close;
        }
        Flow::Continue
    }
}
