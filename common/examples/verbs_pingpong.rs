//! RC ping-pong over rdma_cm with the `ramslog_common::verbs` wrapper.
//!
//! ```text
//! verbs_pingpong server ADDR:PORT
//! verbs_pingpong client ADDR:PORT [ROUND_TRIPS]
//! verbs_pingpong probe
//! ```
//!
//! The client connects, sends 64-byte SENDs that the server answers (the
//! first answer carries the address and rkey of a 4 KiB server buffer),
//! then RDMA READs that buffer, RDMA WRITEs a new pattern into it and READs
//! it back, and verifies every byte; the server checks the written pattern
//! too. The client prints `pingpong ok` and the mean round trip and exits 0.
//!
//! The server sleeps on its completion channel (and migrates the new
//! connection to its own CM event channel); the client busy-polls. Over
//! SoftRoCE, run both on one rxe device's IP address (never 127.0.0.1).
//! `probe` reports whether this host has RDMA at all.

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::verbs::wait;
use ramslog_common::verbs::{
    device_count, Access, CmEvent, CmEventKind, CmId, CompletionChannel, CompletionQueue,
    ConnParam, EventChannel, ProtectionDomain, QpCaps, RecvWr, RegisteredBuffer, SendOp, SendWr,
    Sge, WcOpcode, WorkCompletion, WrId,
};

type Res<T> = Result<T, Box<dyn StdError>>;

const MSG: usize = 64;
const DATA: usize = 4096;
// More than one post_recv chunk (64), to exercise the chaining.
const RECV_SLOTS: usize = 100;
const CQ_SIZE: u32 = 256;
const HELLO: &[u8] = b"ramslog verbs_pingpong";
const ACCEPT: &[u8] = b"ramslog verbs_pingpong accept";
const CM_TIMEOUT: Duration = Duration::from_secs(20);
const IO_TIMEOUT: Duration = Duration::from_secs(20);

const PING: u32 = u32::from_be_bytes(*b"PING");
const PONG: u32 = u32::from_be_bytes(*b"PONG");
const DONE: u32 = u32::from_be_bytes(*b"DONE");
const DONE_OK: u32 = u32::from_be_bytes(*b"D_OK");
const DONE_BAD: u32 = u32::from_be_bytes(*b"DBAD");

// Work requests: receives use slots 0..RECV_SLOTS; the rest one each.
const RECV: u32 = 0;
const WR_SEND: WrId = WrId::new(1, 0);
const WR_READ: WrId = WrId::new(2, 0);
const WR_WRITE: WrId = WrId::new(3, 0);

/// A 64-byte message: kind, sequence, and a buffer description.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Msg {
    kind: u32,
    seq: u32,
    addr: u64,
    rkey: u32,
    len: u32,
}

impl Msg {
    fn encode(&self, out: &mut [u8]) {
        out[..MSG].fill(0);
        out[0..4].copy_from_slice(&self.kind.to_be_bytes());
        out[4..8].copy_from_slice(&self.seq.to_be_bytes());
        out[8..16].copy_from_slice(&self.addr.to_be_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        out[20..24].copy_from_slice(&self.len.to_be_bytes());
    }

    fn decode(b: &[u8]) -> Res<Msg> {
        if b.len() < 24 {
            return Err(format!("short message: {} bytes", b.len()).into());
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[8..16]);
        Ok(Msg {
            kind: u32_at(0),
            seq: u32_at(4),
            addr: u64::from_be_bytes(a),
            rkey: u32_at(16),
            len: u32_at(20),
        })
    }
}

fn pattern_a(i: usize) -> u8 {
    (i.wrapping_mul(7).wrapping_add(3)) as u8
}

fn pattern_b(i: usize) -> u8 {
    (i.wrapping_mul(13).wrapping_add(11)) as u8 ^ 0x5a
}

/// A copy of all of a buffer (registered memory is copied in and out,
/// never referenced: the adapter may write it).
fn whole(b: &RegisteredBuffer) -> Res<Vec<u8>> {
    let mut out = vec![0; b.len()];
    b.read(0, &mut out).ok_or("buffer range")?;
    Ok(out)
}

/// Change a buffer's content in `f`, on a copy that goes back in.
fn update(b: &RegisteredBuffer, f: impl FnOnce(&mut [u8])) -> Res<()> {
    let mut content = whole(b)?;
    f(&mut content);
    b.write(0, &content).ok_or("buffer range")?;
    Ok(())
}

/// The first `len` bytes of a buffer, copied out.
fn head(b: &RegisteredBuffer, len: usize) -> Res<Vec<u8>> {
    let mut out = vec![0; len];
    b.read(0, &mut out).ok_or("receive slot too small")?;
    Ok(out)
}

fn check_pattern(buf: &[u8], f: fn(usize) -> u8, what: &str) -> Res<()> {
    match buf.iter().enumerate().find(|&(i, &b)| b != f(i)) {
        None => Ok(()),
        Some((i, &b)) => {
            Err(format!("{what}: byte {i} is {b:#04x}, expected {:#04x}", f(i)).into())
        }
    }
}

/// Wait for `want` on `ch` (non-blocking); an event that ends the
/// connection fails.
fn wait_cm(ch: &EventChannel, want: CmEventKind, timeout: Duration) -> Res<CmEvent> {
    Ok(ch.wait_for(want, Instant::now() + timeout)?)
}

/// Hands out completions one at a time, failing on any error completion.
/// With a completion channel it sleeps on it (and on the CM channel, so a
/// disconnect is noticed); without, it busy-polls.
struct Reaper {
    cq: Arc<CompletionQueue>,
    channel: Option<Arc<CompletionChannel>>,
    cm: EventChannel,
    buf: [WorkCompletion; 16],
    head: usize,
    len: usize,
}

impl Reaper {
    fn new(
        cq: Arc<CompletionQueue>,
        channel: Option<Arc<CompletionChannel>>,
        cm: EventChannel,
    ) -> Reaper {
        Reaper {
            cq,
            channel,
            cm,
            buf: std::array::from_fn(|_| WorkCompletion::default()),
            head: 0,
            len: 0,
        }
    }

    fn next(&mut self) -> Res<WorkCompletion> {
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut spins = 0u32;
        loop {
            if self.head < self.len {
                let wc = std::mem::take(&mut self.buf[self.head]);
                self.head += 1;
                if !wc.is_ok() {
                    return Err(format!(
                        "work request {:?} failed: {} (status {}, vendor error {:#x})",
                        wc.wr_id,
                        wc.status_str(),
                        wc.status.raw(),
                        wc.vendor_err
                    )
                    .into());
                }
                return Ok(wc);
            }
            self.head = 0;
            self.len = self.cq.poll(&mut self.buf)?;
            if self.len > 0 {
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins & 1023 == 0 && Instant::now() >= deadline {
                return Err("timed out waiting for a completion".into());
            }
            let Some(ch) = &self.channel else {
                std::hint::spin_loop();
                continue;
            };
            wait::arm(&[&*self.cq])?;
            self.len = self.cq.poll(&mut self.buf)?;
            if self.len > 0 {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err("timed out waiting for a completion".into());
            }
            let woken = wait::sleep(ch, &[&*self.cq], Some(&self.cm), Some(deadline - now))?;
            if woken.cm {
                match self.cm.get_event() {
                    Ok(ev) => {
                        return Err(format!(
                            "CM event {:?} while waiting for a completion",
                            ev.kind
                        )
                        .into())
                    }
                    Err(e) if e.is_would_block() => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
}

/// Post one signaled RDMA operation and wait for its completion.
fn rdma_op(
    id: &CmId,
    reaper: &mut Reaper,
    op: SendOp,
    wr_id: WrId,
    sge: Sge,
    want: WcOpcode,
) -> Res<()> {
    id.post_send(&SendWr {
        wr_id,
        op,
        sge,
        signaled: true,
        inline: false,
    })?;
    let wc = reaper.next()?;
    if wc.wr_id != wr_id || wc.opcode != want {
        return Err(format!("unexpected completion {wc:?}").into());
    }
    Ok(())
}

fn post_recv_slot(id: &CmId, slots: &[RegisteredBuffer], i: usize) -> Res<()> {
    let sge = slots[i]
        .sge(0, MSG as u32)
        .ok_or("receive slot too small")?;
    id.post_recv(&[RecvWr {
        wr_id: WrId::new(RECV, i as u32),
        sge,
    }])?;
    Ok(())
}

/// Post every receive slot in one call (chained, in chunks of 64).
/// Wait until the SEND just posted completed and the peer's answer came:
/// the answer (its receive slot is posted again).
fn sent_and_answered(id: &CmId, reaper: &mut Reaper, slots: &[RegisteredBuffer]) -> Res<Msg> {
    let (mut sent, mut reply) = (false, None);
    while !sent || reply.is_none() {
        let wc = reaper.next()?;
        match wc.wr_id {
            WR_SEND => sent = true,
            WrId {
                kind: RECV, slot, ..
            } if (slot as usize) < RECV_SLOTS => {
                let slot = slot as usize;
                reply = Some(Msg::decode(&head(&slots[slot], MSG)?)?);
                post_recv_slot(id, slots, slot)?;
            }
            w => return Err(format!("unexpected work request {w:?}").into()),
        }
    }
    reply.ok_or_else(|| "no reply".into())
}

fn post_all_recvs(id: &CmId, slots: &[RegisteredBuffer]) -> Res<()> {
    let mut wrs = Vec::with_capacity(slots.len());
    for (i, b) in slots.iter().enumerate() {
        let sge = b.sge(0, MSG as u32).ok_or("receive slot too small")?;
        wrs.push(RecvWr {
            wr_id: WrId::new(RECV, i as u32),
            sge,
        });
    }
    id.post_recv_batch(&wrs).map_err(|e| format!("{e}"))?;
    Ok(())
}

fn recv_slots(pd: &Arc<ProtectionDomain>) -> Res<Vec<RegisteredBuffer>> {
    let mut v = Vec::with_capacity(RECV_SLOTS);
    for _ in 0..RECV_SLOTS {
        v.push(RegisteredBuffer::new(pd, MSG, Access::empty())?);
    }
    Ok(v)
}

fn qp_caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: RECV_SLOTS as u32,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: MSG as u32,
    }
}

fn server(addr: SocketAddr) -> Res<()> {
    let ch = EventChannel::new()?;
    ch.set_nonblocking(true)?;
    let listener = CmId::new(&ch)?;
    listener.bind(addr)?;
    listener.listen(4)?;
    println!("server: listening on {addr}");

    let mut req = wait_cm(&ch, CmEventKind::ConnectRequest, Duration::from_secs(120))?;
    if req.listen_id != listener.raw_handle() {
        return Err("connect request for another listener".into());
    }
    let mut id = req.new_id.take().ok_or("connect request without an id")?;
    if !req.private_data.starts_with(HELLO) {
        return Err(format!("unexpected private data {:?}", req.private_data).into());
    }
    // Give the connection its own CM channel, as the target driver does.
    let conn_ch = EventChannel::new()?;
    conn_ch.set_nonblocking(true)?;
    id.migrate(&conn_ch)?;
    drop(listener);
    drop(ch);

    let dev = id.device()?;
    let attrs = dev.attrs()?;
    println!(
        "server: request from {:?} on {} (guid {:#018x}): responder_resources {} initiator_depth {}; \
         device max_qp_rd_atom {} max_qp_init_rd_atom {} max_qp_wr {} max_cqe {} max_sge {}",
        id.peer_addr(),
        dev.name(),
        dev.guid(),
        req.responder_resources,
        req.initiator_depth,
        attrs.max_qp_rd_atom,
        attrs.max_qp_init_rd_atom,
        attrs.max_qp_wr,
        attrs.max_cqe,
        attrs.max_sge
    );

    let pd = ProtectionDomain::new(&dev)?;
    let cch = Arc::new(CompletionChannel::new(&dev)?);
    cch.set_nonblocking(true)?;
    let cq = CompletionQueue::new(&dev, CQ_SIZE, Some(&cch))?;
    let slots = recv_slots(&pd)?;
    let send = RegisteredBuffer::new(&pd, MSG, Access::empty())?;
    let data = RegisteredBuffer::new(&pd, DATA, Access::REMOTE_READ | Access::REMOTE_WRITE)?;
    update(&data, |bytes| {
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern_a(i);
        }
    })?;
    id.create_qp(&pd, &cq, qp_caps())?;
    let caps = id.qp_caps().ok_or("no QP")?;
    let inline = caps.max_inline_data as usize >= MSG;
    post_all_recvs(&id, &slots)?;
    let clamp = |v: u8, max: u32| u8::try_from(max).map_or(v, |m| v.min(m));
    id.accept(&ConnParam {
        private_data: ACCEPT,
        responder_resources: clamp(req.responder_resources.max(1), attrs.max_qp_rd_atom),
        initiator_depth: clamp(req.initiator_depth, attrs.max_qp_init_rd_atom),
        ..ConnParam::default()
    })?;
    wait_cm(&conn_ch, CmEventKind::Established, CM_TIMEOUT)?;
    println!(
        "server: established, qp {:?}, caps {caps:?}, local {:?}",
        id.qp_num(),
        id.local_addr()
    );

    let mut reaper = Reaper::new(cq, Some(cch), conn_ch.clone());
    let mut pings = 0u32;
    loop {
        let wc = reaper.next()?;
        if wc.wr_id == WR_SEND {
            continue;
        }
        let slot = Some(wc.wr_id)
            .filter(|w| w.kind == RECV && (w.slot as usize) < RECV_SLOTS)
            .ok_or("unknown work request")?
            .slot as usize;
        if wc.opcode != WcOpcode::Recv || wc.byte_len as usize != MSG {
            return Err(format!("unexpected completion {wc:?}").into());
        }
        let msg = Msg::decode(&head(&slots[slot], MSG)?)?;
        post_recv_slot(&id, &slots, slot)?;
        let reply = match msg.kind {
            PING => {
                pings += 1;
                Msg {
                    kind: PONG,
                    seq: msg.seq,
                    addr: data.addr(),
                    rkey: data.rkey(),
                    len: DATA as u32,
                }
            }
            DONE => {
                let ok = check_pattern(&whole(&data)?, pattern_b, "server buffer after RDMA WRITE");
                if let Err(e) = &ok {
                    eprintln!("server: {e}");
                }
                Msg {
                    kind: if ok.is_ok() { DONE_OK } else { DONE_BAD },
                    seq: msg.seq,
                    ..Msg::default()
                }
            }
            k => return Err(format!("unexpected message kind {k:#x}").into()),
        };
        update(&send, |b| reply.encode(b))?;
        id.post_send(&SendWr {
            wr_id: WR_SEND,
            op: SendOp::Send,
            sge: send.sge(0, MSG as u32).ok_or("send buffer too small")?,
            signaled: true,
            inline,
        })?;
        if msg.kind == DONE {
            break;
        }
    }
    // Let the DONE reply complete, then wait for the client to disconnect.
    loop {
        let wc = reaper.next()?;
        if wc.wr_id == WR_SEND {
            break;
        }
    }
    wait_cm(&conn_ch, CmEventKind::Disconnected, CM_TIMEOUT)?;
    println!(
        "server: {pings} pings answered, client buffer writes verified, disconnected: server ok"
    );
    Ok(())
}

fn client(addr: SocketAddr, round_trips: u32) -> Res<()> {
    let ch = EventChannel::new()?;
    ch.set_nonblocking(true)?;
    let mut id = CmId::new(&ch)?;
    id.resolve_addr(None, addr, 2000)?;
    wait_cm(&ch, CmEventKind::AddrResolved, CM_TIMEOUT)?;
    id.resolve_route(2000)?;
    wait_cm(&ch, CmEventKind::RouteResolved, CM_TIMEOUT)?;
    let dev = id.device()?;
    println!("client: {addr} resolved on {}", dev.name());

    let pd = ProtectionDomain::new(&dev)?;
    let cq = CompletionQueue::new(&dev, CQ_SIZE, None)?;
    let slots = recv_slots(&pd)?;
    let send = RegisteredBuffer::new(&pd, MSG, Access::empty())?;
    let local = RegisteredBuffer::new(&pd, DATA, Access::empty())?;
    id.create_qp(&pd, &cq, qp_caps())?;
    post_all_recvs(&id, &slots)?;
    id.connect(&ConnParam {
        private_data: HELLO,
        responder_resources: 1,
        initiator_depth: 1,
        ..ConnParam::default()
    })?;
    let est = wait_cm(&ch, CmEventKind::Established, CM_TIMEOUT)?;
    let accept_data = est.private_data.starts_with(ACCEPT);
    println!(
        "client: established {:?} -> {:?}, qp {:?}, accept private data {}",
        id.local_addr(),
        id.peer_addr(),
        id.qp_num(),
        if accept_data { "ok" } else { "absent" }
    );

    let mut reaper = Reaper::new(cq, None, ch.clone());
    let send_sge = send.sge(0, MSG as u32).ok_or("send buffer too small")?;

    // Round trips: SEND a PING, wait for the PONG.
    let mut remote = None;
    let mut total = Duration::ZERO;
    for seq in 0..round_trips.max(1) {
        let ping = Msg {
            kind: PING,
            seq,
            ..Msg::default()
        };
        update(&send, |b| ping.encode(b))?;
        let t0 = Instant::now();
        id.post_send(&SendWr {
            wr_id: WR_SEND,
            op: SendOp::Send,
            sge: send_sge,
            signaled: true,
            inline: false,
        })?;
        let m = sent_and_answered(&id, &mut reaper, &slots)?;
        total += t0.elapsed();
        if m.kind != PONG || m.seq != seq {
            return Err(format!("bad reply {m:?} to ping {seq}").into());
        }
        remote = Some((m.addr, m.rkey, m.len));
    }
    let (raddr, rkey, rlen) = remote.ok_or("no reply")?;
    if rlen as usize != DATA {
        return Err(format!("server buffer is {rlen} bytes, expected {DATA}").into());
    }
    let mean = total / round_trips.max(1);

    let sge = local.sge(0, DATA as u32).ok_or("local buffer too small")?;
    let read = SendOp::RdmaRead {
        remote_addr: raddr,
        rkey,
    };
    // READ the server's initial pattern.
    rdma_op(&id, &mut reaper, read, WR_READ, sge, WcOpcode::RdmaRead)?;
    check_pattern(&whole(&local)?, pattern_a, "RDMA READ of the server buffer")?;

    // WRITE a new pattern (unsignaled) with a SEND "DONE" chained behind it
    // in one post: RC delivers the SEND only after the WRITE's data is in
    // place (iSER's Data-In + SCSI Response), so the server checks its
    // buffer as soon as DONE arrives.
    update(&local, |bytes| {
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern_b(i);
        }
    })?;
    let done = Msg {
        kind: DONE,
        seq: round_trips,
        ..Msg::default()
    };
    update(&send, |b| done.encode(b))?;
    id.post_send_batch(&[
        SendWr {
            wr_id: WR_WRITE,
            op: SendOp::RdmaWrite {
                remote_addr: raddr,
                rkey,
            },
            sge,
            signaled: false,
            inline: false,
        },
        SendWr {
            wr_id: WR_SEND,
            op: SendOp::Send,
            sge: send_sge,
            signaled: true,
            inline: false,
        },
    ])
    .map_err(|e| e.to_string())?;
    let verdict = sent_and_answered(&id, &mut reaper, &slots)?.kind;
    if verdict != DONE_OK {
        return Err("the server saw the wrong bytes after the RDMA WRITE".into());
    }

    // READ it back into a cleared buffer.
    local.fill(0, local.len(), 0).ok_or("buffer range")?;
    rdma_op(&id, &mut reaper, read, WR_READ, sge, WcOpcode::RdmaRead)?;
    check_pattern(&whole(&local)?, pattern_b, "RDMA READ after RDMA WRITE")?;

    id.disconnect()?;
    wait_cm(&ch, CmEventKind::Disconnected, CM_TIMEOUT)?;
    println!(
        "pingpong ok: {} round trips of {MSG} bytes, mean round trip {:.1} us; RDMA WRITE + READ of {DATA} bytes verified",
        round_trips.max(1),
        mean.as_secs_f64() * 1e6
    );
    Ok(())
}

fn probe() -> Res<()> {
    match device_count() {
        Ok(n) => println!("probe: {n} RDMA devices"),
        Err(e) if e.is_no_rdma() => println!("probe: no RDMA on this host ({e})"),
        Err(e) => return Err(e.into()),
    }
    match EventChannel::new() {
        Ok(ch) => println!("probe: rdma_cm event channel fd {}", ch.fd()),
        Err(e) if e.is_no_rdma() => println!("probe: no rdma_cm on this host ({e})"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: verbs_pingpong server ADDR:PORT | client ADDR:PORT [ROUND_TRIPS] | probe";
    match args.get(1).map(String::as_str) {
        Some("probe") => probe(),
        Some(mode @ ("server" | "client")) => {
            let addr: SocketAddr = args.get(2).ok_or(usage)?.parse()?;
            if mode == "server" {
                server(addr)
            } else {
                let n = match args.get(3) {
                    Some(s) => s.parse()?,
                    None => 1000,
                };
                client(addr, n)
            }
        }
        _ => Err(usage.into()),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("verbs_pingpong: {e}");
        let mut src = e.source();
        while let Some(s) = src {
            eprintln!("  caused by: {s}");
            src = s.source();
        }
        std::process::exit(1);
    }
}
