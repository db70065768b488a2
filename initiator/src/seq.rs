//! Sequence numbers an initiator tracks (RFC 7143 4.2.2): the next CmdSN to
//! send, the StatSN it expects, and the target's command window.

use ramslog_common::iscsi::{scsi_rsp, Bhs, Opcode, RESERVED_TAG};
use ramslog_common::serial;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeqState {
    pub next_cmdsn: u32,
    pub exp_statsn: u32,
    pub exp_cmdsn: u32,
    pub max_cmdsn: u32,
}

impl SeqState {
    /// Whether a non-immediate command with CmdSN `next_cmdsn` may be sent.
    pub fn window_open(&self) -> bool {
        serial::le(self.next_cmdsn, self.max_cmdsn)
    }

    /// Take the CmdSN for a non-immediate command and advance.
    pub fn take_cmdsn(&mut self) -> u32 {
        let sn = self.next_cmdsn;
        self.next_cmdsn = sn.wrapping_add(1);
        sn
    }

    /// Account for a PDU from the target. Returns true if MaxCmdSN moved (the
    /// window may have opened).
    pub fn on_target_pdu(&mut self, bhs: &Bhs) -> bool {
        let Some(op) = bhs.opcode() else { return false };
        let consumes_statsn = match op {
            Opcode::ScsiResponse
            | Opcode::TaskMgmtResponse
            | Opcode::TextResponse
            | Opcode::LogoutResponse
            | Opcode::Reject
            | Opcode::AsyncMessage => true,
            Opcode::DataIn => bhs.flags() & scsi_rsp::STATUS != 0,
            Opcode::NopIn => bhs.itt() != RESERVED_TAG,
            Opcode::LoginResponse => {
                // Login establishes the numbers outright.
                self.exp_statsn = bhs.statsn().wrapping_add(1);
                self.exp_cmdsn = bhs.exp_cmdsn();
                self.max_cmdsn = bhs.max_cmdsn();
                return true;
            }
            _ => false,
        };
        if !op.is_initiator_opcode() && consumes_statsn {
            let next = bhs.statsn().wrapping_add(1);
            if serial::gt(next, self.exp_statsn) {
                self.exp_statsn = next;
            }
        }
        self.update_window(bhs.exp_cmdsn(), bhs.max_cmdsn())
    }

    /// RFC 7143 4.2.2.1: ignore the pair if MaxCmdSN < ExpCmdSN - 1; only move forward.
    pub fn update_window(&mut self, exp: u32, max: u32) -> bool {
        if serial::lt(max, exp.wrapping_sub(1)) {
            return false;
        }
        if serial::gt(exp, self.exp_cmdsn) {
            self.exp_cmdsn = exp;
        }
        if serial::gt(max, self.max_cmdsn) {
            self.max_cmdsn = max;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_and_statsn() {
        let mut s = SeqState::default();
        let mut login = Bhs::new(Opcode::LoginResponse);
        login.set_statsn(100).set_exp_cmdsn(5).set_max_cmdsn(5);
        s.on_target_pdu(&login);
        s.next_cmdsn = 5;
        assert_eq!(s.exp_statsn, 101);
        assert!(s.window_open());
        assert_eq!(s.take_cmdsn(), 5);
        assert!(!s.window_open());

        let mut r2t = Bhs::new(Opcode::ReadyToTransfer);
        r2t.set_statsn(101).set_exp_cmdsn(5).set_max_cmdsn(5);
        assert!(!s.on_target_pdu(&r2t));
        assert_eq!(s.exp_statsn, 101);

        let mut rsp = Bhs::new(Opcode::ScsiResponse);
        rsp.set_statsn(101).set_exp_cmdsn(6).set_max_cmdsn(13);
        assert!(s.on_target_pdu(&rsp));
        assert_eq!(s.exp_statsn, 102);
        assert!(s.window_open());

        // A stale response does not move anything backwards.
        rsp.set_statsn(50).set_exp_cmdsn(2).set_max_cmdsn(3);
        assert!(!s.on_target_pdu(&rsp));
        assert_eq!((s.exp_statsn, s.max_cmdsn), (102, 13));

        // MaxCmdSN < ExpCmdSN - 1 is ignored.
        rsp.set_statsn(102).set_exp_cmdsn(20).set_max_cmdsn(15);
        assert!(!s.on_target_pdu(&rsp));
        assert_eq!((s.exp_cmdsn, s.max_cmdsn), (6, 13));

        // Unsolicited NOP-In does not consume a StatSN.
        let mut nop = Bhs::new(Opcode::NopIn);
        nop.set_itt(RESERVED_TAG).set_statsn(103);
        s.on_target_pdu(&nop);
        assert_eq!(s.exp_statsn, 103);
    }
}
