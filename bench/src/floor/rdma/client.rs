//! The floor client: connects, then measures SEND, RDMA READ and RDMA WRITE
//! round trips against a floor-server.

use super::*;

/// The client's end: one connection and its buffers, all registered once.
pub(in crate::floor) struct Client {
    conn: Conn,
    bs: usize,
    accept: Accept,
    /// Headers + block for the `send` shape.
    msg: RegisteredBuffer,
    /// 76-byte control messages.
    ctl: RegisteredBuffer,
    /// What the server RDMA-READs in the `send/read` shape.
    block: RegisteredBuffer,
    /// Where ib_read_lat reads to.
    read_dst: RegisteredBuffer,
    /// ib_write_lat: what we write, and where the server writes.
    wsrc: RegisteredBuffer,
    wdst: RegisteredBuffer,
    seq: u32,
    wlat_n: u64,
    _pd: Arc<ProtectionDomain>,
}

impl Client {
    pub(in crate::floor) fn connect(addr: SocketAddr, bs: u32, spin: u32) -> Result<Client> {
        let deadline = Instant::now() + CM_TIMEOUT;
        let events = EventChannel::new().map_err(no_rdma)?;
        events.set_nonblocking(true)?;
        let mut id = CmId::new(&events).map_err(no_rdma)?;
        id.resolve_addr(None, addr, RESOLVE_MS)
            .map_err(no_rdma)
            .with_context(|| format!("resolving {addr} to an RDMA device"))?;
        expect_event(&events, CmEventKind::AddrResolved, deadline, addr)?;
        id.resolve_route(RESOLVE_MS)?;
        expect_event(&events, CmEventKind::RouteResolved, deadline, addr)?;
        let parts = Parts::new(&mut id, RDMA_HDR_LEN)?;
        let pd = Arc::clone(&parts.pd);
        let bsz = bs as usize;
        let msg = buffer(&pd, RDMA_HDR_LEN + bsz, Access::empty())?;
        put_pattern(&msg, RDMA_HDR_LEN, bsz)?;
        let ctl = buffer(&pd, RDMA_HDR_LEN, Access::empty())?;
        let block = buffer(&pd, bsz, Access::REMOTE_READ)?;
        let read_dst = buffer(&pd, bsz, Access::LOCAL_WRITE)?;
        let wsrc = buffer(&pd, bsz, Access::empty())?;
        let wdst = buffer(&pd, bsz, Access::REMOTE_WRITE)?;
        let conn = parts.into_conn(id, events, spin, addr)?;
        let hello = Hello { bs }.encode();
        conn.id.connect(&ConnParam {
            private_data: &hello,
            responder_resources: 1,
            initiator_depth: 1,
            ..ConnParam::default()
        })?;
        let est = expect_event(&conn.events, CmEventKind::Established, deadline, addr)?;
        let accept = Accept::decode(&est.private_data)
            .with_context(|| format!("{addr} accepted, but not as a floor-server"))?;
        if accept.bs != bs {
            bail!(
                "floor-server {addr} offers {}-byte buffers for a {bs}-byte block",
                accept.bs
            );
        }
        Ok(Client {
            conn,
            bs: bsz,
            accept,
            msg,
            ctl,
            block,
            read_dst,
            wsrc,
            wdst,
            seq: 0,
            wlat_n: 0,
            _pd: pd,
        })
    }

    /// Wait for our SEND's completion and the server's answer to `seq`.
    fn await_reply(&mut self, seq: u32) -> Result<()> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            let wc = self.conn.wait(deadline, "the floor-server's answer")?;
            match wc.wr_id.kind {
                WR_SEND => sent = true,
                WR_RECV => {
                    let f = self.conn.take_frame(&wc)?;
                    if f.op != Op::Reply || f.seq != seq {
                        bail!(
                            "floor-server {} answered {:?} #{} to request #{seq}",
                            self.conn.peer,
                            f.op,
                            f.seq
                        );
                    }
                    answered = true;
                }
                _ => return Err(unexpected(&wc)),
            }
        }
        Ok(())
    }

    fn control(&mut self, f: Frame) -> Result<()> {
        put_headers(&self.ctl, &f)?;
        let s = sge(&self.ctl, RDMA_HDR_LEN)?;
        self.conn.post(WR_SEND, SendOp::Send, s)?;
        self.await_reply(f.seq)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Shape `send`: SEND headers + block, SEND back. Returns ns.
    pub(in crate::floor) fn send_block(&mut self) -> Result<u64> {
        let seq = self.next_seq();
        let frame = Frame {
            data_len: self.bs as u32,
            ..Frame::new(Op::Data, seq)
        };
        put_headers(&self.msg, &frame)?;
        let s = sge(&self.msg, RDMA_HDR_LEN + self.bs)?;
        let t = Instant::now();
        self.conn.post(WR_SEND, SendOp::Send, s)?;
        self.await_reply(seq)?;
        Ok(ns(t))
    }

    /// Shape `send/read`: SEND naming our block, the server RDMA-READs it,
    /// SEND back. Returns ns.
    pub(in crate::floor) fn send_read(&mut self) -> Result<u64> {
        let seq = self.next_seq();
        let f = Frame {
            remote_addr: self.block.addr(),
            rkey: self.block.rkey(),
            remote_len: self.bs as u32,
            ..Frame::new(Op::Read, seq)
        };
        let t = Instant::now();
        self.control(f)?;
        Ok(ns(t))
    }

    /// Shape `read` (ib_read_lat): RDMA READ of the server's block, post to
    /// completion. Returns ns.
    pub(in crate::floor) fn read(&mut self) -> Result<u64> {
        let s = sge(&self.read_dst, self.bs)?;
        let op = SendOp::RdmaRead {
            remote_addr: self.accept.read_addr,
            rkey: self.accept.read_rkey,
        };
        let t = Instant::now();
        self.conn.post(WR_READ, op, s)?;
        let wc = self.conn.wait(t + IO_TIMEOUT, "an RDMA READ")?;
        if wc.wr_id.kind != WR_READ {
            return Err(unexpected(&wc));
        }
        Ok(ns(t))
    }

    /// Put the server into ib_write_lat mode.
    pub(in crate::floor) fn wlat_start(&mut self) -> Result<()> {
        let last = self.bs - 1;
        set_byte(&self.wdst, last, 0)?;
        set_byte(&self.wsrc, last, 0)?;
        self.wlat_n = 0;
        let seq = self.next_seq();
        self.control(Frame {
            remote_addr: self.wdst.addr(),
            rkey: self.wdst.rkey(),
            remote_len: self.bs as u32,
            ..Frame::new(Op::WlatStart, seq)
        })
    }

    /// One ib_write_lat round trip: write the block with a new last byte,
    /// poll until the server's write of the same byte lands. Returns RTT/2
    /// in ns, as perftest reports it.
    pub(in crate::floor) fn wlat(&mut self) -> Result<u64> {
        let last = self.bs - 1;
        let want = marker(self.wlat_n);
        self.wlat_n += 1;
        // The previous WRITE from wsrc has completed (reaped below).
        set_byte(&self.wsrc, last, want)?;
        let s = sge(&self.wsrc, self.bs)?;
        let op = SendOp::RdmaWrite {
            remote_addr: self.accept.write_addr,
            rkey: self.accept.write_rkey,
        };
        let t = Instant::now();
        self.conn.post(WR_WRITE, op, s)?;
        let deadline = t + IO_TIMEOUT;
        let mut written = false;
        let wdst = &self.wdst;
        self.conn.wait_byte(wdst, last, want, deadline, |_, wc| {
            match wc.wr_id.kind {
                WR_WRITE => written = true,
                _ => return Err(unexpected(&wc)),
            }
            Ok(false)
        })?;
        let half = ns(t) / 2;
        while !written {
            let wc = self.conn.wait(deadline, "an RDMA WRITE completion")?;
            match wc.wr_id.kind {
                WR_WRITE => written = true,
                _ => return Err(unexpected(&wc)),
            }
        }
        Ok(half)
    }

    /// Take the server out of ib_write_lat mode.
    pub(in crate::floor) fn wlat_stop(&mut self) -> Result<()> {
        let seq = self.next_seq();
        self.control(Frame::new(Op::WlatStop, seq))
    }

    /// Disconnect (best effort: the measurements are already taken).
    pub(in crate::floor) fn close(self) {
        if self.conn.id.disconnect().is_ok() {
            let _ = expect_event(
                &self.conn.events,
                CmEventKind::Disconnected,
                Instant::now() + Duration::from_secs(2),
                self.conn.peer,
            );
        }
    }
}

fn ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
