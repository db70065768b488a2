//! A pipelined session: many tasks issue commands concurrently on `&Session`.
//!
//! One reader task owns the socket's read half and dispatches PDUs by ITT to
//! the issuing task's channel; the issuing task does the command's protocol
//! work (immediate/unsolicited data, answering R2Ts, Data-In reassembly). The
//! write half sits behind an async mutex; CmdSN is assigned under it, so
//! commands go on the wire in CmdSN order.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};

use ramslog_common::iscsi::{scsi_cmd, Bhs, Opcode, AHS_EXTENDED_CDB, RESERVED_TAG};
use ramslog_common::scsi_wire::{be32, be64};
use tokio::sync::{mpsc, Mutex, Notify};
use tokio::task::JoinHandle;

use crate::cdb;
use crate::conn::{logout_request, nop_out_reply, Connection, Reader, Writer};
use crate::datain::{DataInAssembler, ScsiResult};
use crate::login::{LoginParams, Negotiated};
use crate::pdu::Pdu;
use crate::seq::SeqState;
use crate::{encode_lun, Error};

enum Event {
    Pdu(Pdu),
    Failed(Error),
}

struct Inner {
    writer: Mutex<Writer>,
    seq: StdMutex<SeqState>,
    window: Notify,
    tasks: StdMutex<HashMap<u32, mpsc::UnboundedSender<Event>>>,
    itt: AtomicU32,
    negotiated: Negotiated,
    fatal: StdMutex<Option<Error>>,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    block_sizes: StdMutex<HashMap<u64, u32>>,
    logging_out: AtomicBool,
}

pub struct Session {
    inner: Arc<Inner>,
    reader: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn lock<T>(m: &StdMutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes a task's dispatch entry however the command ends.
struct TaskGuard<'a> {
    inner: &'a Inner,
    itt: u32,
}

impl Drop for TaskGuard<'_> {
    fn drop(&mut self) {
        lock(&self.inner.tasks).remove(&self.itt);
    }
}

impl Inner {
    fn check(&self) -> Result<(), Error> {
        match &*lock(&self.fatal) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Make `e` the session's sticky error and fail every waiting task.
    fn fail(&self, e: Error) {
        {
            let mut f = lock(&self.fatal);
            if f.is_none() {
                if self.logging_out.load(Ordering::Relaxed) {
                    tracing::debug!(error = %e, "session ended after logout");
                } else {
                    tracing::warn!(error = %e, "session failed");
                }
                *f = Some(e.clone());
            }
        }
        let tasks: Vec<_> = lock(&self.tasks).drain().collect();
        for (_, tx) in tasks {
            let _ = tx.send(Event::Failed(e.clone()));
        }
        self.window.notify_waiters();
    }

    fn sticky(&self) -> Error {
        lock(&self.fatal).clone().unwrap_or(Error::Closed)
    }

    fn register(&self) -> (u32, mpsc::UnboundedReceiver<Event>, TaskGuard<'_>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut tasks = lock(&self.tasks);
        let itt = loop {
            let itt = self.itt.fetch_add(1, Ordering::Relaxed);
            if itt != RESERVED_TAG && !tasks.contains_key(&itt) {
                break itt;
            }
        };
        tasks.insert(itt, tx);
        (itt, rx, TaskGuard { inner: self, itt })
    }

    async fn reader_loop(self: Arc<Self>, mut reader: Reader) {
        loop {
            let pdu = match reader.read_pdu().await {
                Ok(p) => p,
                Err(e) => {
                    self.fail(e);
                    return;
                }
            };
            if lock(&self.seq).on_target_pdu(&pdu.bhs) {
                self.window.notify_waiters();
            }
            let itt = pdu.bhs.itt();
            match pdu.bhs.opcode() {
                Some(Opcode::NopIn) if itt == RESERVED_TAG => {
                    if pdu.bhs.ttt() != RESERVED_TAG {
                        let me = self.clone();
                        tokio::spawn(async move {
                            let mut w = me.writer.lock().await;
                            let (cmdsn, exp) = {
                                let s = lock(&me.seq);
                                (s.next_cmdsn, s.exp_statsn)
                            };
                            let b = nop_out_reply(&pdu.bhs, cmdsn, exp);
                            if let Err(e) = w.write_pdu(&b, &[], &pdu.data).await {
                                me.fail(e);
                            }
                        });
                    }
                }
                Some(Opcode::AsyncMessage) => {
                    tracing::info!(
                        event = pdu.bhs.async_event().0,
                        vcode = pdu.bhs.async_event().1,
                        "async message from the target"
                    );
                }
                Some(Opcode::Reject) => {
                    let reason = pdu.bhs.reject_reason();
                    let rejected = if pdu.data.len() >= 48 {
                        be32(&pdu.data, 16)
                    } else {
                        RESERVED_TAG
                    };
                    tracing::warn!(reason, itt = rejected, "target rejected a PDU");
                    if let Some(tx) = lock(&self.tasks).get(&rejected) {
                        let _ = tx.send(Event::Failed(Error::Rejected { reason }));
                    }
                }
                Some(op) if !op.is_initiator_opcode() => {
                    let tasks = lock(&self.tasks);
                    match tasks.get(&itt) {
                        Some(tx) => {
                            let _ = tx.send(Event::Pdu(pdu));
                        }
                        None => {
                            drop(tasks);
                            tracing::warn!(bhs = ?pdu.bhs, "PDU for an unknown ITT");
                        }
                    }
                }
                _ => {
                    self.fail(Error::proto(format!(
                        "target sent an initiator opcode {:#04x}",
                        pdu.bhs.raw_opcode()
                    )));
                    return;
                }
            }
        }
    }

    /// Lock the writer with the command window open; returns the CmdSN to use
    /// (taken and advanced unless `immediate`) and ExpStatSN.
    async fn writer_for_command(
        &self,
        immediate: bool,
    ) -> Result<(tokio::sync::MutexGuard<'_, Writer>, u32, u32), Error> {
        loop {
            let notified = self.window.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.check()?;
            let w = self.writer.lock().await;
            {
                let mut s = lock(&self.seq);
                if immediate {
                    return Ok((w, s.next_cmdsn, s.exp_statsn));
                }
                if s.window_open() {
                    let sn = s.take_cmdsn();
                    return Ok((w, sn, s.exp_statsn));
                }
            }
            drop(w);
            notified.await;
        }
    }

    fn exp_statsn(&self) -> u32 {
        lock(&self.seq).exp_statsn
    }
}

impl Session {
    /// Connect, log in (Normal session) and start the reader.
    pub async fn login(addr: SocketAddr, params: LoginParams) -> Result<Session, Error> {
        let mut c = Connection::connect(addr).await?;
        c.login(&params).await?;
        Session::from_connection(c)
    }

    /// Take over a logged-in connection.
    pub fn from_connection(c: Connection) -> Result<Session, Error> {
        let parts = c.into_parts()?;
        let inner = Arc::new(Inner {
            writer: Mutex::new(parts.writer),
            seq: StdMutex::new(parts.seq),
            window: Notify::new(),
            tasks: StdMutex::new(HashMap::new()),
            itt: AtomicU32::new(parts.itt.wrapping_add(1)),
            negotiated: parts.negotiated,
            fatal: StdMutex::new(None),
            isid: parts.isid,
            tsih: parts.tsih,
            cid: parts.cid,
            block_sizes: StdMutex::new(HashMap::new()),
            logging_out: AtomicBool::new(false),
        });
        let reader = tokio::spawn(inner.clone().reader_loop(parts.reader));
        Ok(Session { inner, reader })
    }

    pub fn negotiated(&self) -> &Negotiated {
        &self.inner.negotiated
    }
    pub fn isid(&self) -> [u8; 6] {
        self.inner.isid
    }
    pub fn tsih(&self) -> u16 {
        self.inner.tsih
    }
    pub fn seq(&self) -> SeqState {
        *lock(&self.inner.seq)
    }
    /// The sticky error that ended the session, if any.
    pub fn error(&self) -> Option<Error> {
        lock(&self.inner.fatal).clone()
    }

    /// Run one SCSI command. `lun` is the LUN number (encoded per SAM). Either
    /// `data_out` (write) or `data_in_len` (read) or neither; bidirectional
    /// commands are not supported.
    pub async fn command(
        &self,
        lun: u64,
        cdb: &[u8],
        data_out: Option<&[u8]>,
        data_in_len: u32,
    ) -> Result<ScsiResult, Error> {
        let inner = &*self.inner;
        inner.check()?;
        let lun_field = encode_lun(lun)?;
        if cdb.is_empty() || cdb.len() > 16 + 255 * 4 {
            return Err(Error::InvalidArgument(format!(
                "CDB of {} bytes",
                cdb.len()
            )));
        }
        let out = data_out.unwrap_or(&[]);
        if !out.is_empty() && data_in_len > 0 {
            return Err(Error::Unsupported("bidirectional commands".into()));
        }
        let out_len = u32::try_from(out.len())
            .map_err(|_| Error::InvalidArgument("Data-Out longer than 4 GiB".into()))?;
        let neg = &inner.negotiated;
        let max_send = neg.target_max_recv_data_segment_length.max(512) as usize;

        let (itt, mut rx, _guard) = inner.register();
        let mut bhs = Bhs::new(Opcode::ScsiCommand);
        let mut flags = scsi_cmd::ATTR_MASK & 1; // SIMPLE
        if !out.is_empty() {
            flags |= scsi_cmd::WRITE;
        }
        if data_in_len > 0 {
            flags |= scsi_cmd::READ;
        }
        bhs.set_lun(lun_field).set_itt(itt);
        bhs.set_expected_data_len(if out.is_empty() { data_in_len } else { out_len });
        let mut ahs = Vec::new();
        bhs.set_cdb(cdb);
        if cdb.len() > 16 {
            let ext = &cdb[16..];
            ahs.extend_from_slice(&((ext.len() + 1) as u16).to_be_bytes());
            ahs.push(AHS_EXTENDED_CDB);
            ahs.push(0);
            ahs.extend_from_slice(ext);
        }
        // Solicited vs unsolicited data (RFC 7143 13.13-13.14).
        let first_burst = neg.first_burst_length as usize;
        let imm_len = if neg.immediate_data {
            out.len().min(first_burst).min(max_send)
        } else {
            0
        };
        let unsolicited_end = if neg.initial_r2t {
            imm_len
        } else {
            out.len().min(first_burst)
        };
        if unsolicited_end == imm_len {
            flags |= 0x80; // F: no unsolicited Data-Out follows
        }
        bhs.set_flags(flags);

        {
            let (mut w, cmdsn, exp) = inner.writer_for_command(false).await?;
            bhs.set_cmdsn(cmdsn).set_exp_statsn(exp);
            let r = async {
                w.write_pdu(&bhs, &ahs, &out[..imm_len]).await?;
                if unsolicited_end > imm_len {
                    send_data_out(
                        &mut w,
                        inner,
                        lun_field,
                        itt,
                        RESERVED_TAG,
                        out,
                        imm_len,
                        unsolicited_end,
                        max_send,
                    )
                    .await?;
                }
                Ok::<(), Error>(())
            }
            .await;
            if let Err(e) = r {
                inner.fail(e.clone());
                return Err(e);
            }
        }

        let mut datain = DataInAssembler::new(data_in_len);
        let mut next_r2tsn = 0u32;
        loop {
            let ev = match rx.recv().await {
                Some(ev) => ev,
                None => return Err(inner.sticky()),
            };
            let pdu = match ev {
                Event::Pdu(p) => p,
                Event::Failed(e) => return Err(e),
            };
            let r = match pdu.bhs.opcode() {
                Some(Opcode::DataIn) => match datain.push(&pdu.bhs, &pdu.data) {
                    Ok(Some(res)) => return Ok(res),
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                },
                Some(Opcode::ScsiResponse) => {
                    return match datain.finish(&pdu.bhs, &pdu.data) {
                        Err(e @ Error::Protocol(_)) => {
                            inner.fail(e.clone());
                            Err(e)
                        }
                        r => r,
                    };
                }
                Some(Opcode::ReadyToTransfer) => {
                    let b = &pdu.bhs;
                    let off = b.buffer_offset() as usize;
                    let len = b.residual() as usize; // desired data transfer length
                    let ttt = b.ttt();
                    if out.is_empty() {
                        Err(Error::proto("R2T for a command without Data-Out"))
                    } else if b.datasn() != next_r2tsn {
                        Err(Error::proto(format!(
                            "R2TSN {}, expected {next_r2tsn}",
                            b.datasn()
                        )))
                    } else if len == 0
                        || len > neg.max_burst_length as usize
                        || off.checked_add(len).is_none_or(|e| e > out.len())
                        || ttt == RESERVED_TAG
                    {
                        Err(Error::proto(format!(
                            "R2T offset {off} length {len} TTT {ttt:#x} for {} bytes (MaxBurstLength {})",
                            out.len(),
                            neg.max_burst_length
                        )))
                    } else {
                        next_r2tsn = next_r2tsn.wrapping_add(1);
                        let mut w = inner.writer.lock().await;
                        send_data_out(
                            &mut w,
                            inner,
                            lun_field,
                            itt,
                            ttt,
                            out,
                            off,
                            off + len,
                            max_send,
                        )
                        .await
                    }
                }
                _ => Err(Error::proto(format!(
                    "unexpected PDU {:?} for a SCSI command",
                    pdu.bhs
                ))),
            };
            if let Err(e) = r {
                inner.fail(e.clone());
                return Err(e);
            }
        }
    }

    // ---------- helpers ----------

    /// READ (16); errors unless GOOD and exactly `blocks * block_size` bytes came back.
    pub async fn read(
        &self,
        lun: u64,
        lba: u64,
        blocks: u32,
        block_size: u32,
    ) -> Result<Vec<u8>, Error> {
        let len = blocks
            .checked_mul(block_size)
            .ok_or_else(|| Error::InvalidArgument("transfer longer than 4 GiB".into()))?;
        let r = self
            .command(lun, &cdb::read16(lba, blocks), None, len)
            .await?
            .check()?;
        if r.data.len() != len as usize {
            return Err(Error::proto(format!(
                "READ returned {} of {len} bytes with GOOD status",
                r.data.len()
            )));
        }
        Ok(r.data)
    }

    /// WRITE (16) of `data`, which must be a whole number of the LUN's
    /// blocks (block size from READ CAPACITY (16), asked once per LUN and cached).
    pub async fn write(&self, lun: u64, lba: u64, data: &[u8], fua: bool) -> Result<(), Error> {
        let bs = self.block_size(lun).await?;
        if data.is_empty() || !data.len().is_multiple_of(bs as usize) {
            return Err(Error::InvalidArgument(format!(
                "{} bytes is not a whole number of {bs}-byte blocks",
                data.len()
            )));
        }
        let blocks = u32::try_from(data.len() / bs as usize)
            .map_err(|_| Error::InvalidArgument("too many blocks".into()))?;
        self.command(lun, &cdb::write16(lba, blocks, fua), Some(data), 0)
            .await?
            .check()
            .map(|_| ())
    }

    /// The LUN's logical block length (cached READ CAPACITY (16)).
    pub async fn block_size(&self, lun: u64) -> Result<u32, Error> {
        if let Some(bs) = lock(&self.inner.block_sizes).get(&lun) {
            return Ok(*bs);
        }
        Ok(self.read_capacity16(lun).await?.1)
    }

    pub async fn sync_cache(&self, lun: u64) -> Result<(), Error> {
        self.command(lun, &cdb::sync_cache10(), None, 0)
            .await?
            .check()
            .map(|_| ())
    }

    pub async fn inquiry(
        &self,
        lun: u64,
        evpd: bool,
        page: u8,
        alloc: u16,
    ) -> Result<Vec<u8>, Error> {
        Ok(self
            .command(
                lun,
                &cdb::inquiry(evpd, page, alloc),
                None,
                u32::from(alloc),
            )
            .await?
            .check()?
            .data)
    }

    /// READ CAPACITY (16): (last LBA, logical block length).
    pub async fn read_capacity16(&self, lun: u64) -> Result<(u64, u32), Error> {
        let d = self
            .command(lun, &cdb::read_capacity16(32), None, 32)
            .await?
            .check()?
            .data;
        if d.len() < 12 {
            return Err(Error::proto(format!(
                "READ CAPACITY (16) returned {} bytes",
                d.len()
            )));
        }
        let (last, bs) = (be64(&d, 0), be32(&d, 8));
        if bs == 0 {
            return Err(Error::proto("READ CAPACITY (16) reports block length 0"));
        }
        lock(&self.inner.block_sizes).insert(lun, bs);
        Ok((last, bs))
    }

    pub async fn test_unit_ready(&self, lun: u64) -> Result<ScsiResult, Error> {
        self.command(lun, &cdb::test_unit_ready(), None, 0).await
    }

    /// REPORT LUNS (to LUN 0): decoded LUN numbers.
    pub async fn report_luns(&self) -> Result<Vec<u64>, Error> {
        let d = self
            .command(0, &cdb::report_luns(16 * 1024), None, 16 * 1024)
            .await?
            .check()?
            .data;
        let n = be32(&d, 0) as usize / 8;
        Ok(d.get(8..)
            .unwrap_or(&[])
            .chunks_exact(8)
            .take(n)
            .map(|c| crate::decode_lun(be64(c, 0)))
            .collect())
    }

    /// NOP-Out ping (immediate); waits for the NOP-In echo.
    pub async fn nop(&self) -> Result<(), Error> {
        let inner = &*self.inner;
        let (itt, mut rx, _guard) = inner.register();
        let payload = b"ramslog-ping";
        {
            let (mut w, cmdsn, exp) = inner.writer_for_command(true).await?;
            let mut b = Bhs::new(Opcode::NopOut);
            b.set_immediate(true);
            b.set_final(true)
                .set_itt(itt)
                .set_ttt(RESERVED_TAG)
                .set_cmdsn(cmdsn)
                .set_exp_statsn(exp);
            w.write_pdu(&b, &[], payload).await?;
        }
        match rx.recv().await {
            Some(Event::Pdu(p)) if p.bhs.opcode() == Some(Opcode::NopIn) => {
                if p.data != payload {
                    return Err(Error::proto("NOP-In does not echo the ping data"));
                }
                Ok(())
            }
            Some(Event::Pdu(p)) => Err(Error::proto(format!(
                "unexpected PDU {:?} answering a NOP-Out",
                p.bhs
            ))),
            Some(Event::Failed(e)) => Err(e),
            None => Err(inner.sticky()),
        }
    }

    /// Log out (close the session) and wait for the response.
    pub async fn logout(self) -> Result<(), Error> {
        let inner = &*self.inner;
        let (itt, mut rx, _guard) = inner.register();
        inner.logging_out.store(true, Ordering::Relaxed);
        {
            let (mut w, cmdsn, exp) = inner.writer_for_command(true).await?;
            let b = logout_request(itt, inner.cid, cmdsn, exp);
            w.write_pdu(&b, &[], &[]).await?;
        }
        match rx.recv().await {
            Some(Event::Pdu(p)) if p.bhs.opcode() == Some(Opcode::LogoutResponse) => {
                match p.bhs.response() {
                    0 => Ok(()),
                    r => Err(Error::proto(format!("logout response {r}"))),
                }
            }
            Some(Event::Pdu(p)) => Err(Error::proto(format!(
                "unexpected PDU {:?} answering Logout",
                p.bhs
            ))),
            Some(Event::Failed(e)) => Err(e),
            None => Err(inner.sticky()),
        }
    }
}

/// Data-Out PDUs for `out[from..to]`, each at most `max_send` bytes, DataSN
/// from 0, F on the last.
#[allow(clippy::too_many_arguments)]
async fn send_data_out(
    w: &mut Writer,
    inner: &Inner,
    lun_field: u64,
    itt: u32,
    ttt: u32,
    out: &[u8],
    from: usize,
    to: usize,
    max_send: usize,
) -> Result<(), Error> {
    let mut off = from;
    let mut datasn = 0u32;
    while off < to {
        let end = (off + max_send).min(to);
        let mut b = Bhs::data_out(itt, ttt, off as u32, datasn, end == to);
        b.set_lun(lun_field).set_exp_statsn(inner.exp_statsn());
        w.write_pdu(&b, &[], &out[off..end]).await?;
        datasn = datasn.wrapping_add(1);
        off = end;
    }
    Ok(())
}
