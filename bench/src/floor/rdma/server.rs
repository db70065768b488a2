//! The floor server: accepts connections and answers each shape.

use super::*;

/// The rdma_cm listener of a floor-server.
pub(in crate::floor) struct Listener {
    /// Kept for its life: dropping it stops the listening.
    _id: CmId,
    events: EventChannel,
    spin: u32,
}

impl Listener {
    pub(in crate::floor) fn bind(addr: SocketAddr, spin: u32) -> Result<Listener> {
        let hint = "run floor-server with --no-rdma to serve TCP alone";
        let events = EventChannel::new().map_err(|e| no_rdma_server(e, hint))?;
        let id = CmId::new(&events).map_err(|e| no_rdma_server(e, hint))?;
        id.bind(addr)
            .map_err(|e| no_rdma_server(e, hint))
            .with_context(|| {
                format!("rdma_cm cannot bind {addr} (is it the address of an RDMA device? {hint})")
            })?;
        id.listen(16).context("rdma_listen")?;
        Ok(Listener {
            _id: id,
            events,
            spin,
        })
    }

    /// Accept connections forever, a thread each.
    pub(in crate::floor) fn run(self) -> Result<()> {
        loop {
            let mut ev = match self.events.get_event() {
                Ok(ev) => ev,
                Err(e) if e.source.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    if let Some(id) = ev.new_id.take() {
                        self.request(id, &ev);
                    }
                }
                CmEventKind::DeviceRemoval => bail!("the RDMA device was removed"),
                _ => {}
            }
        }
    }

    fn request(&self, id: CmId, ev: &CmEvent) {
        let peer = id.peer_addr();
        let who = peer.map_or_else(|| "?".to_string(), |p| p.to_string());
        // A malformed hello: dropping the id rejects the request.
        let hello = match Hello::decode(&ev.private_data) {
            Ok(h) if h.bs > 0 => h,
            Ok(_) => return eprintln!("floor-server: rdma client {who}: zero block size"),
            Err(e) => return eprintln!("floor-server: rdma client {who}: {e}"),
        };
        let events = match EventChannel::new().and_then(|ch| {
            ch.set_nonblocking(true)?;
            id.migrate(&ch)?;
            Ok(ch)
        }) {
            Ok(ch) => ch,
            Err(e) => return eprintln!("floor-server: rdma client {who}: {e}"),
        };
        let (rr, depth, spin) = (ev.responder_resources, ev.initiator_depth, self.spin);
        let peer = peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let spawned = std::thread::Builder::new()
            .name(format!("floor-rdma {who}"))
            .spawn(move || {
                if let Err(e) = serve_connection(id, events, hello, rr, depth, spin, peer) {
                    if e.downcast_ref::<PeerGone>().is_none() {
                        eprintln!("floor-server: rdma client {who}: {e:#}");
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!("floor-server: rdma client: cannot start a thread: {e}");
        }
    }
}

fn no_rdma_server(e: verbs::Error, hint: &str) -> anyhow::Error {
    if e.is_no_rdma() {
        anyhow::Error::new(e).context(format!("no RDMA device on this host: {hint}"))
    } else {
        e.into()
    }
}

/// The server's buffers of one connection.
struct ServerBufs {
    bs: usize,
    reply: RegisteredBuffer,
    /// Where the `send/read` shape reads the client's block to.
    data: RegisteredBuffer,
    /// What ib_read_lat clients read.
    rsrc: RegisteredBuffer,
    /// ib_write_lat: where the client writes, and what we write back.
    wdst: RegisteredBuffer,
    wsrc: RegisteredBuffer,
}

fn serve_connection(
    mut id: CmId,
    events: EventChannel,
    hello: Hello,
    responder_resources: u8,
    initiator_depth: u8,
    spin: u32,
    peer: SocketAddr,
) -> Result<()> {
    let bs = hello.bs as usize;
    let dev = id
        .device()
        .map_err(|e| anyhow!("connect request without a device: {e}"))?;
    let attrs = dev.attrs()?;
    let parts = Parts::new(&mut id, RDMA_HDR_LEN + bs)?;
    let pd = Arc::clone(&parts.pd);
    let rsrc = buffer(&pd, bs, Access::REMOTE_READ)?;
    put_pattern(&rsrc, 0, bs)?;
    let mut bufs = ServerBufs {
        bs,
        reply: buffer(&pd, RDMA_HDR_LEN, Access::empty())?,
        data: buffer(&pd, bs, Access::LOCAL_WRITE)?,
        rsrc,
        wdst: buffer(&pd, bs, Access::REMOTE_WRITE)?,
        wsrc: buffer(&pd, bs, Access::empty())?,
    };
    let mut conn = parts.into_conn(id, events, spin, peer)?;
    let accept = Accept {
        bs: hello.bs,
        read_addr: bufs.rsrc.addr(),
        read_rkey: bufs.rsrc.rkey(),
        write_addr: bufs.wdst.addr(),
        write_rkey: bufs.wdst.rkey(),
    }
    .encode();
    let clamp = |v: u8, max: u32| u8::try_from(max).map_or(v, |m| v.min(m));
    conn.id.accept(&ConnParam {
        private_data: &accept,
        responder_resources: clamp(responder_resources.max(1), attrs.max_qp_rd_atom),
        initiator_depth: clamp(initiator_depth.max(1), attrs.max_qp_init_rd_atom),
        ..ConnParam::default()
    })?;
    expect_event(
        &conn.events,
        CmEventKind::Established,
        Instant::now() + CM_TIMEOUT,
        peer,
    )?;
    let r = message_loop(&mut conn, &mut bufs);
    if let Err(e) = &r {
        if e.downcast_ref::<PeerGone>().is_none() {
            let _ = conn.id.disconnect();
        }
    }
    drop(conn);
    drop(bufs);
    r
}

/// Server state for the SEND it answers with: the reply buffer is reused
/// only after the previous reply's completion.
struct Replier {
    send_done: bool,
}

impl Replier {
    fn on_send(&mut self) {
        self.send_done = true;
    }

    fn reply(&mut self, conn: &mut Conn, bufs: &mut ServerBufs, seq: u32) -> Result<()> {
        let deadline = Instant::now() + IO_TIMEOUT;
        while !self.send_done {
            let wc = conn.wait(deadline, "the previous answer's completion")?;
            match wc.wr_id.kind {
                WR_SEND => self.send_done = true,
                _ => return Err(unexpected(&wc)),
            }
        }
        put_headers(&bufs.reply, &Frame::new(Op::Reply, seq))?;
        conn.post(WR_SEND, SendOp::Send, sge(&bufs.reply, RDMA_HDR_LEN)?)?;
        self.send_done = false;
        Ok(())
    }
}

fn message_loop(conn: &mut Conn, bufs: &mut ServerBufs) -> Result<()> {
    let mut rep = Replier { send_done: true };
    loop {
        let wc = conn.wait(
            Instant::now() + SERVER_IDLE,
            "the client's next message (idle)",
        )?;
        match wc.wr_id.kind {
            WR_SEND => rep.on_send(),
            WR_RECV => {
                let f = conn.take_frame(&wc)?;
                match f.op {
                    Op::Data => {
                        if f.data_len as usize > bufs.bs {
                            bail!("{}-byte block on a {}-byte connection", f.data_len, bufs.bs);
                        }
                        rep.reply(conn, bufs, f.seq)?;
                    }
                    Op::Read => {
                        read_block(conn, bufs, &mut rep, &f)?;
                        rep.reply(conn, bufs, f.seq)?;
                    }
                    Op::WlatStart => {
                        if f.remote_len as usize != bufs.bs {
                            bail!(
                                "ib_write_lat buffer of {} bytes on a {}-byte connection",
                                f.remote_len,
                                bufs.bs
                            );
                        }
                        let last = bufs.bs - 1;
                        set_byte(&bufs.wdst, last, 0)?;
                        set_byte(&bufs.wsrc, last, 0)?;
                        rep.reply(conn, bufs, f.seq)?;
                        let stop = write_lat(conn, bufs, &mut rep, &f)?;
                        rep.reply(conn, bufs, stop)?;
                    }
                    Op::WlatStop => rep.reply(conn, bufs, f.seq)?,
                    Op::Reply => bail!("a client sent a Reply"),
                }
            }
            _ => return Err(unexpected(&wc)),
        }
    }
}

/// The `send/read` shape: RDMA READ the client's block.
fn read_block(conn: &mut Conn, bufs: &ServerBufs, rep: &mut Replier, f: &Frame) -> Result<()> {
    let len = f.remote_len as usize;
    if len == 0 || len > bufs.bs {
        bail!("RDMA READ of {len} bytes on a {}-byte connection", bufs.bs);
    }
    let op = SendOp::RdmaRead {
        remote_addr: f.remote_addr,
        rkey: f.rkey,
    };
    conn.post(WR_READ, op, sge(&bufs.data, len)?)?;
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let wc = conn.wait(deadline, "the RDMA READ of the client's block")?;
        match wc.wr_id.kind {
            WR_READ => return Ok(()),
            WR_SEND => rep.on_send(),
            _ => return Err(unexpected(&wc)),
        }
    }
}

/// ib_write_lat, server side: whenever the last byte of `wdst` becomes the
/// next marker, RDMA-WRITE `wsrc` with that marker to the client. Ends at
/// the client's `WlatStop`; returns its sequence number.
fn write_lat(conn: &mut Conn, bufs: &mut ServerBufs, rep: &mut Replier, f: &Frame) -> Result<u32> {
    let last = bufs.bs - 1;
    let op = SendOp::RdmaWrite {
        remote_addr: f.remote_addr,
        rkey: f.rkey,
    };
    let mut n = 0u64;
    let mut write_pending = false;
    let mut stop = None;
    loop {
        let want = marker(n);
        let deadline = Instant::now() + SERVER_IDLE;
        let got = conn.wait_byte(&bufs.wdst, last, want, deadline, |c, wc| {
            match wc.wr_id.kind {
                WR_WRITE => write_pending = false,
                WR_SEND => rep.on_send(),
                WR_RECV => {
                    let m = c.take_frame(&wc)?;
                    if m.op != Op::WlatStop {
                        bail!("{:?} in ib_write_lat mode", m.op);
                    }
                    stop = Some(m.seq);
                    return Ok(true);
                }
                _ => return Err(unexpected(&wc)),
            }
            Ok(false)
        })?;
        if !got {
            // Let our last WRITE complete before answering.
            let deadline = Instant::now() + IO_TIMEOUT;
            while write_pending {
                let wc = conn.wait(deadline, "the last RDMA WRITE's completion")?;
                match wc.wr_id.kind {
                    WR_WRITE => write_pending = false,
                    WR_SEND => rep.on_send(),
                    _ => return Err(unexpected(&wc)),
                }
            }
            return stop.ok_or_else(|| anyhow!("ib_write_lat ended without a stop"));
        }
        // The client saw our previous WRITE, so it is done on the wire;
        // reap its completion before touching wsrc again.
        let deadline = Instant::now() + IO_TIMEOUT;
        while write_pending {
            let wc = conn.wait(deadline, "an RDMA WRITE's completion")?;
            match wc.wr_id.kind {
                WR_WRITE => write_pending = false,
                WR_SEND => rep.on_send(),
                _ => return Err(unexpected(&wc)),
            }
        }
        set_byte(&bufs.wsrc, last, want)?;
        conn.post(WR_WRITE, op, sge(&bufs.wsrc, bufs.bs)?)?;
        write_pending = true;
        n += 1;
    }
}
