//! The connection's output queue: actions in order, a READ's Data-In as a
//! cursor produced one PDU at a time, and the writer that numbers responses.

use std::collections::VecDeque;

use ramslog_common::iscsi::{self, Bhs, Residual, RESERVED_TAG};

use crate::metrics::Served;
use crate::volume::VolumeId;

use super::{Action, OutData, OutPdu};

/// An entry of the action queue.
pub(super) enum Queued {
    Action(Action),
    /// A READ's Data-In PDUs, produced one at a time by `poll_action`.
    DataIn(DataInStream),
}

/// The Data-In PDUs of one READ from LUN memory, as a cursor. The StatSN of
/// the last PDU was taken when the stream was queued, so responses keep
/// their order; the bytes are read from the LUN only as each PDU is encoded.
pub(crate) struct DataInStream {
    pub(super) itt: u32,
    pub(super) volume: VolumeId,
    pub(super) lun_wire: u64,
    /// LUN offset of the transfer's first byte.
    pub(super) base: u64,
    pub(super) xfer: u32,
    pub(super) off: u32,
    pub(super) datasn: u32,
    pub(super) seg: u32,
    pub(super) burst: u32,
    pub(super) statsn: u32,
    pub(super) exp_cmdsn: u32,
    pub(super) max_cmdsn: u32,
    pub(super) residual: Residual,
    pub(super) header_digest: bool,
    pub(super) data_digest: bool,
    pub(super) served: Option<Served>,
}

impl DataInStream {
    /// The next PDU, and whether it was the last.
    pub(super) fn next_pdu(&mut self) -> (OutPdu, bool) {
        let off = self.off;
        let burst_end = ((off / self.burst) + 1)
            .saturating_mul(self.burst)
            .min(self.xfer);
        let len = (self.xfer - off).min(self.seg).min(burst_end - off);
        let last = off + len == self.xfer;
        let mut b = Bhs::data_in(iscsi::DataIn {
            lun: self.lun_wire,
            itt: self.itt,
            datasn: self.datasn,
            buffer_offset: off,
            len,
            final_in_sequence: off + len == burst_end,
            status: last.then_some(iscsi::DataInStatus {
                scsi_status: ramslog_common::scsi_wire::status::GOOD,
                statsn: self.statsn,
                residual: self.residual,
            }),
        });
        b.set_exp_cmdsn(self.exp_cmdsn);
        b.set_max_cmdsn(self.max_cmdsn);
        self.off += len;
        self.datasn += 1;
        let pdu = OutPdu {
            bhs: b,
            data: OutData::Store {
                volume: self.volume,
                offset: self.base + u64::from(off),
                len,
            },
            header_digest: self.header_digest,
            data_digest: self.data_digest,
            served: if last || len == 0 {
                self.served.take()
            } else {
                None
            },
        };
        (pdu, last || len == 0)
    }
}

/// The output side handed to the session: the action queue and StatSN.
pub(crate) struct Out<'a> {
    pub(super) q: &'a mut VecDeque<Queued>,
    pub(super) statsn: &'a mut u32,
}

impl Out<'_> {
    /// Next StatSN without advancing it (R2T, Data-In without status, pings).
    pub(super) fn peek_statsn(&self) -> u32 {
        *self.statsn
    }
    /// StatSN for a PDU that carries status, advancing it.
    pub(super) fn take_statsn(&mut self) -> u32 {
        let s = *self.statsn;
        *self.statsn = s.wrapping_add(1);
        s
    }
    pub(super) fn push(&mut self, pdu: OutPdu) {
        self.q.push_back(Queued::Action(Action::Send(pdu)));
    }
    pub(super) fn push_action(&mut self, action: Action) {
        self.q.push_back(Queued::Action(action));
    }
    pub(super) fn push_data_in(&mut self, stream: DataInStream) {
        self.q.push_back(Queued::DataIn(stream));
    }
    pub(super) fn close(&mut self) {
        self.q.push_back(Queued::Action(Action::Close));
    }
}

pub(crate) const fn is_reserved(tag: u32) -> bool {
    tag == RESERVED_TAG
}

/// The rejected header is returned as the Reject's data segment.
pub(super) fn rejected_header(bhs: &Bhs) -> Vec<u8> {
    bhs.as_bytes().to_vec()
}
