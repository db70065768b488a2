//! A connection's way in: its login PDUs, a refused or answered login, a
//! reinstatement waiting for the old connections, and full feature phase.

use std::time::Instant;

use ramslog_common::iscsi::{login_status, Bhs, LoginResponse, Opcode};

use crate::admission::LoggedIn;
use crate::metrics::LoginRefusal;

use super::login::Next;
use super::output::Queued;
use super::session::Session;
use super::timers::Timer;
use super::{
    Action, Connection, Event, LoginFailure, OutData, OutPdu, Phase, Reinstating, SessionKind,
    REINSTATEMENT_RECHECK, REINSTATEMENT_WAIT,
};

impl Connection {
    /// A reinstating login: answer it once every old connection is gone,
    /// refuse it with Service Unavailable when they take too long.
    pub(super) fn reinstatement_check(&mut self, now: Instant) {
        let Phase::Reinstating(r) = &self.phase else {
            return;
        };
        if r.old.iter().all(|c| c.is_released()) {
            let Phase::Reinstating(r) = std::mem::replace(&mut self.phase, Phase::Closed) else {
                return;
            };
            let r = *r;
            self.enter_full_feature(now, r.session, r.rsp, r.text);
        } else if now >= r.give_up {
            let rsp = r.rsp;
            tracing::warn!(
                peer = %self.info.peer,
                "the reinstated session's connection did not end within {REINSTATEMENT_WAIT:?}: \
                 refusing the new login with Service Unavailable"
            );
            self.refuse_login(rsp, login_status::SERVICE_UNAVAILABLE);
        } else {
            self.timers
                .set(Timer::Reinstatement, now + REINSTATEMENT_RECHECK);
        }
    }

    pub(super) fn enter_full_feature(
        &mut self,
        now: Instant,
        session: Session,
        rsp: Bhs,
        text: Vec<u8>,
    ) {
        match session.kind() {
            SessionKind::Discovery => self.timers.set(
                Timer::DiscoveryIdle,
                now + self.portal.limits.discovery_lifetime,
            ),
            SessionKind::Normal => self.events.push_back(Event::NormalSession {
                iser_peer: session.params.iser_peer(),
                transfers: session.transfers().clone(),
            }),
        }
        self.push_login_response(rsp, text);
        self.rx_header_digest = session.params.header_digest;
        self.rx_data_digest = session.params.data_digest;
        self.phase = Phase::FullFeature(Box::new(session));
        self.timers.clear(Timer::Login);
        self.timers
            .set(Timer::NopInterval, now + self.portal.limits.nop_interval);
    }

    pub(super) fn login_pdu(&mut self, now: Instant, bhs: &Bhs, data: &[u8]) {
        let Phase::Login(login) = &mut self.phase else {
            return;
        };
        if bhs.opcode() != Some(Opcode::LoginRequest) {
            // RFC 7143 6.1: only Login Requests are allowed before full feature phase.
            tracing::info!(peer = %self.info.peer, "non-login PDU {:#04x} during login; closing", bhs.raw_opcode());
            self.fail_close();
            return;
        }
        let cmdsn = *self.login_cmdsn.get_or_insert(bhs.cmdsn());
        if self.statsn == 0 {
            self.statsn = bhs.exp_statsn();
        }
        let reply = login.handle(&self.portal, bhs, data);
        let mut rsp = Bhs::login_response(LoginResponse {
            flags: reply.flags,
            isid: bhs.isid(),
            tsih: 0,
            itt: bhs.itt(),
            status: reply.status,
        });
        rsp.set_statsn(self.statsn);
        self.statsn = self.statsn.wrapping_add(1);
        rsp.set_exp_cmdsn(cmdsn);
        rsp.set_max_cmdsn(cmdsn.wrapping_add(self.portal.limits.cmd_window.saturating_sub(1)));
        rsp.set_data_segment_len(reply.text.len() as u32);

        match reply.next {
            Next::Continue => self.push_login_response(rsp, reply.text),
            Next::Fail(_) => {
                self.portal
                    .core
                    .counters
                    .login_refused(LoginRefusal::of_status(reply.status));
                tracing::info!(
                    peer = %self.info.peer,
                    initiator = login.initiator_name.as_deref().unwrap_or("?"),
                    "login failed with status {:#06x}",
                    reply.status
                );
                self.push_login_response(rsp, reply.text);
                self.fail_close();
            }
            Next::FullFeature => {
                let Phase::Login(login) = std::mem::replace(&mut self.phase, Phase::Closed) else {
                    return;
                };
                // Its pool first: a login the pools have no room for must
                // not reinstate (end) the session it names.
                let pool = match login.kind {
                    SessionKind::Discovery => LoggedIn::Discovery,
                    SessionKind::Normal => LoggedIn::Admitted,
                };
                if let Err(why) = self.portal.core.gate.logged_in(&self.control, pool) {
                    self.portal.core.gate.log_refusal(self.info.peer, why);
                    self.refuse_login(rsp, LoginFailure::OutOfResources.status());
                    return;
                }
                let (session, replaced) = match Session::start(
                    &self.portal,
                    *login,
                    self.info,
                    self.control.clone(),
                    cmdsn,
                ) {
                    Ok(started) => started,
                    Err(e) => {
                        tracing::warn!(peer = %self.info.peer, "login refused: {e}");
                        self.refuse_login(rsp, LoginFailure::OutOfResources.status());
                        return;
                    }
                };
                rsp.set_tsih(session.tsih);
                let old: Vec<_> = replaced.into_iter().filter(|c| !c.is_released()).collect();
                if old.is_empty() {
                    self.enter_full_feature(now, session, rsp, reply.text);
                } else {
                    tracing::info!(
                        peer = %self.info.peer,
                        "login reinstates a session: answering once its connection is gone"
                    );
                    self.phase = Phase::Reinstating(Box::new(Reinstating {
                        session,
                        rsp,
                        text: reply.text,
                        old,
                        give_up: now + REINSTATEMENT_WAIT,
                    }));
                    self.timers
                        .set(Timer::Reinstatement, now + REINSTATEMENT_RECHECK);
                }
            }
        }
    }

    /// A login that passed its checks but finds no room (pools, sessions,
    /// a reinstatement that never completed): counted as out of resources,
    /// answered with `status`, and the connection ends.
    pub(super) fn refuse_login(&mut self, mut rsp: Bhs, status: u16) {
        self.portal
            .core
            .counters
            .login_refused(LoginRefusal::OutOfResources);
        rsp.fail_login(status);
        self.push_login_response(rsp, Vec::new());
        self.fail_close();
    }

    pub(super) fn push_login_response(&mut self, rsp: Bhs, text: Vec<u8>) {
        let data = OutData::bytes(text);
        self.actions.push_back(Queued::Action(Action::Send(OutPdu {
            bhs: rsp,
            data,
            header_digest: false,
            data_digest: false,
            served: None,
        })));
    }
}
