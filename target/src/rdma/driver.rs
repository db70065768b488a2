//! One iSER connection's loop: completions in, engine actions out (SENDs,
//! RDMA WRITEs of read data, RDMA READs of write data), receive reposting,
//! and the iSER message encoding.

use super::*;

enum Posted {
    Done,
    /// Out of a resource: retry once completions free it.
    Blocked(Action),
    Close,
}

/// The buffers only a logged-in connection needs.
pub(super) struct LargeBuffers {
    /// Read data that is not LUN memory, RDMA-written from here.
    datain: RegisteredBuffer,
    /// Parameter data, RDMA-read into here.
    bounce: RegisteredBuffer,
    /// Where a finished parameter-data READ is copied for the engine: the
    /// registered memory is only ever copied, never referenced.
    bounce_copy: Vec<u8>,
}

impl LargeBuffers {
    fn new(pd: &Arc<ProtectionDomain>) -> Result<LargeBuffers, verbs::Error> {
        Ok(LargeBuffers {
            datain: RegisteredBuffer::new(pd, DATAIN_SLOTS * DATAIN_SLOT_LEN, Access::LOCAL_WRITE)?,
            bounce: RegisteredBuffer::new(pd, BOUNCE_SLOTS * BOUNCE_SLOT_LEN, Access::LOCAL_WRITE)?,
            bounce_copy: vec![0; BOUNCE_SLOT_LEN],
        })
    }
}

pub(super) struct Driver<'a> {
    pub(super) id: &'a CmId,
    pub(super) send_cq: &'a CompletionQueue,
    pub(super) recv_cq: &'a CompletionQueue,
    pub(super) recv: SlotRing,
    /// Receives in the full ring, posted when the normal session begins.
    pub(super) full_recv_slots: usize,
    pub(super) pd: &'a Arc<ProtectionDomain>,
    pub(super) send: SlotRing,
    /// Registered after login.
    pub(super) large: Option<LargeBuffers>,
    pub(super) regions: &'a [super::LunRegistration],
    pub(super) conn: Connection,
    /// Send slots Rust holds (their last SEND completed).
    pub(super) free_send: Vec<Slot>,
    pub(super) free_datain: Vec<u32>,
    pub(super) free_bounce: Vec<u32>,
    pub(super) reads: ReadTable,
    pub(super) sq_in_flight: usize,
    pub(super) sq_depth: usize,
    pub(super) held: Option<Action>,
    /// Set when the engine asked to close: wait for our SENDs until then.
    pub(super) closing: Option<Instant>,
    pub(super) peer_gone: bool,
    pub(super) hello_credits: u16,
    /// Its place among the daemon's connections, given back when the
    /// driver is dropped: after the queue pair was destroyed.
    pub(super) _permit: Permit,
    /// Since when an action waits for a send slot or credit.
    pub(super) blocked_since: Option<Instant>,
    /// A send that makes no progress this long ends the connection.
    pub(super) output_stall: Duration,
    /// The session's transfers into LUN memory: raised for every RDMA READ
    /// into the LUN while it is posted (see `admission::Transfers`).
    pub(super) transfers: Option<Arc<Transfers>>,
}

impl<'a> Driver<'a> {
    /// RDMA READs into LUN memory still posted: once the queue pair is
    /// destroyed they can no longer land, and their count is lowered.
    pub(super) fn reads_into_lun(&self) -> usize {
        self.reads.reads_into_lun()
    }

    pub(super) fn run(
        &mut self,
        events: &EventChannel,
        comp: &CompletionChannel,
        control: &SessionControl,
        opts: IserOptions,
    ) -> Result<(), ConnError> {
        let mut wcs: [WorkCompletion; 32] = std::array::from_fn(|_| WorkCompletion::default());
        let mut spin = SpinBudget::new(opts.spin);
        // The timers here are whole seconds: the coarse clock serves them
        // without a system call per round.
        let clock = CoarseClock::new();
        loop {
            let now = clock.now();
            // While output is blocked no receive is consumed: the peer's
            // messages wait in the receive queue (and then RNR-retry), so the
            // engine queues nothing more for a peer that takes nothing.
            let n = self.reap(now, &mut wcs, self.held.is_none())?;
            if self.conn.poll_timeout().is_some_and(|t| t <= now) {
                self.conn.handle(now, Input::Timeout);
            }
            while let Some(event) = self.conn.poll_event() {
                match event {
                    Event::NormalSession {
                        iser_peer,
                        transfers,
                    } => self.begin_normal_session(iser_peer, transfers)?,
                }
            }
            if self.drain_actions(now)? || self.conn.is_closed() {
                self.closing.get_or_insert(now);
            }
            match (&self.held, self.blocked_since) {
                (Some(_), None) => self.blocked_since = Some(now),
                (None, Some(_)) => self.blocked_since = None,
                (Some(_), Some(since)) if now.duration_since(since) > self.output_stall => {
                    self.conn
                        .portal()
                        .core
                        .counters
                        .limit_hit(LimitHit::OutputStall);
                    return Err(ConnError::Protocol(format!(
                        "no send completed for {:?}: the initiator takes nothing (posts no receives); closing",
                        self.output_stall
                    )));
                }
                _ => {}
            }
            if control.is_terminated() && !self.conn.termination_seen() && !self.peer_gone {
                // A planned restart's notice goes out (and is sent, within
                // the close grace) before the connection ends: also when the
                // engine closed first because a write met the restart's
                // fence before the termination was seen.
                self.conn.handle(now, Input::Terminated);
                if self.conn.has_ended() {
                    return Ok(());
                }
                self.closing = None;
                continue;
            }
            if let Some(since) = self.closing {
                if self.sq_in_flight == 0 || now.duration_since(since) > CLOSE_GRACE {
                    return Ok(());
                }
            }
            if self.peer_gone {
                return Ok(());
            }
            if spin.poll_again(n) {
                continue;
            }
            // Sleep. Receives always wake us; send-side completions only when
            // something waits for them (an RDMA READ, a held action, a close).
            let recv_armed = self.held.is_none();
            let send_armed =
                self.reads.in_flight() > 0 || self.held.is_some() || self.closing.is_some();
            let (recv_cq, send_cq) = (self.recv_cq, self.send_cq);
            let armed_buf = [recv_cq, send_cq];
            let armed: &[&CompletionQueue] = match (recv_armed, send_armed) {
                (true, true) => &armed_buf,
                (true, false) => &armed_buf[..1],
                (false, true) => &armed_buf[1..],
                (false, false) => &[],
            };
            wait::arm(armed)?;
            if self.reap(now, &mut wcs, recv_armed)? > 0 {
                spin.reset();
                continue;
            }
            let timeout = self
                .conn
                .poll_timeout()
                .map(|t| t.saturating_duration_since(now))
                .unwrap_or(MAX_SLEEP)
                .min(MAX_SLEEP);
            let woken =
                wait::sleep_or_wake(comp, armed, Some(events), control.wake_fd(), Some(timeout))?;
            if woken.cm {
                self.cm_events(events);
            }
            if woken.wake {
                control.take_wake();
            }
            spin.reset();
        }
    }

    /// Poll the completion queues once (the receive queue only when
    /// `receive`) and handle what they hold.
    fn reap(
        &mut self,
        now: Instant,
        wcs: &mut [WorkCompletion],
        receive: bool,
    ) -> Result<usize, ConnError> {
        let mut total = 0;
        for recv in [true, false] {
            if recv && !receive {
                continue;
            }
            let cq = if recv { self.recv_cq } else { self.send_cq };
            let n = cq.poll(wcs)?;
            for wc in &mut wcs[..n] {
                self.completion(now, wc)?;
            }
            total += n;
        }
        if self.recv.queued() >= REPOST_BATCH {
            self.flush_reposts()?;
        }
        Ok(total)
    }

    fn cm_events(&mut self, events: &EventChannel) {
        loop {
            match events.get_event() {
                Ok(e) if e.kind.ends_connection() => {
                    tracing::info!(peer = %self.conn_peer(), "iSER: {:?}", e.kind);
                    self.peer_gone = true;
                }
                Ok(e) => tracing::debug!("iSER connection event {:?}", e.kind),
                Err(e) if e.source.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("iSER: {e}");
                    self.peer_gone = true;
                    return;
                }
            }
        }
    }

    fn conn_peer(&self) -> String {
        self.id
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into())
    }

    fn completion(&mut self, now: Instant, wc: &mut WorkCompletion) -> Result<(), ConnError> {
        let (kind, slot) = (wc.wr_id.kind, wc.wr_id.slot as usize);
        if kind != wr::RECV {
            self.sq_in_flight = self.sq_in_flight.saturating_sub(1);
        }
        if !wc.is_ok() {
            // After a disconnect every posted request comes back flushed.
            self.peer_gone = true;
            return Err(ConnError::Protocol(format!(
                "work request failed: {} (opcode {:?}, vendor error {:#x})",
                wc.status_str(),
                wc.opcode,
                wc.vendor_err
            )));
        }
        match kind {
            wr::RECV => {
                let len = wc.byte_len as usize;
                let Some(slot) = self.recv.reclaim(wc) else {
                    return Err(ConnError::Protocol(format!(
                        "receive completion for no slot of ours: {:?}",
                        wc.wr_id
                    )));
                };
                if self.closing.is_none() {
                    self.received(now, &slot, len)?;
                }
                self.recv.repost(slot);
            }
            wr::SEND => {
                let Some(slot) = self.send.reclaim(wc) else {
                    return Err(ConnError::Protocol(format!(
                        "send completion for no slot of ours: {:?}",
                        wc.wr_id
                    )));
                };
                if !self.send.is_retired(&slot) {
                    self.free_send.push(slot);
                }
            }
            wr::DATAIN => self.free_datain.push(slot as u32),
            wr::WRITE_STORE => {}
            wr::READ => {
                let Some(read) = self.reads.complete(slot) else {
                    return Err(ConnError::Protocol(
                        "completion for an unknown RDMA READ".into(),
                    ));
                };
                if read.bounce.is_none() {
                    // The bytes are in LUN memory: the transfer is over.
                    if let Some(t) = &self.transfers {
                        t.end();
                    }
                }
                match read.bounce {
                    Some(b) => {
                        let start = b as usize * BOUNCE_SLOT_LEN;
                        let Some(large) = self.large.as_mut() else {
                            return Err(ConnError::Protocol("no parameter-data buffer".into()));
                        };
                        let Some(data) = large.bounce_copy.get_mut(..read.len as usize) else {
                            return Err(ConnError::Protocol("RDMA READ beyond its buffer".into()));
                        };
                        if large.bounce.read(start, data).is_none() {
                            return Err(ConnError::Protocol("RDMA READ beyond its buffer".into()));
                        }
                        self.conn.handle(
                            now,
                            Input::RdmaReadDone {
                                tag: read.tag,
                                data,
                            },
                        );
                        self.free_bounce.push(b);
                    }
                    None => self.conn.handle(
                        now,
                        Input::RdmaReadDone {
                            tag: read.tag,
                            data: &[],
                        },
                    ),
                }
            }
            _ => {
                debug_assert!(wc.opcode != WcOpcode::Recv);
                return Err(ConnError::Protocol(format!(
                    "unknown work request {:?}",
                    wc.wr_id
                )));
            }
        }
        Ok(())
    }

    fn flush_reposts(&mut self) -> Result<(), ConnError> {
        self.recv.flush(self.id, Vec::new())?;
        Ok(())
    }

    /// One received message: an iSCSI PDU behind its iSER header, or a Hello.
    fn received(&mut self, now: Instant, slot: &Slot, len: usize) -> Result<(), ConnError> {
        let Some(msg) = self.recv.bytes(slot, len) else {
            return Err(ConnError::Protocol(
                "receive slot outside its buffer".into(),
            ));
        };
        let pdu = match Message::parse(msg, self.conn.max_rx_data_segment()) {
            Ok(Message::Pdu(pdu)) => pdu,
            Ok(Message::Handshake(Header::Hello {
                max_ver, min_ver, ..
            })) => {
                let reject = !(min_ver..=max_ver).contains(&VERSION);
                return self.send_hello_reply(reject);
            }
            Ok(Message::Handshake(_)) => {
                return Err(ConnError::Protocol("HelloReply sent to a target".into()));
            }
            Err(IserError::Oversized { bhs, .. }) => {
                // The engine answers it (RFC 7143: a protocol error it reports).
                self.conn.handle(now, Input::Oversized(&bhs));
                return Ok(());
            }
            Err(e) => return Err(ConnError::Protocol(format!("bad iSER message: {e}"))),
        };
        self.conn.handle(now, Input::iser(&pdu));
        Ok(())
    }

    /// Once the login ends in a normal session (the final login response
    /// queued, at a PDU or at the end of a reinstatement wait), register
    /// what only a normal session uses. Called before queued actions are
    /// posted: the full receive ring is posted before the final login
    /// response, so the host's first commands find their receives.
    fn begin_normal_session(
        &mut self,
        iser_peer: Option<IserPeer>,
        transfers: Arc<Transfers>,
    ) -> Result<(), ConnError> {
        if self.large.is_some() {
            return Ok(());
        }
        // A discovery session or a peer still logging in pins its login
        // slots alone.
        self.grow_rings()?;
        self.large = Some(LargeBuffers::new(self.pd)?);
        self.transfers = Some(transfers);
        if iser_peer == Some(IserPeer::Illumos) {
            // The connect request looked like Linux but the login did
            // not: a peer we cannot place gets what illumos can take.
            self.reads
                .limit_credits(usize::from(peer::ILLUMOS_RDMA_READ_CREDITS));
        }
        Ok(())
    }

    fn grow_rings(&mut self) -> Result<(), ConnError> {
        if self.recv.is_full() {
            return Ok(());
        }
        let received = self.recv.grow(self.pd, self.full_recv_slots as u32)?;
        self.recv.flush(self.id, received)?;
        // Login slots still in flight retire as they complete; free ones
        // are dropped here.
        self.free_send = self.send.grow(self.pd, SEND_SLOTS as u32)?;
        Ok(())
    }

    fn send_hello_reply(&mut self, reject: bool) -> Result<(), ConnError> {
        let Some(mut slot) = self.free_send.pop() else {
            return Err(ConnError::Protocol(
                "no send slot for the HelloReply".into(),
            ));
        };
        let reply = Header::HelloReply {
            reject,
            max_ver: VERSION,
            cur_ver: VERSION,
            ord: self.hello_credits,
        };
        let slot_buf = self
            .send
            .slot_mut(&mut slot)
            .ok_or_else(|| ConnError::Protocol("send slot outside its buffer".into()))?;
        reply
            .encode_into(&mut slot_buf[..HEADER_LEN])
            .map_err(|e| ConnError::Protocol(e.to_string()))?;
        self.post_send_slot(slot, HEADER_LEN)
    }

    /// SEND the first `len` bytes of a send slot; its completion gives the
    /// slot back.
    fn post_send_slot(&mut self, slot: Slot, len: usize) -> Result<(), ConnError> {
        self.send.post_send(self.id, slot, len, SendOp::Send)?;
        self.sq_in_flight += 1;
        Ok(())
    }

    fn buffer_sge(
        buf: &RegisteredBuffer,
        start: usize,
        len: usize,
    ) -> Result<verbs::Sge<'_>, ConnError> {
        buf.sge(start, len as u32)
            .ok_or_else(|| ConnError::Protocol("slot outside its buffer".into()))
    }

    /// Post one send-queue request on `id` (the caller counts it in
    /// `sq_in_flight` once `sge`'s borrow of its buffer has ended). All are
    /// signaled: every completion frees a slot or a credit, and the send CQ
    /// wakes nobody unless armed.
    fn post_on(id: &CmId, wr_id: WrId, op: SendOp, sge: verbs::Sge<'_>) -> Result<(), ConnError> {
        id.post_send(&SendWr {
            wr_id,
            op,
            sge,
            signaled: true,
            inline: false,
        })?;
        Ok(())
    }

    /// Post what the engine queued, in order; true when it asked to close.
    fn drain_actions(&mut self, now: Instant) -> Result<bool, ConnError> {
        loop {
            let Some(action) = self.held.take().or_else(|| self.conn.poll_action()) else {
                return Ok(false);
            };
            if self.sq_in_flight >= self.sq_depth {
                self.held = Some(action);
                return Ok(false);
            }
            match self.post_action(now, action)? {
                Posted::Done => {}
                Posted::Blocked(a) => {
                    self.held = Some(a);
                    return Ok(false);
                }
                Posted::Close => return Ok(true),
            }
        }
    }

    fn post_action(&mut self, now: Instant, action: Action) -> Result<Posted, ConnError> {
        match action {
            Action::Send(pdu) => self.post_pdu(now, pdu),
            Action::RdmaWrite {
                stag,
                remote_addr,
                data,
            } => self.post_rdma_write(stag, remote_addr, data),
            Action::RdmaRead {
                tag,
                stag,
                remote_addr,
                len,
                dest,
            } => self.post_rdma_read(tag, stag, remote_addr, len, dest),
            Action::Close => Ok(Posted::Close),
        }
    }

    fn post_pdu(&mut self, now: Instant, pdu: OutPdu) -> Result<Posted, ConnError> {
        let Some(mut slot) = self.free_send.pop() else {
            return Ok(Posted::Blocked(Action::Send(pdu)));
        };
        let encoded = match self.send.slot_mut(&mut slot) {
            Some(slot_buf) => encode_pdu(&self.conn, &pdu, slot_buf).map_err(ConnError::Protocol),
            None => Err(ConnError::Protocol("send slot outside its buffer".into())),
        };
        let total = match encoded {
            Ok(n) => n,
            Err(e) => {
                self.free_send.push(slot);
                return Err(e);
            }
        };
        self.post_send_slot(slot, total)?;
        if let Some(served) = pdu.served {
            // A fresh reading: the loop's `now` may be rounds old.
            self.conn.handle(now, Input::served_now(served));
        }
        Ok(Posted::Done)
    }

    /// The registered bytes of a volume: `regions` is indexed by [`VolumeId`].
    /// The entry borrows the regions (`'a`, the connection's device entry),
    /// not this driver.
    fn volume_sge(
        &self,
        volume: VolumeId,
        offset: u64,
        len: u32,
    ) -> Result<verbs::Sge<'a>, ConnError> {
        let (regions, pd): (&'a [super::LunRegistration], &'a Arc<ProtectionDomain>) =
            (self.regions, self.pd);
        regions
            .get(volume.index())
            .and_then(|r| r.region(pd))
            .and_then(|r| r.sge(offset, len))
            .ok_or_else(|| {
                ConnError::Protocol(format!(
                    "RDMA names bytes {offset}+{len} of volume {} outside its registration",
                    volume.index()
                ))
            })
    }

    fn post_rdma_write(
        &mut self,
        stag: u32,
        remote_addr: u64,
        data: OutData,
    ) -> Result<Posted, ConnError> {
        let op = SendOp::RdmaWrite {
            remote_addr,
            rkey: stag,
        };
        match data {
            OutData::None => Ok(Posted::Done),
            OutData::Store {
                volume,
                offset,
                len,
            } => {
                let sge = self.volume_sge(volume, offset, len)?;
                Self::post_on(self.id, WrId::new(wr::WRITE_STORE, 0), op, sge)?;
                self.sq_in_flight += 1;
                Ok(Posted::Done)
            }
            OutData::Owned(v) => {
                if v.len() > DATAIN_SLOT_LEN {
                    return Err(ConnError::Protocol(format!(
                        "{} bytes of read data exceed the {DATAIN_SLOT_LEN}-byte staging slot",
                        v.len()
                    )));
                }
                let Some(slot) = self.free_datain.pop() else {
                    return Ok(Posted::Blocked(Action::RdmaWrite {
                        stag,
                        remote_addr,
                        data: OutData::Owned(v),
                    }));
                };
                let start = slot as usize * DATAIN_SLOT_LEN;
                let Some(large) = self.large.as_ref() else {
                    return Err(ConnError::Protocol("Data-In before login".into()));
                };
                if large.datain.write(start, &v).is_none() {
                    return Err(ConnError::Protocol(
                        "Data-In slot outside its buffer".into(),
                    ));
                }
                let sge = Self::buffer_sge(&large.datain, start, v.len())?;
                Self::post_on(self.id, WrId::new(wr::DATAIN, slot), op, sge)?;
                self.sq_in_flight += 1;
                Ok(Posted::Done)
            }
        }
    }

    fn post_rdma_read(
        &mut self,
        tag: u32,
        stag: u32,
        remote_addr: u64,
        len: u32,
        dest: ReadDest,
    ) -> Result<Posted, ConnError> {
        let blocked = Action::RdmaRead {
            tag,
            stag,
            remote_addr,
            len,
            dest,
        };
        let Some(read_slot) = self.reads.free_slot() else {
            return Ok(Posted::Blocked(blocked));
        };
        let into_lun = matches!(dest, ReadDest::Store { .. });
        if into_lun {
            // Raised before asking, so an abort either sees this READ or
            // this READ sees the abort.
            if let Some(t) = &self.transfers {
                t.begin();
            }
        }
        if !self.conn.may_post_rdma_read(tag) {
            // Its task was aborted (or ended) while the READ waited: it
            // must not place a byte.
            if let (true, Some(t)) = (into_lun, &self.transfers) {
                t.end();
            }
            return Ok(Posted::Done);
        }
        let (sge, bounce) = match dest {
            ReadDest::Store { volume, offset } => match self.volume_sge(volume, offset, len) {
                Ok(sge) => (sge, None),
                Err(e) => {
                    if let Some(t) = &self.transfers {
                        t.end();
                    }
                    return Err(e);
                }
            },
            ReadDest::Buffer => {
                if len as usize > BOUNCE_SLOT_LEN {
                    return Err(ConnError::Protocol(format!(
                        "{len}-byte parameter data exceeds the {BOUNCE_SLOT_LEN}-byte buffer"
                    )));
                }
                let Some(b) = self.free_bounce.pop() else {
                    return Ok(Posted::Blocked(blocked));
                };
                let Some(large) = &self.large else {
                    return Err(ConnError::Protocol("parameter data before login".into()));
                };
                let sge =
                    Self::buffer_sge(&large.bounce, b as usize * BOUNCE_SLOT_LEN, len as usize)?;
                (sge, Some(b))
            }
        };
        // Recorded before posting: a failed post leaves it to the teardown,
        // which lowers the count once the queue pair is gone.
        self.reads
            .record(read_slot, PendingRead { tag, len, bounce });
        Self::post_on(
            self.id,
            WrId::new(wr::READ, read_slot as u32),
            SendOp::RdmaRead {
                remote_addr,
                rkey: stag,
            },
            sge,
        )?;
        self.sq_in_flight += 1;
        self.reads.posted();
        Ok(Posted::Done)
    }
}

/// Encode one PDU as an iSER message (header, BHS, unpadded data) into
/// `out`; returns its length. Errors say why it cannot be sent: larger than
/// `out` (the 16 KiB iSER message), or LUN bytes that cannot be read — then
/// nothing must be sent in their place.
pub fn encode_pdu(conn: &Connection, pdu: &OutPdu, out: &mut [u8]) -> Result<usize, String> {
    iser::encode_message(&Header::PLAIN, &pdu.bhs, pdu.data.len(), out, |dst| {
        pdu.data.fill(&conn.portal().core.volumes, dst)
    })
    .map_err(|e| match e {
        IserError::DataUnavailable => "PDU names bytes outside the LUN".into(),
        e => format!("{:?} PDU: {e}", pdu.bhs.opcode()),
    })
}
