//! Random writes of random sizes and alignments at queue depths 1..32 from four
//! sessions at once, read back and compared with a model: zero mismatches.

use std::sync::Arc;

use ramslog_tests::TargetProcess;
use rand::{Rng, SeedableRng};

use super::*;

const REGION_BLOCKS: u64 = 16 * 1024; // 8 MiB per session
const ROUNDS: usize = 24;

async fn hammer(s: Arc<ramslog_initiator::Session>, base: u64, seed: u64) -> usize {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut model = vec![0u8; (REGION_BLOCKS * 512) as usize];
    let mut ops = 0;
    for _ in 0..ROUNDS {
        let qd: u64 = rng.gen_range(1..=32);
        let slot = REGION_BLOCKS / qd;
        let mut batch = Vec::new();
        for i in 0..qd {
            // Each in-flight write gets its own slot, so the model stays exact.
            // Mostly small (ZIL-sized) writes, some large enough for R2T sequences.
            let max = if rng.gen_bool(0.1) { 2048 } else { 64 };
            let blocks = rng.gen_range(1..=slot.min(max));
            let lba = i * slot + rng.gen_range(0..=slot - blocks);
            let mut data = vec![0u8; (blocks * 512) as usize];
            rng.fill(&mut data[..]);
            let off = (lba * 512) as usize;
            model[off..off + data.len()].copy_from_slice(&data);
            let s = s.clone();
            let fua = rng.gen_bool(0.3);
            batch.push(tokio::spawn(async move {
                s.write(0, base + lba, &data, fua).await
            }));
        }
        for b in batch {
            b.await.expect("write task").expect("WRITE");
            ops += 1;
        }
    }
    for chunk in 0..REGION_BLOCKS / 2048 {
        let got = s
            .read(0, base + chunk * 2048, 2048, 512)
            .await
            .expect("READ");
        let off = (chunk * 2048 * 512) as usize;
        let want = &model[off..off + got.len()];
        if got != want {
            let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!("mismatch in session at base {base}: chunk {chunk}, byte {first}");
        }
    }
    ops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_sessions_random_writes_read_back() {
    let t = TargetProcess::start();
    let mut tasks = Vec::new();
    for i in 0..4u64 {
        let s = Arc::new(open(&t, &format!("{INITIATOR}-{i}")).await);
        tasks.push(tokio::spawn(hammer(s, i * REGION_BLOCKS, 1000 + i)));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("session task");
    }
    assert!(total >= 4 * ROUNDS);
}
