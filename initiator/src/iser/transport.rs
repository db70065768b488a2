//! The RDMA side of an iSER session: rdma_cm connection setup as each
//! profile's initiator does it, the queue pair, and the registered receive
//! and send buffers; one iSCSI PDU per SEND.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::Bhs;
use ramslog_common::iser::{self, peer, Header};
use ramslog_common::verbs::{
    Access, CmEventKind, CmId, CompletionChannel, CompletionQueue, ConnParam, EventChannel,
    ProtectionDomain, QpCaps, RecvWr, RegisteredBuffer, SendOp, SendWr, Sge, WrId,
};

use super::{IserOptions, IserProfile, EXTRA_SLOTS, HEADERS_LEN, RECV_WR, SEND_SLOT_LEN, SEND_WR};
use crate::Error;

/// Timeout of rdma_cm's address and route resolution, milliseconds.
const RESOLVE_TIMEOUT_MS: i32 = 5000;

/// The RDMA side: the connection, its queues and its message buffers.
/// Field order is drop order: the id (and its QP) goes first.
pub(super) struct Rdma {
    pub(super) id: CmId,
    pub(super) events: EventChannel,
    /// Receives: always armed before sleeping.
    pub(super) recv_cq: Arc<CompletionQueue>,
    /// Send completions only free send slots: reaped in passing, armed only
    /// when a slot is needed, so a command's SEND does not cost a wake-up.
    pub(super) send_cq: Arc<CompletionQueue>,
    pub(super) comp: Arc<CompletionChannel>,
    pub(super) recv: Vec<RegisteredBuffer>,
    /// Receive slots to post again at the next flush.
    pub(super) reposts: Vec<usize>,
    pub(super) send: RegisteredBuffer,
    pub(super) free_send: Vec<usize>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) recv_len: usize,
    /// A received message copied out of its registered buffer, and a
    /// message built before it is copied into one: registered memory is
    /// only ever copied (the adapter may write it), never referenced.
    rx_copy: Vec<u8>,
    tx_copy: Vec<u8>,
}

impl Rdma {
    /// Resolve, create the queues and buffers, connect, wait for Established.
    pub(super) fn connect(addr: SocketAddr, opts: &IserOptions) -> Result<Rdma, Error> {
        let deadline = Instant::now() + opts.timeout;
        let events = EventChannel::new()?;
        events.set_nonblocking(true)?;
        let mut id = CmId::new(&events)?;
        let source = opts.source.map(|ip| SocketAddr::new(ip, 0));
        id.resolve_addr(source, addr, RESOLVE_TIMEOUT_MS)?;
        events.wait_for(CmEventKind::AddrResolved, deadline)?;
        id.resolve_route(RESOLVE_TIMEOUT_MS)?;
        events.wait_for(CmEventKind::RouteResolved, deadline)?;
        let dev = id.device().map_err(|e| {
            Error::Rdma(format!(
                "{addr}: no RDMA device after route resolution: {e}"
            ))
        })?;
        let attrs = dev.attrs()?;
        // Every command may have its response (and a ping) in flight at once.
        let slots = opts.queue_depth + EXTRA_SLOTS;
        if slots > attrs.max_qp_wr as usize {
            return Err(Error::InvalidArgument(format!(
                "queue depth {} needs {slots} work requests per queue; {} allows {}",
                opts.queue_depth,
                dev.name(),
                attrs.max_qp_wr
            )));
        }
        let (recv_slots, send_slots) = (slots, slots);
        let pd = ProtectionDomain::new(&dev)?;
        let comp = Arc::new(CompletionChannel::new(&dev)?);
        comp.set_nonblocking(true)?;
        let recv_cq = CompletionQueue::new(&dev, recv_slots as u32, Some(&comp))?;
        let send_cq = CompletionQueue::new(&dev, send_slots as u32, Some(&comp))?;
        id.create_qp_split(
            &pd,
            &send_cq,
            &recv_cq,
            QpCaps {
                max_send_wr: send_slots as u32,
                max_recv_wr: recv_slots as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
        )?;
        let recv_len = opts.profile.recv_len();
        let mut recv = Vec::with_capacity(recv_slots);
        for _ in 0..recv_slots {
            recv.push(RegisteredBuffer::new(&pd, recv_len, Access::LOCAL_WRITE)?);
        }
        let send = RegisteredBuffer::new(&pd, send_slots * SEND_SLOT_LEN, Access::empty())?;
        let mut rdma = Rdma {
            id,
            events,
            recv_cq,
            send_cq,
            comp,
            reposts: Vec::with_capacity(recv_slots),
            recv,
            send,
            free_send: (0..send_slots).rev().collect(),
            pd,
            recv_len,
            rx_copy: vec![0; recv_len],
            tx_copy: vec![0; SEND_SLOT_LEN],
        };
        for slot in 0..recv_slots {
            rdma.queue_recv(slot)?;
        }
        rdma.flush_reposts()?;
        let private = opts.profile.private_data();
        let param = match opts.profile {
            // iser_route_handler: the target may read from us as much as the
            // device allows; we issue one RDMA READ at a time (never, in fact).
            IserProfile::Linux => ConnParam {
                private_data: &private,
                responder_resources: attrs.max_qp_rd_atom.min(255) as u8,
                initiator_depth: 1,
                retry_count: 7,
                rnr_retry_count: opts.rnr_retry.unwrap_or(6),
            },
            // iser_ib_open_rc_channel: oc_rdma_ra_in/out = 4, path retry and
            // RNR retry 2.
            IserProfile::Illumos => ConnParam {
                private_data: &private,
                responder_resources: peer::ILLUMOS_RDMA_READ_CREDITS,
                initiator_depth: peer::ILLUMOS_RDMA_READ_CREDITS,
                retry_count: 2,
                rnr_retry_count: opts.rnr_retry.unwrap_or(2),
            },
        };
        rdma.id.connect(&param)?;
        rdma.events.wait_for(CmEventKind::Established, deadline)?;
        Ok(rdma)
    }

    pub(super) fn queue_recv(&mut self, slot: usize) -> Result<(), Error> {
        self.recv_entry(slot)?;
        self.reposts.push(slot);
        Ok(())
    }

    /// The receive request for `slot` (its entry borrows the buffer).
    fn recv_entry(&self, slot: usize) -> Result<RecvWr<'_>, Error> {
        let sge = self
            .recv
            .get(slot)
            .and_then(|b| b.sge(0, self.recv_len as u32))
            .ok_or_else(|| Error::Rdma("receive slot outside its buffer".into()))?;
        Ok(RecvWr {
            wr_id: WrId::new(RECV_WR, slot as u32),
            sge,
        })
    }

    /// Post the queued receives, in batches built on the stack: the data
    /// path allocates nothing per command.
    pub(super) fn flush_reposts(&mut self) -> Result<(), Error> {
        const BATCH: usize = 16;
        let mut done = 0;
        while done < self.reposts.len() {
            let n = (self.reposts.len() - done).min(BATCH);
            let mut wrs = [RecvWr {
                wr_id: WrId::default(),
                sge: Sge::default(),
            }; BATCH];
            for (wr, &slot) in wrs.iter_mut().zip(&self.reposts[done..done + n]) {
                *wr = self.recv_entry(slot)?;
            }
            if let Err(e) = self.id.post_recv_batch(&wrs[..n]) {
                // Those posted are the adapter's: never posted twice.
                self.reposts.drain(..done + e.posted);
                return Err(e.error.into());
            }
            done += n;
        }
        self.reposts.clear();
        Ok(())
    }

    /// The first `len` bytes received into `slot`, copied out.
    pub(super) fn received(&mut self, slot: usize, len: usize) -> Option<&[u8]> {
        let out = self.rx_copy.get_mut(..len)?;
        self.recv.get(slot)?.read(0, out)?;
        Some(out)
    }

    /// SEND one PDU from a free slot (the caller made sure there is one):
    /// iSER header, BHS (lengths filled in), data unpadded.
    pub(super) fn post_pdu(
        &mut self,
        header: &Header,
        bhs: &Bhs,
        data: &[u8],
    ) -> Result<(), Error> {
        let total = HEADERS_LEN + data.len();
        if total > SEND_SLOT_LEN {
            return Err(Error::InvalidArgument(format!(
                "a {total}-byte iSER message exceeds the {SEND_SLOT_LEN}-byte send buffer"
            )));
        }
        let msg = &mut self.tx_copy[..total];
        iser::encode_message(header, bhs, data.len(), msg, |dst| {
            dst.copy_from_slice(data);
            true
        })
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let slot = self
            .free_send
            .pop()
            .ok_or_else(|| Error::Rdma("no free send slot".into()))?;
        let start = slot * SEND_SLOT_LEN;
        if self.send.write(start, msg).is_none() {
            self.free_send.push(slot);
            return Err(Error::Rdma(format!(
                "{total}-byte message exceeds its send slot"
            )));
        }
        let sge = self
            .send
            .sge(start, total as u32)
            .ok_or_else(|| Error::Rdma("send slot outside its buffer".into()))?;
        let r = self.id.post_send(&SendWr {
            wr_id: WrId::new(SEND_WR, slot as u32),
            op: SendOp::Send,
            sge,
            signaled: true,
            inline: false,
        });
        if let Err(e) = r {
            self.free_send.push(slot);
            return Err(e.into());
        }
        Ok(())
    }
}
