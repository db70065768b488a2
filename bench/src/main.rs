//! rdma-bench: latency instrument for ramslog and its peers.
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use ramslog_initiator::{LoginParams, Session, TargetUrl, DEFAULT_INITIATOR_NAME};
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "rdma-bench",
    version,
    about = "Latency instrument for ramslog and its peers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Latency of one I/O pattern against an iSCSI LUN.
    Lat(LatArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Pattern {
    /// WRITE (16), sequential LBAs.
    Write,
    /// WRITE (16) with FUA, sequential LBAs.
    Fua,
    /// WRITE (16) then SYNCHRONIZE CACHE (10), timed as a pair (the ZFS log pattern).
    Zil,
    /// READ (16), sequential LBAs.
    Read,
    /// READ (16), random LBAs.
    Randread,
}

#[derive(clap::Args)]
struct LatArgs {
    /// iscsi://host[:port]/IQN/LUN
    url: String,
    /// Bytes per I/O (a multiple of the LUN's block size).
    #[arg(long, default_value_t = 4096)]
    bs: u32,
    /// Outstanding I/Os (concurrent tasks on one session).
    #[arg(long, default_value_t = 1)]
    qd: u32,
    #[arg(long, value_enum, default_value_t = Pattern::Write)]
    pattern: Pattern,
    /// Measure for this many seconds (default 10 unless --count).
    #[arg(long, conflicts_with = "count")]
    time: Option<f64>,
    /// Measure this many I/Os.
    #[arg(long)]
    count: Option<u64>,
    /// Unrecorded warm-up, seconds.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    #[arg(long, default_value = DEFAULT_INITIATOR_NAME)]
    initiator_name: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    url: String,
    pattern: Pattern,
    bs: u32,
    qd: u32,
    ios: u64,
    secs: f64,
    iops: f64,
    mb_per_s: f64,
    lat_us: Lat,
}

#[derive(Serialize)]
struct Lat {
    min: f64,
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    p99_9: f64,
    max: f64,
}

struct Lun {
    session: Session,
    lun: u64,
    bs: u32,
    blocks_per_io: u32,
    slots: u64,
    pattern: Pattern,
    payload: Vec<u8>,
    next_slot: AtomicU64,
}

impl Lun {
    async fn one(&self, rng: &mut impl Rng) -> Result<()> {
        let slot = match self.pattern {
            Pattern::Randread => rng.gen_range(0..self.slots),
            _ => self.next_slot.fetch_add(1, Ordering::Relaxed) % self.slots,
        };
        let lba = slot * u64::from(self.blocks_per_io);
        let s = &self.session;
        match self.pattern {
            Pattern::Write => s.write(self.lun, lba, &self.payload, false).await?,
            Pattern::Fua => s.write(self.lun, lba, &self.payload, true).await?,
            Pattern::Zil => {
                s.write(self.lun, lba, &self.payload, false).await?;
                s.sync_cache(self.lun).await?;
            }
            Pattern::Read | Pattern::Randread => {
                s.read(self.lun, lba, self.blocks_per_io, self.bs).await?;
            }
        }
        Ok(())
    }
}

fn new_hist() -> Result<Histogram<u64>> {
    // ns, 1 ns .. 100 s, 3 significant digits.
    Ok(Histogram::new_with_bounds(1, 100_000_000_000, 3)?)
}

/// Run `qd` workers until `deadline` or until `budget` I/Os are claimed.
async fn run(
    lun: &Arc<Lun>,
    qd: u32,
    deadline: Option<Instant>,
    budget: Option<u64>,
) -> Result<(Histogram<u64>, u64, Duration)> {
    let remaining = Arc::new(AtomicU64::new(budget.unwrap_or(u64::MAX)));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..qd {
        let lun = lun.clone();
        let remaining = remaining.clone();
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut h = new_hist()?;
            let mut rng = rand::rngs::StdRng::from_entropy();
            loop {
                if stop.load(Ordering::Relaxed) || deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                if remaining
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                    .is_err()
                {
                    break;
                }
                let t = Instant::now();
                if let Err(e) = lun.one(&mut rng).await {
                    stop.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                h.saturating_record(t.elapsed().as_nanos().max(1) as u64);
            }
            Ok::<_, anyhow::Error>(h)
        }));
    }
    let mut total = new_hist()?;
    let mut first_err = None;
    for w in workers {
        match w.await.context("worker panicked")? {
            Ok(h) => total.add(&h)?,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let elapsed = start.elapsed();
    if let Some(e) = first_err {
        return Err(e);
    }
    let n = total.len();
    Ok((total, n, elapsed))
}

async fn lat(a: LatArgs) -> Result<()> {
    let url = TargetUrl::parse(&a.url)?;
    url.require_tcp()?;
    if a.qd == 0 {
        bail!("--qd must be at least 1");
    }
    let addr = url.socket_addr().await?;
    let mut params = LoginParams::normal(a.initiator_name.clone(), url.target_name.clone());
    if let Some((user, secret)) = &url.chap {
        params.chap = Some(ramslog_initiator::ChapParams {
            initiator: ramslog_initiator::Credentials {
                name: user.clone(),
                secret: secret.clone().into_bytes(),
            },
            mutual: None,
        });
    }
    let session = Session::login(addr, params)
        .await
        .with_context(|| format!("login to {url}"))?;
    // A new I_T nexus starts with a unit attention (power on / reset): clear it.
    for _ in 0..8 {
        let r = session
            .test_unit_ready(url.lun)
            .await
            .context("TEST UNIT READY")?;
        match r.sense {
            Some(s) if r.status == 0x02 && s.key == 0x06 => continue,
            _ => break,
        }
    }
    let (last_lba, block) = session
        .read_capacity16(url.lun)
        .await
        .context("READ CAPACITY (16)")?;
    if a.bs == 0 || a.bs % block != 0 {
        bail!(
            "--bs {} is not a multiple of the LUN's {block}-byte blocks",
            a.bs
        );
    }
    let blocks_per_io = a.bs / block;
    let slots = (last_lba + 1) / u64::from(blocks_per_io);
    if slots == 0 {
        bail!("LUN smaller than one I/O");
    }
    let mut payload = vec![0u8; a.bs as usize];
    rand::thread_rng().fill(&mut payload[..]);
    let lun = Arc::new(Lun {
        session,
        lun: url.lun,
        bs: block,
        blocks_per_io,
        slots,
        pattern: a.pattern,
        payload,
        next_slot: AtomicU64::new(0),
    });

    if a.warmup > 0.0 {
        let d = Instant::now() + Duration::from_secs_f64(a.warmup);
        run(&lun, a.qd, Some(d), None).await.context("warm-up")?;
    }
    let (deadline, budget) = match (a.time, a.count) {
        (_, Some(n)) => (None, Some(n)),
        (t, None) => (
            Some(Instant::now() + Duration::from_secs_f64(t.unwrap_or(10.0))),
            None,
        ),
    };
    let (h, ios, elapsed) = run(&lun, a.qd, deadline, budget).await?;
    let secs = elapsed.as_secs_f64();
    let us = |ns: u64| ns as f64 / 1000.0;
    let report = Report {
        url: url.to_string(),
        pattern: a.pattern,
        bs: a.bs,
        qd: a.qd,
        ios,
        secs,
        iops: ios as f64 / secs,
        mb_per_s: ios as f64 * f64::from(a.bs) / secs / 1e6,
        lat_us: Lat {
            min: us(h.min()),
            mean: h.mean() / 1000.0,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p99_9: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        },
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if let Ok(lun) = Arc::try_unwrap(lun) {
        let _ = lun.session.logout().await;
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "{} pattern={:?} bs={} qd={}: {} I/Os in {:.2} s",
        r.url, r.pattern, r.bs, r.qd, r.ios, r.secs
    );
    println!(
        "{:>10} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "IOPS", "MB/s", "min µs", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs"
    );
    let l = &r.lat_us;
    println!(
        "{:>10.0} {:>9.1} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
        r.iops, r.mb_per_s, l.min, l.p50, l.p90, l.p99, l.p99_9, l.max
    );
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.cmd {
            Cmd::Lat(a) => lat(a).await,
        }
    })
}
