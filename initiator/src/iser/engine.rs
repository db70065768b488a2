//! The session's engine: sending, the completion loop, received PDUs, and
//! task completion.

use super::*;

impl IserSession {
    pub(super) fn ctl_itt(&mut self) -> u32 {
        // Command tags have bit 31 clear; control tags set it (never 0xffffffff).
        self.next_ctl_itt = self.next_ctl_itt.wrapping_add(1) % 0x7fff_ffff;
        0x8000_0000 | self.next_ctl_itt
    }

    pub(super) fn check(&self) -> Result<(), Error> {
        match &self.fatal {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Make `e` the session's sticky error (the first one stays) and return it.
    pub(super) fn fail(&mut self, e: Error) -> Error {
        if self.fatal.is_none() {
            if self.logging_out {
                tracing::debug!(error = %e, "iSER session ended after logout");
            } else {
                tracing::warn!(error = %e, "iSER session failed");
            }
            self.fatal = Some(e);
        }
        self.fatal.clone().unwrap_or(Error::Closed)
    }

    pub(super) fn sticky<T>(&mut self, r: Result<T, Error>) -> Result<T, Error> {
        r.map_err(|e| self.fail(e))
    }

    /// SEND a PDU, waiting for a free send slot.
    pub(super) fn send(
        &mut self,
        header: &Header,
        bhs: &Bhs,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), Error> {
        while self.rdma.free_send.is_empty() {
            self.turn_or_timeout(deadline, "a free send slot")?;
        }
        let r = self.rdma.post_pdu(header, bhs, data);
        self.sticky(r)
    }

    /// Wait for the control PDU with `itt` (or a Reject of the PDU with it).
    pub(super) fn wait_control(
        &mut self,
        itt: u32,
        what: &str,
        deadline: Instant,
    ) -> Result<(Bhs, Vec<u8>), Error> {
        loop {
            let hit = self.control.iter().position(|(b, d)| {
                b.itt() == itt
                    || (b.opcode() == Some(Opcode::Reject) && d.len() >= 48 && be32(d, 16) == itt)
            });
            if let Some(i) = hit {
                if let Some(found) = self.control.remove(i) {
                    return Ok(found);
                }
            }
            self.turn_or_timeout(deadline, what)?;
        }
    }

    /// One turn, or the session's timeout error once `deadline` has passed.
    pub(super) fn turn_or_timeout(&mut self, deadline: Instant, what: &str) -> Result<(), Error> {
        if Instant::now() >= deadline {
            return Err(self.fail(Error::Timeout(what.to_string())));
        }
        self.turn(deadline)
    }

    /// Handle what has arrived; sleep until something does or `deadline`.
    pub(super) fn turn(&mut self, deadline: Instant) -> Result<(), Error> {
        self.check()?;
        let r = self.turn_inner(deadline);
        self.sticky(r)
    }

    pub(super) fn poll_once(&mut self) -> Result<usize, Error> {
        let n = self.reap()?;
        self.rdma.flush_reposts()?;
        Ok(n)
    }

    pub(super) fn turn_inner(&mut self, deadline: Instant) -> Result<(), Error> {
        let mut spin = SpinBudget::new(self.opts.spin);
        loop {
            let found = self.poll_once()?;
            if found > 0 {
                return Ok(());
            }
            if self.peer_disconnected {
                // Everything that arrived before the disconnect is handled.
                return Err(Error::Closed);
            }
            let now = Instant::now();
            let next_ping = self.idle_ping_due(now)?;
            if now >= deadline {
                return Ok(());
            }
            if spin.poll_again(found) {
                continue;
            }
            spin.reset();
            // Receives always wake us; sends only when a send slot is awaited.
            let send_armed = self.rdma.free_send.is_empty();
            let armed_count = if send_armed { 2 } else { 1 };
            wait::arm(&[&*self.rdma.recv_cq, &*self.rdma.send_cq][..armed_count])?;
            if self.poll_once()? > 0 {
                return Ok(());
            }
            let wake = next_ping.map_or(deadline, |p| p.min(deadline));
            let woken = wait::sleep(
                &self.rdma.comp,
                &[&*self.rdma.recv_cq, &*self.rdma.send_cq][..armed_count],
                Some(&self.rdma.events),
                Some(wake.saturating_duration_since(now)),
            )?;
            if woken.cm {
                self.cm_events()?;
            }
            if woken.timed_out() && Instant::now() >= deadline {
                return Ok(());
            }
        }
    }

    /// Send the idle ping when due; the next time one may be due.
    pub(super) fn idle_ping_due(&mut self, now: Instant) -> Result<Option<Instant>, Error> {
        let Some(every) = self.opts.idle_ping else {
            return Ok(None);
        };
        if !self.full_feature || self.logging_out {
            return Ok(None);
        }
        if let Some((_, sent)) = self.idle_ping {
            if now.duration_since(sent) > self.opts.timeout {
                return Err(Error::Timeout("the echo of our idle NOP-Out ping".into()));
            }
            return Ok(Some(sent + self.opts.timeout));
        }
        let due = self.last_rx.max(self.last_ping) + every;
        if now < due {
            return Ok(Some(due));
        }
        if self.rdma.free_send.is_empty() {
            return Ok(Some(now + Duration::from_millis(10)));
        }
        // illumos iscsi_timeout_checks: nothing received and no ping sent for
        // ISCSI_DEFAULT_NOP_DELAY: a NOP-Out with no data.
        let itt = self.ctl_itt();
        let b = self.ping(itt);
        self.rdma.post_pdu(&Header::PLAIN, &b, &[])?;
        self.idle_ping = Some((itt, now));
        self.last_ping = now;
        self.stats.pings_sent += 1;
        self.stats.idle_pings_sent += 1;
        tracing::debug!("idle for {every:?}: NOP-Out ping");
        Ok(Some(now + self.opts.timeout))
    }

    pub(super) fn cm_events(&mut self) -> Result<(), Error> {
        loop {
            match self.rdma.events.get_event() {
                Ok(e) => {
                    tracing::debug!("iSER connection event {:?}", e.kind);
                    self.peer_disconnected |= e.kind.ends_connection();
                }
                Err(e) if e.is_would_block() => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    pub(super) fn reap(&mut self) -> Result<usize, Error> {
        let mut wcs: [WorkCompletion; 16] = std::array::from_fn(|_| WorkCompletion::default());
        let mut total = 0;
        for recv in [true, false] {
            let cq = if recv {
                &self.rdma.recv_cq
            } else {
                &self.rdma.send_cq
            };
            let n = cq.poll(&mut wcs)?;
            for wc in &wcs[..n] {
                self.completion(wc)?;
            }
            total += n;
        }
        Ok(total)
    }

    pub(super) fn completion(&mut self, wc: &WorkCompletion) -> Result<(), Error> {
        let is_recv = wc.wr_id.kind == RECV_WR;
        let slot = wc.wr_id.slot as usize;
        if !wc.is_ok() {
            if wc.status == WcStatus::Flushed && (self.peer_disconnected || self.logging_out) {
                return Err(Error::Closed);
            }
            if is_recv && wc.status == WcStatus::LocalLength {
                return Err(Error::proto(format!(
                    "the target sent a message longer than our {}-byte receive buffer{}",
                    self.rdma.recv_len,
                    match self.opts.profile {
                        IserProfile::Illumos => " (illumos receives into fixed 16 KiB messages)",
                        IserProfile::Linux => " (ib_iser's login buffer: 76 + 8192 bytes)",
                    }
                )));
            }
            return Err(Error::Rdma(format!(
                "{} work request failed: {} (status {}, vendor error {:#x})",
                if is_recv { "receive" } else { "send" },
                wc.status_str(),
                wc.status.raw(),
                wc.vendor_err
            )));
        }
        if is_recv && slot < self.rdma.recv.len() {
            if wc.opcode != WcOpcode::Recv {
                return Err(Error::Rdma(format!(
                    "receive completion with opcode {:?}",
                    wc.opcode
                )));
            }
            let r = self.message(slot, wc.byte_len as usize);
            self.rdma.queue_recv(slot)?;
            r
        } else if wc.wr_id.kind == SEND_WR && slot < self.rdma.send.len() / SEND_SLOT_LEN {
            self.rdma.free_send.push(slot);
            Ok(())
        } else {
            Err(Error::Rdma(format!(
                "completion of an unknown work request {:?}",
                wc.wr_id
            )))
        }
    }

    /// One received message: an iSCSI PDU behind its iSER header.
    pub(super) fn message(&mut self, slot: usize, len: usize) -> Result<(), Error> {
        self.stats.largest_message = self.stats.largest_message.max(len as u32);
        let (bhs, rx) = {
            let msg = self
                .rdma
                .received(slot, len)
                .ok_or_else(|| Error::Rdma(format!("{len}-byte receive completion")))?;
            let pdu = match Message::parse(msg, self.max_rx_data) {
                Ok(Message::Pdu(pdu)) => pdu,
                Ok(Message::Handshake(h)) => {
                    return Err(Error::proto(format!(
                        "the target sent {h:?}: initiators send Hello, targets answer it"
                    )))
                }
                Err(IserError::Oversized { bhs, len, limit }) => {
                    return Err(Error::proto(format!(
                        "data segment of {len} bytes exceeds the {limit} we receive{} (opcode {:#04x})",
                        if self.full_feature && self.opts.profile == IserProfile::Linux {
                            " (ib_iser's full-feature receive room)"
                        } else {
                            ""
                        },
                        bhs.raw_opcode()
                    )))
                }
                Err(e) => return Err(Error::proto(format!("bad iSER message: {e}"))),
            };
            // An initiator refuses opcodes RFC 7143 does not define.
            let bhs = Bhs::decode(pdu.bhs.as_bytes()).map_err(|e| Error::proto(e.to_string()))?;
            (bhs, classify(&bhs, pdu.data)?)
        };
        if self.full_feature {
            self.stats.largest_full_feature_data = self
                .stats
                .largest_full_feature_data
                .max(bhs.data_segment_len());
        }
        self.last_rx = Instant::now();
        self.seq.on_target_pdu(&bhs);
        match rx {
            Rx::Response { itt, status } => self.complete(itt, status),
            Rx::TargetPing { bhs, data } => {
                let b = nop_out_reply(&bhs, self.seq.next_cmdsn, self.seq.exp_statsn);
                if self.rdma.free_send.is_empty() {
                    return Err(Error::Rdma("no send slot to answer a NOP-In ping".into()));
                }
                self.rdma.post_pdu(&Header::PLAIN, &b, &data)?;
                self.stats.target_pings_answered += 1;
                Ok(())
            }
            Rx::Control { bhs, data } => {
                if bhs.opcode() == Some(Opcode::NopIn)
                    && self.idle_ping.is_some_and(|(itt, _)| itt == bhs.itt())
                {
                    self.idle_ping = None;
                    self.stats.ping_replies += 1;
                    return Ok(());
                }
                self.push_control(bhs, data)
            }
            Rx::Reject {
                itt,
                reason,
                bhs,
                data,
            } => {
                tracing::warn!(reason, itt, "the target rejected a PDU");
                if self.busy_task(itt).is_some() {
                    self.complete(itt, Err(Error::Rejected { reason }))
                } else {
                    self.push_control(bhs, data)
                }
            }
            Rx::Ignore => Ok(()),
        }
    }

    pub(super) fn push_control(&mut self, bhs: Bhs, data: Vec<u8>) -> Result<(), Error> {
        if self.control.len() >= MAX_CONTROL_BACKLOG {
            return Err(Error::proto(format!(
                "{MAX_CONTROL_BACKLOG} unsolicited PDUs from the target nobody asked for"
            )));
        }
        self.control.push_back((bhs, data));
        Ok(())
    }

    pub(super) fn busy_task(&self, itt: u32) -> Option<usize> {
        if itt & 0x8000_0000 != 0 {
            return None;
        }
        let tag = Tag(itt);
        let slot = tag.slot();
        self.tasks.get(slot).and_then(|t| {
            (t.generation == tag.generation() && matches!(t.state, TaskState::Busy { .. }))
                .then_some(slot)
        })
    }

    pub(super) fn complete(
        &mut self,
        itt: u32,
        status: Result<crate::datain::ResponseStatus, Error>,
    ) -> Result<(), Error> {
        let Some(slot) = self.busy_task(itt) else {
            return Err(Error::proto(format!(
                "SCSI Response for ITT {itt:#x}, which no command of ours carries"
            )));
        };
        let TaskState::Busy {
            data_in_len: expected,
        } = self.tasks[slot].state
        else {
            return Err(Error::proto("task state changed under a response"));
        };
        let result = match status {
            Ok(r) => {
                let moved = match r.residual {
                    Residual::Under(n) if n <= expected => expected - n,
                    Residual::Under(n) if expected > 0 => {
                        return Err(Error::proto(format!(
                            "underflow of {n} bytes on a {expected}-byte read"
                        )))
                    }
                    _ => expected,
                };
                Ok(IserStatus {
                    status: r.status,
                    sense: r.sense,
                    residual: r.residual,
                    data_in_len: moved,
                })
            }
            Err(e @ Error::Protocol(_)) => return Err(e),
            Err(e) => Err(e),
        };
        let data_in_len = result.as_ref().map_or(0, |s| s.data_in_len);
        self.tasks[slot].state = TaskState::Done { data_in_len };
        // At most one completion per slot: the slot is free again once the
        // caller collects it, so this never grows past its capacity.
        self.done.push_back(Completion {
            tag: Tag(itt),
            result,
        });
        Ok(())
    }
}

/// Sort a received PDU (its data still in the receive buffer).
pub(super) fn classify(bhs: &Bhs, data: &[u8]) -> Result<Rx, Error> {
    let itt = bhs.itt();
    Ok(match bhs.opcode() {
        Some(Opcode::ScsiResponse) => Rx::Response {
            itt,
            status: response_status(bhs, data),
        },
        Some(Opcode::NopIn) if itt == RESERVED_TAG => {
            if bhs.ttt() == RESERVED_TAG {
                Rx::Ignore // an unsolicited NOP-In that wants no answer
            } else {
                Rx::TargetPing {
                    bhs: *bhs,
                    data: data.to_vec(),
                }
            }
        }
        Some(Opcode::Reject) => {
            let rejected = if data.len() >= 48 {
                be32(data, 16)
            } else {
                RESERVED_TAG
            };
            Rx::Reject {
                itt: rejected,
                reason: bhs.reject_reason(),
                bhs: *bhs,
                data: data.to_vec(),
            }
        }
        Some(Opcode::AsyncMessage) => {
            tracing::info!(
                event = bhs.async_event().0,
                vcode = bhs.async_event().1,
                "async message from the target"
            );
            Rx::Ignore
        }
        Some(Opcode::DataIn) | Some(Opcode::ReadyToTransfer) => {
            return Err(Error::proto(format!(
                "the target sent {:?} over iSER: read data must come by RDMA WRITE and write \
                 data is fetched by RDMA READ",
                bhs.opcode()
            )))
        }
        Some(op) if !op.is_initiator_opcode() => Rx::Control {
            bhs: *bhs,
            data: data.to_vec(),
        },
        _ => {
            return Err(Error::proto(format!(
                "the target sent opcode {:#04x}",
                bhs.raw_opcode()
            )))
        }
    })
}
