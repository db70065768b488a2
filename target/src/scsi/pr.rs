//! SPC-4 persistent reservations (PERSISTENT RESERVE IN/OUT) for one LU.
//!
//! Registrations belong to initiator ports (iSCSI name + ISID), not to
//! sessions: they survive logout and I_T nexus loss, and a planned restart
//! or a crash whose LU memory is served again (the kept-memory record
//! carries them: the LU did not reset). Through a stop and a start (the
//! image) they persist only when the last REGISTER asked for it (APTPL=1),
//! and only on a volume with a state directory (PTPL_C); otherwise a start
//! from an image has none. There is one target port.

use std::sync::Arc;

use ramslog_common::scsi_wire::be64;

use super::sense::{bad_cdb_bit, bad_param, bad_param_bit, ua, SenseReason};
use super::vocab::Access;
use crate::volume::kept::{KeptRegistration, KeptReservation, KeptReservations};

pub(crate) const WE: u8 = 1;
pub(crate) const EA: u8 = 3;
pub(crate) const WE_RO: u8 = 5;
pub(crate) const EA_RO: u8 = 6;
pub(crate) const WE_AR: u8 = 7;
pub(crate) const EA_AR: u8 = 8;

/// Registrations one LU keeps. They outlive sessions, so without a cap a
/// host logging in with ever new ISIDs would grow them without end; a
/// cluster needs one per host port (fence_scsi, Pacemaker: a handful).
pub(crate) const MAX_REGISTRATIONS: usize = 64;

fn all_registrants(ty: u8) -> bool {
    matches!(ty, WE_AR | EA_AR)
}

#[derive(Debug, Clone)]
struct Reg {
    port: Arc<str>,
    key: u64,
}

#[derive(Debug, Clone)]
struct Resv {
    /// Holding initiator port; meaningless for all-registrants types.
    holder: Arc<str>,
    ty: u8,
}

/// A unit attention to raise on the I_T nexus of an initiator port.
pub(crate) type PortUa = (Arc<str>, (u8, u8));

#[derive(Debug, Default, Clone)]
pub(crate) struct PrState {
    generation: u32,
    /// Persist through power loss (the last effective REGISTER's APTPL).
    aptpl: bool,
    regs: Vec<Reg>,
    resv: Option<Resv>,
}

impl PrState {
    /// The state as the kept-memory record carries it.
    pub fn kept(&self) -> KeptReservations {
        KeptReservations {
            generation: self.generation,
            aptpl: self.aptpl,
            registrations: self
                .regs
                .iter()
                .map(|r| KeptRegistration {
                    port: r.port.to_string(),
                    key: r.key,
                })
                .collect(),
            reservation: self.resv.as_ref().map(|r| KeptReservation {
                holder: r.holder.to_string(),
                kind: r.ty,
            }),
        }
    }

    /// The state a predecessor recorded, or why it is not one this LU
    /// could have made (then nothing of it is taken).
    pub fn from_kept(k: &KeptReservations) -> Result<PrState, String> {
        if k.registrations.len() > MAX_REGISTRATIONS {
            return Err(format!(
                "{} registrations, more than {MAX_REGISTRATIONS}",
                k.registrations.len()
            ));
        }
        let mut regs: Vec<Reg> = Vec::with_capacity(k.registrations.len());
        for r in &k.registrations {
            if r.key == 0 || r.port.is_empty() || r.port.len() > 512 {
                return Err(format!(
                    "a registration of key {:#x} for port {:?}",
                    r.key, r.port
                ));
            }
            if regs.iter().any(|g| *g.port == *r.port) {
                return Err(format!("port {:?} registered twice", r.port));
            }
            regs.push(Reg {
                port: r.port.as_str().into(),
                key: r.key,
            });
        }
        let resv = match &k.reservation {
            None => None,
            Some(r) => {
                if !matches!(r.kind, WE | EA | WE_RO | EA_RO | WE_AR | EA_AR) {
                    return Err(format!("a reservation of type {:#x}", r.kind));
                }
                if !regs.iter().any(|g| *g.port == *r.holder) {
                    return Err(format!("a reservation held by unregistered {:?}", r.holder));
                }
                Some(Resv {
                    holder: r.holder.as_str().into(),
                    ty: r.kind,
                })
            }
        };
        Ok(PrState {
            generation: k.generation,
            aptpl: k.aptpl,
            regs,
            resv,
        })
    }

    /// Anything here that RESERVE(6)/RELEASE(6) must yield to.
    pub fn active(&self) -> bool {
        !self.regs.is_empty() || self.resv.is_some()
    }

    pub fn reserved(&self) -> bool {
        self.resv.is_some()
    }

    fn reg(&self, port: &str) -> Option<&Reg> {
        self.regs.iter().find(|r| &*r.port == port)
    }

    fn is_holder(&self, port: &str) -> bool {
        match &self.resv {
            Some(r) if all_registrants(r.ty) => self.reg(port).is_some(),
            Some(r) => &*r.holder == port,
            None => false,
        }
    }

    /// Does the reservation forbid this access from `port`?
    pub fn conflicts(&self, port: &str, access: Access) -> bool {
        let Some(r) = &self.resv else { return false };
        if !matches!(access, Access::Read | Access::Write) || self.is_holder(port) {
            return false;
        }
        let registered = self.reg(port).is_some();
        match r.ty {
            WE => access == Access::Write,
            EA => true,
            WE_RO | WE_AR => !registered && access == Access::Write,
            EA_RO | EA_AR => !registered,
            _ => true,
        }
    }

    pub fn read_keys(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.generation.to_be_bytes());
        out.extend_from_slice(&((self.regs.len() * 8) as u32).to_be_bytes());
        for r in &self.regs {
            out.extend_from_slice(&r.key.to_be_bytes());
        }
    }

    fn holder_key(&self) -> u64 {
        match &self.resv {
            Some(r) if !all_registrants(r.ty) => self.reg(&r.holder).map_or(0, |g| g.key),
            _ => 0,
        }
    }

    pub fn read_reservation(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.generation.to_be_bytes());
        match &self.resv {
            None => out.extend_from_slice(&0u32.to_be_bytes()),
            Some(r) => {
                out.extend_from_slice(&16u32.to_be_bytes());
                // All-registrants reservations report key 0 (SPC-4 6.16.3.3).
                out.extend_from_slice(&self.holder_key().to_be_bytes());
                out.extend_from_slice(&[0, 0, 0, 0, 0, r.ty, 0, 0]);
            }
        }
    }

    /// Whether the reservations are to persist through power loss.
    #[cfg(test)]
    pub fn aptpl(&self) -> bool {
        self.aptpl
    }

    /// REPORT CAPABILITIES; `persistent`: the LU has a state directory, so
    /// it can keep reservations through power loss (PTPL_C).
    pub fn report_capabilities(&self, persistent: bool, out: &mut Vec<u8>) {
        // CRH/SIP_C/ATP_C 0; TMV=1, ALLOW COMMANDS 0; type mask: WR_EX_AR,
        // EX_AC_RO, WR_EX_RO, EX_AC, WR_EX | EX_AC_AR.
        let ptpl_c = u8::from(persistent);
        let ptpl_a = u8::from(persistent && self.aptpl);
        out.extend_from_slice(&[0, 8, ptpl_c, 0x80 | ptpl_a, 0xea, 0x01, 0, 0]);
    }

    pub fn read_full_status(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.generation.to_be_bytes());
        let len_at = out.len();
        out.extend_from_slice(&[0; 4]);
        for r in &self.regs {
            out.extend_from_slice(&r.key.to_be_bytes());
            out.extend_from_slice(&[0; 4]);
            let holder = self.is_holder(&r.port);
            out.push(u8::from(holder));
            out.push(if holder {
                self.resv.as_ref().map_or(0, |v| v.ty)
            } else {
                0
            });
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&1u16.to_be_bytes()); // relative target port
                                                        // iSCSI TransportID, format 01b (name + ",i,0x" + ISID), NUL
                                                        // terminated and padded to a multiple of 4 (SPC-4 7.6.4.6).
            let name_len = (r.port.len() + 1).next_multiple_of(4);
            out.extend_from_slice(&((4 + name_len) as u32).to_be_bytes());
            out.extend_from_slice(&[0x45, 0]);
            out.extend_from_slice(&(name_len as u16).to_be_bytes());
            out.extend_from_slice(r.port.as_bytes());
            out.resize(out.len() + name_len - r.port.len(), 0);
        }
        let len = (out.len() - len_at - 4) as u32;
        out[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
    }

    /// Registrants other than `port`, each with the given UA.
    fn others(&self, port: &str, code: (u8, u8)) -> Vec<PortUa> {
        self.regs
            .iter()
            .filter(|r| &*r.port != port)
            .map(|r| (r.port.clone(), code))
            .collect()
    }

    /// Remove `port`'s registration and whatever reservation depended on it.
    fn unregister(&mut self, port: &str, uas: &mut Vec<PortUa>) {
        let was_holder = self.is_holder(port);
        self.regs.retain(|r| &*r.port != port);
        if let Some(r) = &self.resv {
            if all_registrants(r.ty) {
                if self.regs.is_empty() {
                    self.resv = None;
                }
            } else if was_holder {
                let ty = r.ty;
                self.resv = None;
                if matches!(ty, WE_RO | EA_RO) {
                    uas.extend(self.others(port, ua::RESERVATIONS_RELEASED));
                }
            }
        }
    }

    /// Remove every registration with `key` except `port`'s own; Some(n) removed.
    fn remove_key(&mut self, port: &str, key: u64, uas: &mut Vec<PortUa>) -> usize {
        let before = self.regs.len();
        let mut kept = Vec::with_capacity(before);
        for r in self.regs.drain(..) {
            if r.key == key && &*r.port != port {
                uas.push((r.port.clone(), ua::REGISTRATIONS_PREEMPTED));
            } else {
                kept.push(r);
            }
        }
        self.regs = kept;
        before - self.regs.len()
    }

    /// PERSISTENT RESERVE OUT. Returns the unit attentions to raise.
    /// `persistent`: the LU can keep reservations through power loss, so
    /// APTPL=1 is taken (PTPL_C=1); otherwise it is refused.
    pub fn out(
        &mut self,
        port: &Arc<str>,
        sa: u8,
        scope: u8,
        ty: u8,
        param: &[u8],
        persistent: bool,
    ) -> Result<Vec<PortUa>, SenseReason> {
        if param.len() < 24 {
            return Err(SenseReason::ParamListLengthError);
        }
        let key = be64(param, 0);
        let sa_key = be64(param, 8);
        let flags = param[20];
        if flags & 0x08 != 0 {
            return Err(bad_param_bit(20, 3)); // SPEC_I_PT unsupported
        }
        if flags & 0x04 != 0 {
            return Err(bad_param_bit(20, 2)); // ALL_TG_PT: ATP_C=0
        }
        let aptpl = flags & 0x01 != 0;
        if aptpl && !persistent {
            return Err(bad_param_bit(20, 0)); // PTPL_C=0
        }
        let check_type = || {
            if scope != 0 {
                Err(bad_cdb_bit(2, 7))
            } else if !matches!(ty, WE | EA | WE_RO | EA_RO | WE_AR | EA_AR) {
                Err(bad_cdb_bit(2, 3))
            } else {
                Ok(())
            }
        };
        let mut uas = Vec::new();
        let reg_key = self.reg(port).map(|r| r.key);
        match sa {
            // REGISTER, REGISTER AND IGNORE EXISTING KEY
            0 | 6 => match reg_key {
                None => {
                    if sa == 0 && key != 0 {
                        return Err(SenseReason::ReservationConflict);
                    }
                    if sa_key != 0 {
                        if self.regs.len() >= MAX_REGISTRATIONS {
                            return Err(SenseReason::InsufficientRegistrationResources);
                        }
                        self.regs.push(Reg {
                            port: port.clone(),
                            key: sa_key,
                        });
                        self.generation = self.generation.wrapping_add(1);
                        // Only a REGISTER's APTPL counts (SPC-4: ignored elsewhere).
                        self.aptpl = aptpl;
                    }
                }
                Some(k) => {
                    if sa == 0 && key != k {
                        return Err(SenseReason::ReservationConflict);
                    }
                    if sa_key == 0 {
                        self.unregister(port, &mut uas);
                    } else if let Some(r) = self.regs.iter_mut().find(|r| r.port == *port) {
                        r.key = sa_key;
                    }
                    self.generation = self.generation.wrapping_add(1);
                    self.aptpl = aptpl;
                }
            },
            1..=5 => {
                if reg_key != Some(key) {
                    return Err(SenseReason::ReservationConflict);
                }
                match sa {
                    // RESERVE
                    1 => {
                        check_type()?;
                        match &self.resv {
                            None => {
                                self.resv = Some(Resv {
                                    holder: port.clone(),
                                    ty,
                                })
                            }
                            Some(r) if self.is_holder(port) && r.ty == ty => {}
                            Some(_) => return Err(SenseReason::ReservationConflict),
                        }
                    }
                    // RELEASE
                    2 => {
                        let Some(r) = &self.resv else { return Ok(uas) };
                        if !self.is_holder(port) {
                            return Ok(uas);
                        }
                        if scope != 0 || r.ty != ty {
                            return Err(SenseReason::InvalidReleaseOfPr);
                        }
                        self.resv = None;
                        if !matches!(ty, WE | EA) {
                            uas.extend(self.others(port, ua::RESERVATIONS_RELEASED));
                        }
                    }
                    // CLEAR
                    3 => {
                        uas.extend(self.others(port, ua::RESERVATIONS_PREEMPTED));
                        self.regs.clear();
                        self.resv = None;
                        self.generation = self.generation.wrapping_add(1);
                    }
                    // PREEMPT, PREEMPT AND ABORT (the engine aborts tasks)
                    _ => {
                        check_type()?;
                        self.preempt(port, sa_key, ty, &mut uas)?;
                        self.generation = self.generation.wrapping_add(1);
                    }
                }
            }
            _ => return Err(bad_cdb_bit(1, 4)),
        }
        Ok(uas)
    }

    fn preempt(
        &mut self,
        port: &Arc<str>,
        sa_key: u64,
        ty: u8,
        uas: &mut Vec<PortUa>,
    ) -> Result<(), SenseReason> {
        let take_over = |s: &mut Self| {
            s.resv = Some(Resv {
                holder: port.clone(),
                ty,
            })
        };
        match self.resv.as_ref().map(|r| r.ty) {
            Some(rty) if all_registrants(rty) && sa_key == 0 => {
                for r in self.regs.iter().filter(|r| r.port != *port) {
                    uas.push((r.port.clone(), ua::REGISTRATIONS_PREEMPTED));
                }
                self.regs.retain(|r| r.port == *port);
                take_over(self);
            }
            Some(rty) if !all_registrants(rty) && sa_key == self.holder_key() => {
                self.remove_key(port, sa_key, uas);
                take_over(self);
            }
            _ => {
                if sa_key == 0 {
                    return Err(bad_param(8));
                }
                if self.remove_key(port, sa_key, uas) == 0 {
                    return Err(SenseReason::ReservationConflict);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(pr: &mut PrState, port: &str, key: u64) {
        let mut param = [0u8; 24];
        param[8..16].copy_from_slice(&key.to_be_bytes());
        pr.out(&Arc::from(port), 0, 0, 0, &param, true)
            .expect("REGISTER");
    }

    fn params(key: u64, sa_key: u64, aptpl: bool) -> [u8; 24] {
        let mut p = [0u8; 24];
        p[0..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        p[20] = u8::from(aptpl);
        p
    }

    fn capabilities(pr: &PrState, persistent: bool) -> (u8, u8) {
        let mut out = Vec::new();
        pr.report_capabilities(persistent, &mut out);
        (out[2], out[3])
    }

    /// APTPL is the last effective REGISTER's bit (REGISTER AND IGNORE
    /// EXISTING KEY and unregistering included), ignored in every other
    /// service action, refused where nothing persists, and reported as
    /// PTPL_C/PTPL_A and carried in the record.
    #[test]
    fn aptpl_follows_the_last_register_and_is_refused_without_persistence() {
        let a: Arc<str> = Arc::from("iqn.a,i,0x1");
        let mut pr = PrState::default();
        assert_eq!(capabilities(&pr, true), (0x01, 0x80));
        assert_eq!(capabilities(&pr, false), (0x00, 0x80));

        let refused = pr.out(&a, 0, 0, 0, &params(0, 0xa, true), false);
        assert!(matches!(refused, Err(r) if r == bad_param_bit(20, 0)));
        assert!(!pr.active(), "a refused REGISTER changes nothing");

        pr.out(&a, 0, 0, 0, &params(0, 0xa, true), true)
            .expect("REGISTER, APTPL=1");
        assert!(pr.aptpl());
        assert_eq!(capabilities(&pr, true), (0x01, 0x81));
        assert_eq!(capabilities(&pr, false).1, 0x80);
        // RESERVE's APTPL bit is ignored, set or not.
        pr.out(&a, 1, 0, WE, &params(0xa, 0, false), true)
            .expect("RESERVE");
        assert!(pr.aptpl());
        assert!(PrState::from_kept(&pr.kept()).expect("back").aptpl());
        // A failed REGISTER (wrong key) changes nothing.
        let conflict = pr.out(&a, 0, 0, 0, &params(0xbad, 0xb, false), true);
        assert!(matches!(conflict, Err(SenseReason::ReservationConflict)));
        assert!(pr.aptpl());
        pr.out(&a, 6, 0, 0, &params(0, 0xa, false), true)
            .expect("REGISTER AND IGNORE EXISTING KEY, APTPL=0");
        assert!(!pr.aptpl());
        assert!(!pr.kept().aptpl);
        pr.out(&a, 0, 0, 0, &params(0xa, 0, true), true)
            .expect("unregister, APTPL=1");
        assert!(pr.aptpl() && !pr.active());
    }

    /// What a record carries comes back as the same state; what no LU
    /// could have made is refused whole.
    #[test]
    fn kept_reservations_round_trip_and_nonsense_is_refused() {
        let mut pr = PrState::default();
        register(&mut pr, "iqn.a,i,0x1", 0xaa);
        register(&mut pr, "iqn.b,i,0x2", 0xbb);
        let mut param = [0u8; 24];
        param[0..8].copy_from_slice(&0xaau64.to_be_bytes());
        pr.out(&Arc::from("iqn.a,i,0x1"), 1, 0, WE, &param, true)
            .expect("RESERVE");
        let kept = pr.kept();
        assert_eq!(kept.generation, 2);
        let back = PrState::from_kept(&kept).expect("taken back");
        assert_eq!(back.kept(), kept);
        assert!(back.conflicts("iqn.b,i,0x2", Access::Write));
        assert!(!back.conflicts("iqn.a,i,0x1", Access::Write));

        let broken = |f: &dyn Fn(&mut KeptReservations)| {
            let mut k = kept.clone();
            f(&mut k);
            PrState::from_kept(&k).err()
        };
        assert!(broken(&|k| k.reservation.as_mut().unwrap().kind = 2).is_some());
        assert!(
            broken(&|k| k.reservation.as_mut().unwrap().holder = "iqn.c,i,0x3".into()).is_some()
        );
        assert!(broken(&|k| k.registrations[1].port = k.registrations[0].port.clone()).is_some());
        assert!(broken(&|k| k.registrations[0].key = 0).is_some());
        assert!(broken(&|k| {
            k.registrations = (0..=MAX_REGISTRATIONS as u64)
                .map(|i| KeptRegistration {
                    port: format!("iqn.h{i},i,0x1"),
                    key: i + 1,
                })
                .collect();
            k.reservation = None;
        })
        .is_some());
        assert_eq!(broken(&|k| k.reservation = None), None);
    }
}
