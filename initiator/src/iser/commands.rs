//! SCSI commands: submit, wait, and the helpers built on them.

use super::*;

impl IserSession {
    /// Submit a SCSI command; `data_out` is copied into the command's
    /// registered buffer. Blocks while the command window or every command
    /// slot is full. Either `data_out` or `data_in_len` (or neither).
    pub fn submit(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: &[u8],
        data_in_len: u32,
    ) -> Result<Tag, Error> {
        let data_out_len = u32::try_from(data_out.len())
            .map_err(|_| Error::InvalidArgument("Data-Out longer than 4 GiB".into()))?;
        self.check()?;
        if !self.full_feature || self.session_type != SessionType::Normal {
            return Err(Error::InvalidArgument(
                "SCSI commands need a logged-in Normal session".into(),
            ));
        }
        let lun_field = encode_lun(lun)?;
        if cdb.is_empty() || cdb.len() > 16 {
            return Err(Error::Unsupported(format!(
                "CDB of {} bytes (1..=16 over iSER here)",
                cdb.len()
            )));
        }
        if data_out_len > 0 && data_in_len > 0 {
            return Err(Error::Unsupported("bidirectional commands".into()));
        }
        let out_len = data_out_len as usize;
        if out_len.max(data_in_len as usize) > self.opts.max_transfer {
            return Err(Error::InvalidArgument(format!(
                "{} bytes exceed the {}-byte command buffer",
                out_len.max(data_in_len as usize),
                self.opts.max_transfer
            )));
        }
        let deadline = Instant::now() + self.opts.timeout;
        while self.free_tasks.is_empty() || !self.seq.window_open() {
            if self.free_tasks.is_empty() && self.outstanding() == 0 {
                return Err(Error::InvalidArgument(
                    "every command slot holds a completion nobody collected: call wait()".into(),
                ));
            }
            self.turn_or_timeout(deadline, "a free command slot and an open command window")?;
        }
        let Some(slot) = self.free_tasks.pop_front() else {
            return Err(Error::InvalidArgument("no free command slot".into()));
        };
        let task = &mut self.tasks[slot];
        task.generation = if task.generation >= 0x7fff {
            1
        } else {
            task.generation + 1
        };
        let tag = Tag(u32::from(task.generation) << 16 | slot as u32);
        if out_len > 0 && task.buf.write(0, data_out).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{out_len} bytes of Data-Out exceed the task buffer"
            )));
        }
        if data_in_len > 0 && self.opts.poison_reads {
            let _ = task.buf.fill(0, data_in_len as usize, POISON);
        }
        let neg = &self.negotiated;
        let imm_len = if neg.immediate_data {
            out_len
                .min(neg.first_burst_length as usize)
                .min(neg.target_max_recv_data_segment_length as usize)
                .min(SEND_SLOT_LEN - HEADERS_LEN)
        } else {
            0
        };
        let va = task.buf.addr();
        let stag = task.buf.rkey();
        let write = (out_len > imm_len).then(|| RemoteBuffer {
            stag,
            // Linux points the write VA past the unsolicited data; illumos
            // sends the buffer's start (it never has immediate data with a
            // COMSTAR-like target).
            va: match self.opts.profile {
                IserProfile::Linux => va + imm_len as u64,
                IserProfile::Illumos => va,
            },
        });
        let read = (data_in_len > 0).then_some(RemoteBuffer { stag, va });
        let mut b = Bhs::new(Opcode::ScsiCommand);
        let mut flags = 0x80 | (scsi_cmd::ATTR_MASK & 1); // F, SIMPLE
        if out_len > 0 {
            flags |= scsi_cmd::WRITE;
        }
        if data_in_len > 0 {
            flags |= scsi_cmd::READ;
        }
        b.set_flags(flags);
        b.set_lun(lun_field).set_itt(tag.0);
        b.set_expected_data_len(if out_len > 0 {
            data_out_len
        } else {
            data_in_len
        });
        b.set_cdb(cdb);
        let cmdsn = self.seq.take_cmdsn();
        b.set_cmdsn(cmdsn).set_exp_statsn(self.seq.exp_statsn);
        task.state = TaskState::Busy { data_in_len };
        let header = Header::Control { write, read };
        // Free slots exist: the send queue has room for every command slot.
        while self.rdma.free_send.is_empty() {
            self.turn_or_timeout(deadline, "a free send slot")?;
        }
        let imm = &data_out[..imm_len];
        if let Err(e) = self.rdma.post_pdu(&header, &b, imm) {
            return Err(self.fail(e));
        }
        self.stats.commands += 1;
        Ok(tag)
    }

    /// Hand a completion to the caller: its slot may be reused from now on
    /// (the least recently freed first, so its read data lasts).
    pub(super) fn collect(&mut self, c: Completion) -> Completion {
        self.free_tasks.push_back(c.tag.slot());
        c
    }

    /// The next completed command, waiting for one if none is ready.
    pub fn wait(&mut self) -> Result<Completion, Error> {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(self.collect(c));
            }
            self.check()?;
            if self.outstanding() == 0 {
                return Err(Error::InvalidArgument("no command is outstanding".into()));
            }
            self.turn_or_timeout(deadline, "a SCSI Response")?;
        }
    }

    /// A completed command if one is ready; never sleeps.
    pub fn poll(&mut self) -> Result<Option<Completion>, Error> {
        if self.done.is_empty() {
            self.check()?;
            let r = self.poll_once();
            self.sticky(r)?;
        }
        Ok(self.done.pop_front().map(|c| self.collect(c)))
    }

    /// Wait for the command `tag` (completions of others are kept for
    /// [`wait`](Self::wait)).
    pub fn wait_for(&mut self, tag: Tag) -> Result<Completion, Error> {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            if let Some(i) = self.done.iter().position(|c| c.tag == tag) {
                if let Some(c) = self.done.remove(i) {
                    return Ok(self.collect(c));
                }
            }
            self.check()?;
            match self.tasks.get(tag.slot()) {
                Some(t)
                    if t.generation == tag.generation()
                        && matches!(t.state, TaskState::Busy { .. }) => {}
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{tag:?} is not outstanding"
                    )))
                }
            }
            self.turn_or_timeout(deadline, "a SCSI Response")?;
        }
    }

    /// The read data of a completed command, copied out of its registered
    /// buffer (which the target RDMA-writes); there until its slot is reused
    /// by a later submit after the completion was collected (then
    /// InvalidArgument).
    pub fn data_in(&self, tag: Tag) -> Result<Vec<u8>, Error> {
        let mut out = vec![0; self.data_in_len(tag)?];
        self.data_in_into(tag, &mut out)?;
        Ok(out)
    }

    /// How many bytes of read data a completed command has.
    fn data_in_len(&self, tag: Tag) -> Result<usize, Error> {
        match self.tasks.get(tag.slot()) {
            Some(t) if t.generation == tag.generation() => match t.state {
                TaskState::Done { data_in_len } => Ok(data_in_len as usize),
                _ => Err(Error::InvalidArgument(format!("{tag:?} has not completed"))),
            },
            _ => Err(Error::InvalidArgument(format!(
                "{tag:?}: its buffer was reused"
            ))),
        }
    }

    /// As [`data_in`](Self::data_in), into the start of `out`; returns the
    /// length (errors when `out` is shorter).
    pub fn data_in_into(&self, tag: Tag, out: &mut [u8]) -> Result<usize, Error> {
        let len = self.data_in_len(tag)?;
        let room = out.len();
        let dst = out.get_mut(..len).ok_or_else(|| {
            Error::InvalidArgument(format!("{len} bytes of read data, room for {room}"))
        })?;
        self.tasks[tag.slot()]
            .buf
            .read(0, dst)
            .ok_or_else(|| Error::Rdma("Data-In beyond the task buffer".into()))?;
        Ok(len)
    }

    /// Run one command to completion: submit, wait, copy the read data to
    /// `data_in` (its length is the expected read length).
    pub fn command(
        &mut self,
        lun: u64,
        cdb: &[u8],
        data_out: &[u8],
        data_in: &mut [u8],
    ) -> Result<IserStatus, Error> {
        let in_len = u32::try_from(data_in.len())
            .map_err(|_| Error::InvalidArgument("Data-In longer than 4 GiB".into()))?;
        let tag = self.submit(lun, cdb, data_out, in_len)?;
        let st = self.wait_for(tag)?.result?;
        if in_len > 0 {
            self.data_in_into(tag, data_in)?;
        }
        Ok(st)
    }

    /// WRITE (16) of `data`, a whole number of the LUN's blocks.
    pub fn write16(&mut self, lun: u64, lba: u64, data: &[u8], fua: bool) -> Result<(), Error> {
        let blocks = self.blocks(lun, data.len())?;
        self.command(lun, &cdb::write16(lba, blocks, fua), data, &mut [])?
            .check()
            .map(|_| ())
    }

    /// READ (16) filling `out` (a whole number of blocks); errors unless
    /// GOOD and every byte came.
    pub fn read16(&mut self, lun: u64, lba: u64, out: &mut [u8]) -> Result<(), Error> {
        let blocks = self.blocks(lun, out.len())?;
        let st = self
            .command(lun, &cdb::read16(lba, blocks), &[], out)?
            .check()?;
        if st.data_in_len as usize != out.len() {
            return Err(Error::proto(format!(
                "READ moved {} of {} bytes with GOOD status",
                st.data_in_len,
                out.len()
            )));
        }
        Ok(())
    }

    pub(super) fn blocks(&mut self, lun: u64, len: usize) -> Result<u32, Error> {
        let bs = self.block_size(lun)? as usize;
        if len == 0 || !len.is_multiple_of(bs) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes is not a whole number of {bs}-byte blocks"
            )));
        }
        u32::try_from(len / bs).map_err(|_| Error::InvalidArgument("too many blocks".into()))
    }

    /// The LUN's logical block length (READ CAPACITY (16), asked once).
    pub fn block_size(&mut self, lun: u64) -> Result<u32, Error> {
        if let Some((_, bs)) = self.block_sizes.iter().find(|(l, _)| *l == lun) {
            return Ok(*bs);
        }
        Ok(self.read_capacity16(lun)?.1)
    }

    /// READ CAPACITY (16): (last LBA, logical block length).
    pub fn read_capacity16(&mut self, lun: u64) -> Result<(u64, u32), Error> {
        let mut d = [0u8; 32];
        let st = self
            .command(lun, &cdb::read_capacity16(32), &[], &mut d)?
            .check()?;
        if st.data_in_len < 12 {
            return Err(Error::proto(format!(
                "READ CAPACITY (16) returned {} bytes",
                st.data_in_len
            )));
        }
        let (last, bs) = (be64(&d, 0), be32(&d, 8));
        if bs == 0 {
            return Err(Error::proto("READ CAPACITY (16) reports block length 0"));
        }
        self.block_sizes.retain(|(l, _)| *l != lun);
        self.block_sizes.push((lun, bs));
        Ok((last, bs))
    }

    pub fn sync_cache(&mut self, lun: u64) -> Result<(), Error> {
        self.command(lun, &cdb::sync_cache10(), &[], &mut [])?
            .check()
            .map(|_| ())
    }

    pub fn test_unit_ready(&mut self, lun: u64) -> Result<IserStatus, Error> {
        self.command(lun, &cdb::test_unit_ready(), &[], &mut [])
    }

    /// INQUIRY: the bytes the target sent (at most `alloc`).
    pub fn inquiry(
        &mut self,
        lun: u64,
        evpd: bool,
        page: u8,
        alloc: u16,
    ) -> Result<Vec<u8>, Error> {
        let mut d = vec![0u8; usize::from(alloc)];
        let st = self
            .command(lun, &cdb::inquiry(evpd, page, alloc), &[], &mut d)?
            .check()?;
        d.truncate(st.data_in_len as usize);
        Ok(d)
    }
}
