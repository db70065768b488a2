//! Floods: a client that sends and never reads.

use std::time::Duration;

use ramslog_tests::{TargetOptions, TargetProcess};

use super::memory::{record, RssSampler};
use super::*;

const LUN: &str = "256M";
const LUN_BYTES: u64 = 256 << 20;

/// 120 READs of 16 MiB sent back to back without reading a byte of the
/// answers: the target must stream its Data-In with back-pressure, not
/// build ~2 GiB of output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_reads_without_reading_stay_bounded() {
    let t = TargetProcess::start_with(TargetOptions {
        size: LUN.into(),
        ..Default::default()
    });
    let by = Bystander::new(&t, 500_000).await;
    let sampler = RssSampler::start(t.pid());
    let mut c = raw_login(&t, |_| {}).await;
    for i in 0..120u32 {
        let b = scsi_cmd(&mut c, &read10((i % 16) * 32768, 32768), 0xc1, 16 << 20);
        c.send_pdu(&b, &[], &[]).await.expect("send READ");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let above = record("pipelined-reads", 1, sampler.peak(), LUN_BYTES);
    assert!(
        above < PER_CONNECTION_LIMIT,
        "defect 4: {} MiB above the LUN for one connection",
        above >> 20
    );
    drop(c);
    by.still_fine().await;
    let above = record("pipelined-reads-end", 1, sampler.finish(), LUN_BYTES);
    assert!(above < PER_CONNECTION_LIMIT, "defect 4: after close");
}
