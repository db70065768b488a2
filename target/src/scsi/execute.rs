//! Phase 2: executing a planned command against the LU.

use super::*;

impl ScsiTarget {
    /// Phase 2; see the module docs. `data_out` holds the Data-Out for
    /// `OutPlacement::Buffer` plans (possibly fewer bytes than
    /// `data_out_len` if the initiator sent less; block commands then act
    /// on the whole blocks that arrived).
    pub fn execute(
        &self,
        nexus: NexusId,
        plan: &Plan,
        data_out: &[u8],
        data_in: &mut Vec<u8>,
    ) -> Result<DataIn, Failure> {
        data_in.clear();
        let lu = self.lu_of(plan);
        match (plan.op, lu) {
            (Op::Read { lba, blocks }, Some(lu)) => Ok(if blocks == 0 {
                DataIn::None
            } else {
                DataIn::Store {
                    volume: lu.volume.id(),
                    offset: lu.offset(lba),
                    len: plan.data_in_len,
                }
            }),
            (Op::Write { lba, blocks }, Some(lu)) => {
                lu.commit_write(lba, u64::from(blocks))?;
                Ok(DataIn::None)
            }
            (Op::Inquiry { evpd, page, alloc }, lu) => {
                match (evpd, lu) {
                    (false, lu) => inquiry::standard(data_in, lu.is_some()),
                    (true, Some(lu)) => {
                        let id = lu.volume.identity().0;
                        inquiry::vpd(data_in, page, &id, lu.geo)
                    }
                    (true, None) => inquiry::absent_vpd(data_in, page),
                }
                Ok(finish(data_in, alloc))
            }
            (Op::ReportLuns { select, alloc }, _) => {
                inquiry::report_luns(data_in, select, self.lus.iter().map(|l| l.lun));
                Ok(finish(data_in, alloc))
            }
            (Op::RequestSense { desc, alloc }, lu) => {
                let s = match lu {
                    None => SenseReason::LuNotSupported.sense(),
                    Some(lu) => {
                        let mut st = lu.lock();
                        let ua = st.pop_ua(nexus);
                        lu.refresh(&st);
                        match ua {
                            Some((asc, ascq)) => SenseReason::UnitAttention { asc, ascq }.sense(),
                            None if !lu.volume.is_ready() => {
                                SenseReason::NotReadyManualIntervention.sense()
                            }
                            None => None,
                        }
                    }
                };
                let s = s.unwrap_or(sense::NO_SENSE);
                if desc {
                    data_in.extend_from_slice(&[0x72, s.key, s.asc, s.ascq, 0, 0, 0, 0]);
                } else {
                    data_in.extend_from_slice(&s.encode_fixed());
                }
                Ok(finish(data_in, alloc))
            }
            (_, None) => Err(SenseReason::LuNotSupported.into()),
            (op, Some(lu)) => self.execute_lu(nexus, lu, op, data_out, data_in),
        }
    }

    fn execute_lu(
        &self,
        nexus: NexusId,
        lu: &LogicalUnit,
        op: Op,
        data_out: &[u8],
        data_in: &mut Vec<u8>,
    ) -> Result<DataIn, Failure> {
        let geo = lu.geo;
        let bs = geo.block_size as usize;
        let store_err = |_| SenseReason::InternalTargetFailure;
        match op {
            Op::TestUnitReady | Op::StartStop { .. } | Op::NoData => Ok(DataIn::None),
            Op::ReadCapacity10 => {
                let last = u32::try_from(geo.blocks - 1).unwrap_or(u32::MAX);
                data_in.extend_from_slice(&last.to_be_bytes());
                data_in.extend_from_slice(&geo.block_size.to_be_bytes());
                Ok(finish(data_in, 8))
            }
            Op::ReadCapacity16 { alloc } => {
                data_in.extend_from_slice(&(geo.blocks - 1).to_be_bytes());
                data_in.extend_from_slice(&geo.block_size.to_be_bytes());
                // No protection, one logical block per physical block,
                // LBPME=0 (fully provisioned), LBPRZ=0.
                data_in.resize(32, 0);
                Ok(finish(data_in, alloc))
            }
            Op::WriteVerify { lba, blocks } => {
                let n = whole_blocks(data_out, blocks, bs);
                let _g = lu.exclusion.hold(lba, (n / bs) as u64);
                let _placing = lu.volume.will_write(lu.offset(lba), n as u64);
                lu.volume
                    .store()
                    .write(lu.offset(lba), &data_out[..n])
                    .map_err(store_err)?;
                lu.commit_write(lba, (n / bs) as u64)?;
                // The verify half is the write itself: RAM reads back what
                // was just copied in.
                Ok(DataIn::None)
            }
            Op::Verify {
                lba,
                blocks,
                bytchk,
            } => {
                let n = match bytchk {
                    1 => whole_blocks(data_out, blocks, bs),
                    3 if data_out.len() >= bs => bs,
                    _ => return Ok(DataIn::None),
                };
                let mut buf = vec![0u8; bs];
                for i in 0..blocks as usize {
                    let expect = if bytchk == 3 {
                        &data_out[..bs]
                    } else if (i + 1) * bs <= n {
                        &data_out[i * bs..(i + 1) * bs]
                    } else {
                        break;
                    };
                    lu.volume
                        .store()
                        .read(lu.offset(lba) + (i * bs) as u64, &mut buf)
                        .map_err(store_err)?;
                    if let Some(j) = first_diff(&buf, expect) {
                        let base = if bytchk == 3 { 0 } else { i * bs };
                        return Err(SenseReason::Miscompare {
                            offset: (base + j) as u32,
                        }
                        .into());
                    }
                }
                Ok(DataIn::None)
            }
            Op::WriteSame { lba, blocks, ndob } => {
                let _g = lu.exclusion.hold(lba, blocks);
                let start = lu.offset(lba);
                let total = blocks * bs as u64;
                let _placing = lu.volume.will_write(start, total);
                let pattern = if ndob {
                    None
                } else {
                    Some(
                        data_out
                            .get(..bs)
                            .ok_or(SenseReason::InvalidFieldInCdb(FieldPointer::cdb(0)))?,
                    )
                };
                match pattern {
                    Some(p) if p.iter().any(|&b| b != 0) => {
                        // Fill a 64 KiB run of the pattern once, then copy runs.
                        let run: Vec<u8> =
                            p.iter().copied().cycle().take(bs.max(64 << 10)).collect();
                        let mut done = 0u64;
                        while done < total {
                            let n = (total - done).min(run.len() as u64) as usize;
                            lu.volume
                                .store()
                                .write(start + done, &run[..n])
                                .map_err(store_err)?;
                            done += n as u64;
                        }
                    }
                    _ => {
                        let len = usize::try_from(total)
                            .map_err(|_| SenseReason::InternalTargetFailure)?;
                        lu.volume.store().zero(start, len).map_err(store_err)?;
                    }
                }
                lu.commit_write(lba, blocks)?;
                Ok(DataIn::None)
            }
            Op::CompareAndWrite { lba, blocks } => {
                let n = blocks as usize * bs;
                if n == 0 {
                    return Ok(DataIn::None);
                }
                let (Some(verify), Some(write)) = (data_out.get(..n), data_out.get(n..2 * n))
                else {
                    return Err(SenseReason::InvalidFieldInCdb(FieldPointer::cdb(13)).into());
                };
                let _g = lu.exclusion.hold(lba, u64::from(blocks));
                let mut cur = vec![0u8; n];
                lu.volume
                    .store()
                    .read(lu.offset(lba), &mut cur)
                    .map_err(store_err)?;
                if let Some(j) = first_diff(&cur, verify) {
                    return Err(SenseReason::Miscompare { offset: j as u32 }.into());
                }
                let _placing = lu.volume.will_write(lu.offset(lba), n as u64);
                lu.volume
                    .store()
                    .write(lu.offset(lba), write)
                    .map_err(store_err)?;
                lu.commit_write(lba, u64::from(blocks))?;
                Ok(DataIn::None)
            }
            Op::ModeSense(req) => {
                mode::sense(data_in, &req, geo);
                Ok(finish(data_in, req.alloc))
            }
            Op::ModeSelect { ten, len } => {
                mode::select(data_out, len, ten, geo)?;
                Ok(DataIn::None)
            }
            Op::PrIn { sa, alloc } => {
                let st = lu.lock();
                match sa {
                    0 => st.pr.read_keys(data_in),
                    1 => st.pr.read_reservation(data_in),
                    2 => st
                        .pr
                        .report_capabilities(lu.volume.persistence().is_some(), data_in),
                    _ => st.pr.read_full_status(data_in),
                }
                Ok(finish(data_in, alloc))
            }
            Op::PrOut { sa, scope, ty } => {
                let mut st = lu.lock();
                let port = st.port(nexus);
                let persistent = lu.volume.persistence().is_some();
                let mut next = st.pr.clone();
                let uas = next.out(&port, sa, scope, ty, data_out, persistent)?;
                // Recorded before GOOD: a successor serving this memory
                // fences the same hosts, and a change the image is to carry
                // (APTPL before or after) makes the last image stale first.
                lu.volume.keep_reservations(next.kept())?;
                st.pr = next;
                if sa == PR_OUT_PREEMPT_AND_ABORT {
                    // SPC-4 5.13.11.2.6: the tasks of every preempted I_T
                    // nexus are aborted (TAS=0: without status).
                    let preempted: Vec<Arc<str>> = uas
                        .iter()
                        .filter(|(_, code)| *code == sense::ua::REGISTRATIONS_PREEMPTED)
                        .map(|(p, _)| p.clone())
                        .collect();
                    lu.abort_tasks(&mut st, nexus, |id, entry| {
                        id != nexus && preempted.contains(&entry.port)
                    });
                }
                for (p, code) in uas {
                    st.raise_port(&p, nexus, code);
                }
                lu.refresh(&st);
                Ok(DataIn::None)
            }
            Op::Reserve6 | Op::Release6 => {
                let mut st = lu.lock();
                // RESERVE/RELEASE(6) yield to persistent reservations (SPC-4 5.13.3).
                if st.pr.active() {
                    return Err(SenseReason::ReservationConflict.into());
                }
                match (op, st.spc2) {
                    (Op::Reserve6, Some(h)) if h != nexus => {
                        return Err(SenseReason::ReservationConflict.into())
                    }
                    (Op::Reserve6, _) => st.spc2 = Some(nexus),
                    // Releasing someone else's reservation is a no-op, GOOD.
                    (_, Some(h)) if h == nexus => st.spc2 = None,
                    _ => {}
                }
                lu.refresh(&st);
                Ok(DataIn::None)
            }
            Op::ReportOpcodes { alloc, .. } => {
                opcodes::report(data_in, &op);
                Ok(finish(data_in, alloc))
            }
            // Handled in `execute` before the LU dispatch.
            Op::Read { .. }
            | Op::Write { .. }
            | Op::Inquiry { .. }
            | Op::ReportLuns { .. }
            | Op::RequestSense { .. } => Ok(DataIn::None),
        }
    }
}

fn finish(data_in: &mut Vec<u8>, alloc: u32) -> DataIn {
    data_in.truncate(alloc as usize);
    DataIn::Buffer {
        len: data_in.len() as u32,
    }
}

/// Bytes of `data` forming whole blocks, at most `blocks` of them.
fn whole_blocks(data: &[u8], blocks: u32, bs: usize) -> usize {
    let want = blocks as usize * bs;
    want.min(data.len() / bs * bs)
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}
