//! NOP-Out pings, text (SendTargets) and logout.

use super::*;

impl IserSession {
    /// NOP-Out ping (immediate, with data); waits for the echo. Returns the
    /// round-trip time.
    pub fn nop(&mut self) -> Result<Duration, Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        let itt = self.ctl_itt();
        let b = self.ping(itt);
        let sent = Instant::now();
        self.send(&Header::PLAIN, &b, PING_DATA, deadline)?;
        self.stats.pings_sent += 1;
        self.last_ping = sent;
        let (rsp, data) = self.wait_control(itt, "a NOP-In echo", deadline)?;
        match rsp.opcode() {
            Some(Opcode::NopIn) if data == PING_DATA => {
                self.stats.ping_replies += 1;
                Ok(sent.elapsed())
            }
            Some(Opcode::NopIn) => {
                Err(self.fail(Error::proto("the NOP-In does not echo the ping data")))
            }
            Some(Opcode::Reject) => Err(Error::Rejected {
                reason: rsp.reject_reason(),
            }),
            _ => Err(self.fail(Error::proto(format!(
                "unexpected {rsp:?} answering a NOP-Out"
            )))),
        }
    }

    /// A test hook for targets: behave as a peer that takes nothing. Send up
    /// to `count` immediate NOP-Out pings, each of which asks for a NOP-In,
    /// while never handling a receive or reposting a receive buffer (send
    /// completions are still reaped, to reuse send slots). Stops at
    /// `deadline` or once the send queue makes no progress for a second.
    /// Returns the pings sent; the session is useless afterwards.
    #[doc(hidden)]
    pub fn flood_pings_taking_nothing(
        &mut self,
        count: usize,
        deadline: Instant,
    ) -> Result<usize, Error> {
        self.check()?;
        let mut sent = 0;
        let mut wcs: [WorkCompletion; 16] = std::array::from_fn(|_| WorkCompletion::default());
        while sent < count && Instant::now() < deadline {
            let stalled_at = Instant::now();
            while self.rdma.free_send.is_empty() {
                let n = self.rdma.send_cq.poll(&mut wcs)?;
                for wc in &wcs[..n] {
                    if !wc.is_ok() {
                        return Ok(sent);
                    }
                    self.rdma.free_send.push(wc.wr_id.slot as usize);
                }
                if stalled_at.elapsed() > Duration::from_secs(1) || Instant::now() >= deadline {
                    return Ok(sent);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let itt = self.ctl_itt();
            let b = self.ping(itt);
            self.rdma.post_pdu(&Header::PLAIN, &b, PING_DATA)?;
            sent += 1;
        }
        Ok(sent)
    }

    pub(super) fn ping(&self, itt: u32) -> Bhs {
        let mut b = Bhs::new(Opcode::NopOut);
        b.set_immediate(true);
        b.set_final(true)
            .set_itt(itt)
            .set_ttt(RESERVED_TAG)
            .set_cmdsn(self.seq.next_cmdsn)
            .set_exp_statsn(self.seq.exp_statsn);
        b
    }

    /// Do nothing for `dur` but keep the session alive as the profile's
    /// initiator would: answer target pings, ping after `idle_ping` of silence.
    pub fn idle(&mut self, dur: Duration) -> Result<(), Error> {
        let end = Instant::now() + dur;
        while Instant::now() < end {
            self.check()?;
            self.turn(end)?;
        }
        self.check()
    }

    /// A Text Request (with continuation) in full feature phase.
    pub fn text_request(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<Vec<(String, String)>, Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        let mut x = TextExchange::new(self.ctl_itt(), keys);
        loop {
            let (mut b, payload) = x.request()?;
            while !self.seq.window_open() {
                self.turn_or_timeout(deadline, "an open command window")?;
            }
            let sn = self.seq.take_cmdsn();
            b.set_cmdsn(sn).set_exp_statsn(self.seq.exp_statsn);
            self.send(&Header::PLAIN, &b, &payload, deadline)?;
            let (rsp, data) = self.wait_control(x.itt(), "a Text Response", deadline)?;
            match rsp.opcode() {
                Some(Opcode::TextResponse) => {
                    if let Some(keys) = x.response(&rsp, &data)? {
                        return Ok(keys);
                    }
                }
                Some(Opcode::Reject) => {
                    return Err(Error::Rejected {
                        reason: rsp.reject_reason(),
                    })
                }
                _ => {
                    return Err(self.fail(Error::proto(format!(
                        "unexpected {rsp:?} answering a Text Request"
                    ))))
                }
            }
        }
    }

    /// `SendTargets=All`: each TargetName with its TargetAddress values.
    pub fn send_targets(&mut self) -> Result<Vec<(String, Vec<String>)>, Error> {
        let keys = self.text_request(&[("SendTargets".to_string(), "All".to_string())])?;
        parse_send_targets(&keys)
    }

    /// Log out (close the session): waits for outstanding commands, then
    /// for the Logout Response, then disconnects.
    pub fn logout(mut self) -> Result<(), Error> {
        self.check()?;
        let deadline = Instant::now() + self.opts.timeout;
        while self.outstanding() > 0 {
            self.turn_or_timeout(deadline, "outstanding commands before logout")?;
        }
        let itt = self.ctl_itt();
        let b = logout_request(itt, self.cid, self.seq.next_cmdsn, self.seq.exp_statsn);
        self.logging_out = true;
        self.send(&Header::PLAIN, &b, &[], deadline)?;
        let (rsp, _) = self.wait_control(itt, "a Logout Response", deadline)?;
        let r = match rsp.opcode() {
            Some(Opcode::LogoutResponse) => match rsp.response() {
                0 => Ok(()),
                code => Err(Error::proto(format!("Logout Response code {code}"))),
            },
            Some(Opcode::Reject) => Err(Error::Rejected {
                reason: rsp.reject_reason(),
            }),
            _ => Err(Error::proto(format!("unexpected {rsp:?} answering Logout"))),
        };
        if !self.peer_disconnected {
            let _ = self.rdma.id.disconnect();
            let end = Instant::now() + Duration::from_secs(2);
            if let Err(e) = self.rdma.events.wait_for(CmEventKind::Disconnected, end) {
                tracing::debug!("iSER disconnect after logout: {e}");
            }
        }
        r
    }
}
