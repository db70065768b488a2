//! How data moves on the session's transport, chosen once when the session
//! starts: the part of the engine LIO keeps behind `iscsit_transport`. Over
//! TCP a write's data comes as Data-Out, R2Ts soliciting what was not sent
//! unsolicited, and a read's goes out as Data-In PDUs. Over iSER the target
//! RDMA-reads the initiator's buffer and RDMA-writes read data straight from
//! the volume extent; only control PDUs travel as messages.

use ramslog_common::iscsi::{self, Bhs, Residual};
use ramslog_common::iser::{peer, RemoteBuffer};
use ramslog_common::lun::Lun;
use ramslog_common::scsi_wire::status;

use super::{
    DataSource, R2t, Sequence, Session, Task, DATA_IN_SEGMENT_MAX, ISER_BUFFERED_READ_MAX,
};
use crate::iscsi::engine::login::SessionKind;
use crate::iscsi::engine::params::Params;
use crate::iscsi::engine::IserPeer;
use crate::iscsi::engine::{Action, DataInStream, Out, OutData, ReadDest, RemoteBuffers};
use crate::scsi::{OutPlacement, SenseReason};

/// The transport's way of moving data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DataPath {
    /// iSCSI/TCP: R2T, Data-Out and Data-In PDUs.
    Pdus,
    /// iSER: RDMA READ and WRITE, within the limits of the peer.
    Rdma(IserPeer),
}

impl DataPath {
    pub(super) fn of(params: &Params) -> DataPath {
        match params.iser_peer() {
            Some(peer) => DataPath::Rdma(peer),
            None => DataPath::Pdus,
        }
    }

    /// The transport's limits on the negotiated values.
    pub(super) fn settle(self, params: &mut Params, kind: SessionKind) {
        let DataPath::Rdma(_) = self else {
            return;
        };
        // Everything we send over iSER is one SEND into a 16 KiB message.
        params.initiator_mrdsl = params.initiator_mrdsl.min(peer::ILLUMOS_MAX_RECV_DATA);
        if params.rdma_extensions && kind == SessionKind::Normal {
            // Linux ib_iser receives full-feature PDUs into buffers with 128
            // bytes of data room, whatever it declared during login (a
            // discovery session keeps its login buffer).
            params.initiator_mrdsl = params
                .initiator_mrdsl
                .min(peer::LINUX_FULL_FEATURE_RECV_DATA);
        }
    }

    /// Whether a command that reads `edtl` bytes can return them: over iSER
    /// the command must name the buffer they are written to.
    pub(super) fn can_return(self, edtl: u32, buffers: &RemoteBuffers) -> bool {
        match self {
            DataPath::Pdus => true,
            DataPath::Rdma(_) => edtl == 0 || buffers.read.is_some(),
        }
    }

    /// How a write whose unsolicited data ends at `unsolicited_end` fetches
    /// the rest.
    pub(super) fn fetch(self, buffers: &RemoteBuffers, unsolicited_end: u32) -> Fetch {
        match self {
            DataPath::Pdus => Fetch::R2ts {
                next_r2tsn: 0,
                outstanding: Vec::new(),
            },
            DataPath::Rdma(_) => Fetch::RdmaRead {
                remote: buffers.write,
                base: unsolicited_end,
                in_flight: None,
            },
        }
    }

    /// The most write data the transport can fetch into a buffer of the
    /// driver's (data the SCSI device must see whole), if it is limited.
    pub(super) fn buffered_fetch_max(self) -> Option<u32> {
        match self {
            DataPath::Pdus => None,
            DataPath::Rdma(_) => Some(ISER_BUFFERED_READ_MAX),
        }
    }
}

/// How a write's data past its unsolicited part is fetched, and what of it
/// the task is waiting for.
pub(super) enum Fetch {
    /// TCP: R2Ts ask for it burst by burst, each answered by Data-Out.
    R2ts {
        next_r2tsn: u32,
        outstanding: Vec<R2t>,
    },
    /// iSER: one RDMA READ pulls it from the initiator's buffer.
    RdmaRead {
        /// The buffer the iSER header named for the write data not sent
        /// unsolicited; its address is that of byte `base` as the command
        /// arrived (RFC 7145 9.2; Linux sets it to buffer + unsolicited
        /// length).
        remote: Option<RemoteBuffer>,
        base: u32,
        in_flight: Option<RdmaReadInFlight>,
    },
}

/// An RDMA READ of `len` bytes at write offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RdmaReadInFlight {
    pub(super) tag: u32,
    pub(super) offset: u32,
    pub(super) len: u32,
}

impl Fetch {
    /// Nothing solicited is outstanding.
    pub(super) fn idle(&self) -> bool {
        match self {
            Fetch::R2ts { outstanding, .. } => outstanding.is_empty(),
            Fetch::RdmaRead { in_flight, .. } => in_flight.is_none(),
        }
    }

    pub(super) fn reading(&self, tag: u32) -> bool {
        matches!(self, Fetch::RdmaRead { in_flight: Some(r), .. } if r.tag == tag)
    }
}

impl Session {
    /// Fetch a write's data past what arrived unsolicited: R2Ts for the next
    /// ranges, up to MaxOutstandingR2T; over iSER, one RDMA READ of all of
    /// it. Called only once the unsolicited sequence ended, so a short one
    /// is simply continued. False when the data cannot be fetched: the
    /// command must fail.
    pub(super) fn solicit(&mut self, out: &mut Out, task: &mut Task) -> bool {
        let Fetch::R2ts {
            next_r2tsn,
            outstanding,
        } = &mut task.fetch
        else {
            return self.solicit_rdma(out, task);
        };
        while task.solicit_next < task.moved
            && (outstanding.len() as u32) < self.params.max_outstanding_r2t
        {
            let offset = task.solicit_next;
            let len = (task.moved - offset).min(self.params.max_burst_len);
            let ttt = self.new_ttt();
            let mut b = Bhs::r2t(iscsi::R2t {
                lun: task.lun.to_wire(),
                itt: task.itt,
                ttt,
                r2tsn: *next_r2tsn,
                buffer_offset: offset,
                desired_len: len,
            });
            b.set_statsn(out.peek_statsn());
            self.stamp(&mut b);
            *next_r2tsn = next_r2tsn.wrapping_add(1);
            task.solicit_next += len;
            outstanding.push(R2t {
                ttt,
                seq: Sequence::new(offset, offset + len),
            });
            let pdu = self.pdu(b, OutData::None);
            out.push(pdu);
        }
        true
    }

    fn solicit_rdma(&mut self, out: &mut Out, task: &mut Task) -> bool {
        let Fetch::RdmaRead {
            remote,
            base,
            in_flight,
        } = &mut task.fetch
        else {
            return false;
        };
        if in_flight.is_some() || task.solicit_next >= task.moved {
            return true;
        }
        let (offset, len) = (task.solicit_next, task.moved - task.solicit_next);
        let Some(remote) = *remote else {
            return false;
        };
        // Data the initiator meant to send unsolicited but did not is not in
        // the tagged buffer: refuse instead of reading the wrong bytes.
        let Some(remote_addr) = offset
            .checked_sub(*base)
            .and_then(|rel| remote.at(rel.into()))
        else {
            tracing::warn!(
                itt = task.itt,
                offset,
                "iSER write data missing below the tagged buffer"
            );
            return false;
        };
        let dest = match task.plan.out_placement {
            OutPlacement::Store {
                volume,
                offset: base,
            } => ReadDest::Store {
                volume,
                offset: base + u64::from(offset),
            },
            _ => ReadDest::Buffer,
        };
        let tag = self.next_rdma_tag;
        self.next_rdma_tag = self.next_rdma_tag.wrapping_add(1).max(1);
        *in_flight = Some(RdmaReadInFlight { tag, offset, len });
        task.solicit_next = task.moved;
        out.push_action(Action::RdmaRead {
            tag,
            stag: remote.stag,
            remote_addr,
            len,
            dest,
        });
        true
    }

    /// A read's data: Data-In PDUs, the last one carrying GOOD status, or on
    /// iSER one RDMA WRITE to `read_buffer` and a SCSI Response.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_data_in(
        &mut self,
        out: &mut Out,
        itt: u32,
        lun: Lun,
        src: DataSource,
        produced: u32,
        edtl: u32,
        read_buffer: Option<RemoteBuffer>,
    ) {
        let xfer = produced.min(edtl);
        let residual = Residual::between(edtl, produced);
        self.counting.bytes = xfer;
        if xfer == 0 {
            self.respond(out, itt, status::GOOD, None, residual);
            return;
        }
        match self.data_path {
            DataPath::Pdus => self.data_in_pdus(out, itt, lun, src, xfer, residual),
            DataPath::Rdma(_) => {
                self.data_in_rdma_write(out, itt, src, xfer, residual, read_buffer)
            }
        }
    }

    /// iSER: one RDMA WRITE of the read data to the buffer the command named,
    /// straight from the volume extent, then the SCSI Response.
    fn data_in_rdma_write(
        &mut self,
        out: &mut Out,
        itt: u32,
        src: DataSource,
        xfer: u32,
        residual: Residual,
        read_buffer: Option<RemoteBuffer>,
    ) {
        // Checked when the command arrived; the address cannot overflow
        // once the initiator registered that many bytes there.
        let Some(remote) = read_buffer else {
            self.fail(out, itt, SenseReason::DataPhaseError, residual);
            return;
        };
        let data = match src {
            DataSource::Store { volume, offset } => OutData::Store {
                volume,
                offset,
                len: xfer,
            },
            DataSource::Buffer(v) => OutData::Owned(v[..xfer as usize].to_vec()),
        };
        out.push_action(Action::RdmaWrite {
            stag: remote.stag,
            remote_addr: remote.va,
            data,
        });
        self.respond(out, itt, status::GOOD, None, residual);
    }

    /// TCP: Data-In PDUs of at most the initiator's MaxRecvDataSegmentLength,
    /// F at each MaxBurstLength boundary, the last one carrying GOOD status.
    /// LUN data is streamed: each PDU's bytes are read when it is written out.
    fn data_in_pdus(
        &mut self,
        out: &mut Out,
        itt: u32,
        lun: Lun,
        src: DataSource,
        xfer: u32,
        residual: Residual,
    ) {
        let seg = self.params.initiator_mrdsl.clamp(512, DATA_IN_SEGMENT_MAX);
        let burst = self.params.max_burst_len.max(seg);
        let buffer = match src {
            DataSource::Buffer(v) => v,
            DataSource::Store {
                volume,
                offset: base,
            } => {
                let statsn = out.take_statsn();
                let mut stream = DataInStream {
                    itt,
                    volume,
                    lun_wire: lun.to_wire(),
                    base,
                    xfer,
                    off: 0,
                    datasn: 0,
                    seg,
                    burst,
                    statsn,
                    exp_cmdsn: self.exp_cmdsn,
                    max_cmdsn: self.max_cmdsn(),
                    residual,
                    header_digest: self.params.header_digest,
                    data_digest: self.params.data_digest,
                    served: None,
                };
                stream.served = self.count_status(status::GOOD, None);
                self.note_max_cmdsn(stream.max_cmdsn);
                out.push_data_in(stream);
                return;
            }
        };
        let mut off = 0u32;
        let mut datasn = 0u32;
        while off < xfer {
            let burst_end = ((off / burst) + 1).saturating_mul(burst).min(xfer);
            let len = (xfer - off).min(seg).min(burst_end - off);
            let last = off + len == xfer;
            let mut b = Bhs::data_in(iscsi::DataIn {
                lun: lun.to_wire(),
                itt,
                datasn,
                buffer_offset: off,
                len,
                final_in_sequence: off + len == burst_end,
                status: last.then(|| iscsi::DataInStatus {
                    scsi_status: status::GOOD,
                    statsn: out.take_statsn(),
                    residual,
                }),
            });
            self.stamp(&mut b);
            let data = OutData::Owned(buffer[off as usize..(off + len) as usize].to_vec());
            let mut pdu = self.pdu(b, data);
            if last {
                pdu.served = self.count_status(status::GOOD, None);
            }
            out.push(pdu);
            off += len;
            datasn += 1;
        }
    }
}
