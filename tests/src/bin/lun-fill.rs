//! lun-fill: write a deterministic pattern over a whole LUN over iSCSI/TCP,
//! or check that it is there. For benchmarks and drills that need a full
//! LUN (the dump and restore benchmark, the lab's restart cases).
//!
//!   lun-fill --target ADDR:PORT --iqn IQN [--lun N] [--seed N] [--check]
//!
//! 1 MiB writes, 16 in flight. Prints bytes and MiB/s; with --check, reads
//! back and exits 1 at the first chunk that differs.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use ramslog_initiator::{LoginParams, Session};
use rand::{RngCore, SeedableRng};

const USAGE: &str = "usage: lun-fill --target ADDR:PORT --iqn IQN [--lun N] [--seed N] [--check]";
const CHUNK: u64 = 1 << 20;
const IN_FLIGHT: u64 = 16;

fn chunk_pattern(seed: u64, chunk: u64) -> Vec<u8> {
    let mut rng =
        rand::rngs::StdRng::seed_from_u64(seed ^ chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut v = vec![0u8; CHUNK as usize];
    rng.fill_bytes(&mut v);
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let mut target: Option<SocketAddr> = None;
    let (mut iqn, mut lun, mut seed, mut check) = (None, 0u64, 1u64, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| format!("{what} needs a value"));
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--target" => {
                    target = Some(
                        value("--target")?
                            .parse()
                            .map_err(|e| format!("--target: {e}"))?,
                    )
                }
                "--iqn" => iqn = Some(value("--iqn")?),
                "--lun" => lun = value("--lun")?.parse().map_err(|e| format!("--lun: {e}"))?,
                "--seed" => {
                    seed = value("--seed")?
                        .parse()
                        .map_err(|e| format!("--seed: {e}"))?
                }
                "--check" => check = true,
                other => return Err(format!("unknown argument {other}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            eprintln!("lun-fill: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let (Some(target), Some(iqn)) = (target, iqn) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match run(target, &iqn, lun, seed, check).await {
        Ok(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lun-fill: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    target: SocketAddr,
    iqn: &str,
    lun: u64,
    seed: u64,
    check: bool,
) -> Result<String, String> {
    let s = Session::login(
        target,
        LoginParams::normal("iqn.2026-11.org.ramslog:lun-fill", iqn),
    )
    .await
    .map_err(|e| format!("login to {target}: {e}"))?;
    // The power-on unit attention, then whatever else is pending.
    for _ in 0..8 {
        let r = s.test_unit_ready(lun).await.map_err(|e| e.to_string())?;
        if r.is_good() {
            break;
        }
    }
    let (last_lba, bs) = s.read_capacity16(lun).await.map_err(|e| e.to_string())?;
    let size = (last_lba + 1) * u64::from(bs);
    let chunks = size / CHUNK;
    let s = Arc::new(s);
    let started = Instant::now();
    let mut lanes = Vec::new();
    for lane in 0..IN_FLIGHT {
        let s = s.clone();
        lanes.push(tokio::spawn(async move {
            let mut c = lane;
            while c < chunks {
                let lba = c * CHUNK / u64::from(bs);
                let want = chunk_pattern(seed, c);
                if check {
                    let got = s
                        .read(lun, lba, (CHUNK / u64::from(bs)) as u32, bs)
                        .await
                        .map_err(|e| format!("READ chunk {c}: {e}"))?;
                    if got != want {
                        return Err(format!("chunk {c} (byte {}) differs", c * CHUNK));
                    }
                } else {
                    s.write(lun, lba, &want, false)
                        .await
                        .map_err(|e| format!("WRITE chunk {c}: {e}"))?;
                }
                c += IN_FLIGHT;
            }
            Ok::<(), String>(())
        }));
    }
    for l in lanes {
        l.await.map_err(|e| e.to_string())??;
    }
    let secs = started.elapsed().as_secs_f64();
    let bytes = chunks * CHUNK;
    Ok(format!(
        "{} {bytes} bytes in {secs:.2} s ({:.0} MiB/s)",
        if check { "checked" } else { "wrote" },
        bytes as f64 / secs / (1 << 20) as f64
    ))
}
