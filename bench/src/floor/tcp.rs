//! The floor over TCP: 48 bytes + the block out, 48 bytes back, blocking
//! std::net with TCP_NODELAY; the server runs a thread per connection.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::wire::{Frame, Op, FRAME_LEN};

/// How long the client waits to connect, and for each answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// A server connection with no request for this long is closed.
const SERVER_IDLE: Duration = Duration::from_secs(300);

/// One connection to a floor-server, with its message buffers (allocated
/// once, at connect).
pub(super) struct Client {
    stream: TcpStream,
    addr: SocketAddr,
    /// Header and block, sent with one write.
    msg: Vec<u8>,
    reply: [u8; FRAME_LEN],
    seq: u32,
}

impl Client {
    pub(super) fn connect(addr: SocketAddr, bs: u32) -> Result<Client> {
        let stream = TcpStream::connect_timeout(&addr, CLIENT_TIMEOUT)
            .with_context(|| format!("cannot connect to a floor-server at {addr} (tcp)"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        let mut msg = vec![0u8; FRAME_LEN + bs as usize];
        for (i, b) in msg[FRAME_LEN..].iter_mut().enumerate() {
            *b = i as u8;
        }
        Ok(Client {
            stream,
            addr,
            msg,
            reply: [0; FRAME_LEN],
            seq: 0,
        })
    }

    /// One request and its answer.
    pub(super) fn round_trip(&mut self) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let data_len = (self.msg.len() - FRAME_LEN) as u32;
        Frame {
            data_len,
            ..Frame::new(Op::Data, self.seq)
        }
        .encode(&mut self.msg);
        let addr = self.addr;
        self.stream
            .write_all(&self.msg)
            .map_err(|e| io_error(e, addr, "sending a request"))?;
        self.stream
            .read_exact(&mut self.reply)
            .map_err(|e| io_error(e, addr, "waiting for the answer"))?;
        let f = Frame::decode(&self.reply).with_context(|| format!("answer from {addr}"))?;
        if f.op != Op::Reply || f.seq != self.seq {
            bail!(
                "floor-server {addr} answered {:?} #{} to request #{}",
                f.op,
                f.seq,
                self.seq
            );
        }
        Ok(())
    }
}

fn io_error(e: io::Error, addr: SocketAddr, doing: &str) -> anyhow::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow::anyhow!(
            "floor-server {addr}: no progress for {} s {doing}",
            CLIENT_TIMEOUT.as_secs()
        ),
        io::ErrorKind::UnexpectedEof => {
            anyhow::anyhow!("floor-server {addr} closed the connection while {doing}")
        }
        _ => anyhow::Error::new(e).context(format!("floor-server {addr}: {doing}")),
    }
}

/// Accept connections forever, a thread each. Returns only on an error
/// of the listener that persists.
pub(super) fn serve(listener: TcpListener) -> Result<()> {
    let mut failures = 0u32;
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                failures = 0;
                let spawned = std::thread::Builder::new()
                    .name(format!("floor-tcp {peer}"))
                    .spawn(move || {
                        if let Err(e) = connection(stream) {
                            eprintln!("floor-server: tcp client {peer}: {e:#}");
                        }
                    });
                if let Err(e) = spawned {
                    eprintln!("floor-server: tcp client {peer}: cannot start a thread: {e}");
                }
            }
            // Out of descriptors and the like: back off, keep serving.
            Err(e) => {
                failures += 1;
                if failures > 1000 {
                    return Err(e).context("tcp accept keeps failing");
                }
                eprintln!("floor-server: tcp accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Serve one client until it leaves. Only a framing error or an I/O error
/// in the middle of a message is an error; leaving between messages is not.
fn connection(mut s: TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(SERVER_IDLE))?;
    s.set_write_timeout(Some(SERVER_IDLE))?;
    let mut hdr = [0u8; FRAME_LEN];
    let mut reply = [0u8; FRAME_LEN];
    // Grows to the largest block seen (once per connection, not per I/O).
    let mut data = Vec::new();
    loop {
        if !read_header(&mut s, &mut hdr)? {
            return Ok(());
        }
        let f = Frame::decode(&hdr)?;
        if f.op != Op::Data {
            bail!("unexpected {:?} frame over TCP", f.op);
        }
        let len = f.data_len as usize;
        if data.len() < len {
            data.resize(len, 0);
        }
        s.read_exact(&mut data[..len])
            .context("reading the block (client gone mid-message?)")?;
        Frame::new(Op::Reply, f.seq).encode(&mut reply);
        s.write_all(&reply).context("sending the answer")?;
    }
}

/// Read one header; `Ok(false)` when the client closed (or reset) the
/// connection before its first byte.
fn read_header(s: &mut TcpStream, hdr: &mut [u8; FRAME_LEN]) -> Result<bool> {
    let mut got = 0;
    while got < FRAME_LEN {
        match s.read(&mut hdr[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => bail!("connection closed after {got} bytes of a header"),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if got == 0 && e.kind() == io::ErrorKind::ConnectionReset => return Ok(false),
            Err(e) => return Err(e).context("reading a header"),
        }
    }
    Ok(true)
}
