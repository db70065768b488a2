//! End-to-end tests: the real `ramslog-target` binary on 127.0.0.1, driven by
//! ramslog-initiator. One test binary, one module per area.

mod generations;
mod identity;
mod images;
mod integrity;
mod metrics;
mod persistence;
mod sessions;
mod startup;
mod systemd;

use std::time::Duration;

use ramslog_common::scsi_wire::{sense_key, Sense};
use ramslog_initiator::{LoginParams, ScsiResult, Session};
use ramslog_tests::TargetProcess;

pub const INITIATOR: &str = "iqn.2026-11.org.ramslog:e2e-initiator";

/// Log in and consume the power-on unit attention, as real initiators do.
pub async fn open(t: &TargetProcess, initiator: &str) -> Session {
    let s = Session::login(t.addr(), LoginParams::normal(initiator, t.target_name()))
        .await
        .unwrap_or_else(|e| panic!("login to {}: {e}", t.addr()));
    clear_unit_attentions(&s).await;
    s
}

pub async fn clear_unit_attentions(s: &Session) {
    for _ in 0..8 {
        let r = s.test_unit_ready(0).await.expect("TEST UNIT READY");
        if r.sense.is_none_or(|x| x.key != sense_key::UNIT_ATTENTION) {
            return;
        }
    }
    panic!("unit attentions never cleared");
}

pub fn sense(r: &ScsiResult) -> (u8, u8, u8) {
    let s: Sense = r
        .sense
        .unwrap_or_else(|| panic!("expected sense, got status {:#x}", r.status));
    (s.key, s.asc, s.ascq)
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random::<u8>()).collect()
}

/// Run a `ramslog-target` subcommand against the daemon of `state_dir`.
pub fn cli(args: &[&str], state_dir: &std::path::Path) -> std::process::Output {
    std::process::Command::new(ramslog_tests::target_binary())
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        .output()
        .expect("run ramslog-target subcommand")
}

pub const SHORT: Duration = Duration::from_millis(500);
