//! One logged-in session per target, and the workloads run on it: the same
//! workload over iSCSI/TCP (the async pipelined `Session`) or iSER (the
//! blocking `IserSession`, registered buffers reused for every I/O).

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use ramslog_initiator::cdb;
use ramslog_initiator::iser::{IserOptions, IserProfile, IserSession, Tag};
use ramslog_initiator::{Session, TargetUrl, Transport};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::report::{new_hist, record, Sample};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// WRITE (16), sequential LBAs.
    Write,
    /// WRITE (16) with FUA, sequential LBAs.
    Fua,
    /// WRITE (16) then SYNCHRONIZE CACHE (10), timed as a pair (what ZFS sends).
    Zil,
    /// READ (16), sequential LBAs.
    Read,
    /// READ (16), random LBAs.
    Randread,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Workload {
    pub pattern: Pattern,
    pub bs: u32,
    pub qd: u32,
}

/// When a measurement ends.
#[derive(Clone, Copy, Debug)]
pub enum Until {
    Time(Duration),
    Count(u64),
}

/// A progress line on stderr for runs longer than two seconds.
pub struct Progress {
    label: String,
    expected: Option<Duration>,
    enabled: bool,
}

impl Progress {
    pub fn new(label: impl Into<String>, until: Until, quiet: bool) -> Progress {
        let expected = match until {
            Until::Time(d) => Some(d),
            Until::Count(_) => None,
        };
        Progress {
            label: label.into(),
            expected,
            enabled: !quiet && expected.is_none_or(|d| d > Duration::from_secs(2)),
        }
    }

    fn show(&self, elapsed: Duration, ios: u64) {
        if !self.enabled || elapsed < Duration::from_secs(2) {
            return;
        }
        let of = self
            .expected
            .map(|d| format!("/{:.0}", d.as_secs_f64()))
            .unwrap_or_default();
        let iops = ios as f64 / elapsed.as_secs_f64().max(1e-9);
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r{}: {:.0}{of} s, {ios} I/Os, {iops:.0} IOPS   ",
            self.label,
            elapsed.as_secs_f64()
        );
        let _ = e.flush();
    }

    fn done(&self, elapsed: Duration) {
        if self.enabled && elapsed >= Duration::from_secs(2) {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r{}\r", " ".repeat(self.label.len() + 48));
            let _ = e.flush();
        }
    }
}

/// What JSON reports record about a target and its session.
#[derive(Clone, Debug, Serialize)]
pub struct TargetInfo {
    pub url: String,
    pub transport: &'static str,
    /// The LUN's INQUIRY vendor, product and revision.
    pub product: String,
    pub block_size: u32,
    pub blocks: u64,
    /// Every key=value the target answered at login.
    pub negotiated: Vec<(String, String)>,
}

/// A logged-in session running one workload.
pub trait Runner {
    fn info(&self) -> &TargetInfo;
    fn run(&mut self, until: Until, progress: &Progress) -> Result<Sample>;
    /// Read `out.len()` bytes (whole blocks) from `lba`.
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<()>;
    fn close(self: Box<Self>);
}

/// How the initiator connects.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub initiator_name: String,
    /// iSER: empty completion-queue polls before sleeping (0 on SoftRoCE).
    pub spin: u32,
}

/// "VENDOR PRODUCT REV" from standard INQUIRY data.
fn product_of(inq: &[u8]) -> String {
    let field = |r: std::ops::Range<usize>| {
        inq.get(r)
            .map(|b| String::from_utf8_lossy(b).trim().to_string())
            .unwrap_or_default()
    };
    format!("{} {} {}", field(8..16), field(16..32), field(32..36))
        .trim()
        .to_string()
}

/// Log in to `url` and prepare `w` (unit attention cleared, geometry read).
pub fn connect(url: &TargetUrl, w: Workload, o: &ConnectOptions) -> Result<Box<dyn Runner>> {
    if w.qd == 0 {
        bail!("--qd must be at least 1");
    }
    if w.bs == 0 {
        bail!("--bs must be at least one block");
    }
    match url.transport {
        Transport::Tcp => Ok(Box::new(TcpRunner::connect(url, w, &o.initiator_name)?)),
        Transport::Iser => Ok(Box::new(IserRunner::connect(url, w, o)?)),
    }
}

/// Blocks per I/O and the number of I/O-sized slots on the LUN.
fn geometry(w: Workload, last_lba: u64, block: u32) -> Result<(u32, u64)> {
    if block == 0 || !w.bs.is_multiple_of(block) {
        bail!(
            "--bs {} is not a multiple of the LUN's {block}-byte blocks",
            w.bs
        );
    }
    let blocks_per_io = w.bs / block;
    let slots = (last_lba + 1) / u64::from(blocks_per_io);
    if slots == 0 {
        bail!("the LUN is smaller than one {}-byte I/O", w.bs);
    }
    Ok((blocks_per_io, slots))
}

/// CHECK CONDITION with UNIT ATTENTION: what every new session's first
/// commands get (power on, reset, inquiry data changed) until they are read.
fn is_unit_attention(status: u8, sense_key: Option<u8>) -> bool {
    status == ramslog_common::scsi_wire::status::CHECK_CONDITION
        && sense_key == Some(ramslog_common::scsi_wire::sense_key::UNIT_ATTENTION)
}

fn random_payload(len: u32) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    rand::thread_rng().fill(&mut v[..]);
    v
}

// ---------------------------------------------------------------- TCP

struct TcpLun {
    session: Session,
    lun: u64,
    block: u32,
    blocks_per_io: u32,
    slots: u64,
    w: Workload,
    payload: Vec<u8>,
    next_slot: AtomicU64,
}

impl TcpLun {
    async fn one(&self, rng: &mut impl Rng) -> Result<()> {
        let slot = match self.w.pattern {
            Pattern::Randread => rng.gen_range(0..self.slots),
            _ => self.next_slot.fetch_add(1, Ordering::Relaxed) % self.slots,
        };
        let lba = slot * u64::from(self.blocks_per_io);
        let s = &self.session;
        match self.w.pattern {
            Pattern::Write => s.write(self.lun, lba, &self.payload, false).await?,
            Pattern::Fua => s.write(self.lun, lba, &self.payload, true).await?,
            Pattern::Zil => {
                s.write(self.lun, lba, &self.payload, false).await?;
                s.sync_cache(self.lun).await?;
            }
            Pattern::Read | Pattern::Randread => {
                s.read(self.lun, lba, self.blocks_per_io, self.block)
                    .await?;
            }
        }
        Ok(())
    }
}

struct TcpRunner {
    rt: tokio::runtime::Runtime,
    lun: Arc<TcpLun>,
    info: TargetInfo,
}

impl TcpRunner {
    fn connect(url: &TargetUrl, w: Workload, initiator_name: &str) -> Result<TcpRunner> {
        // One thread: the session's reader and the workers never wait for a
        // wake-up from another CPU.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let params = url.login_params(initiator_name);
        let lun = rt.block_on(async {
            let addr = url.socket_addr().await?;
            let session = Session::login(addr, params)
                .await
                .with_context(|| format!("login to {url}"))?;
            // A new I_T nexus starts with a unit attention: clear it.
            for _ in 0..8 {
                let r = session
                    .test_unit_ready(url.lun)
                    .await
                    .context("TEST UNIT READY")?;
                if !is_unit_attention(r.status, r.sense.map(|s| s.key)) {
                    break;
                }
            }
            let (last_lba, block) = session
                .read_capacity16(url.lun)
                .await
                .context("READ CAPACITY (16)")?;
            let (blocks_per_io, slots) = geometry(w, last_lba, block)?;
            let inq = session
                .inquiry(url.lun, false, 0, 96)
                .await
                .context("INQUIRY")?;
            anyhow::Ok((
                inq,
                TcpLun {
                    session,
                    lun: url.lun,
                    block,
                    blocks_per_io,
                    slots,
                    w,
                    payload: random_payload(w.bs),
                    next_slot: AtomicU64::new(0),
                },
            ))
        })?;
        let (inq, lun) = lun;
        let info = TargetInfo {
            url: url.to_string(),
            transport: "iscsi/tcp",
            product: product_of(&inq),
            block_size: lun.block,
            blocks: lun.slots * u64::from(lun.blocks_per_io),
            negotiated: lun.session.negotiated().target_keys.clone(),
        };
        Ok(TcpRunner {
            rt,
            lun: Arc::new(lun),
            info,
        })
    }
}

impl Runner for TcpRunner {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn run(&mut self, until: Until, progress: &Progress) -> Result<Sample> {
        let lun = self.lun.clone();
        self.rt.block_on(run_tcp(lun, until, progress))
    }

    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<()> {
        let l = &self.lun;
        let blocks = u32::try_from(out.len() / l.block as usize)?;
        let data = self
            .rt
            .block_on(l.session.read(l.lun, lba, blocks, l.block))?;
        let n = data.len().min(out.len());
        out[..n].copy_from_slice(&data[..n]);
        Ok(())
    }

    fn close(self: Box<Self>) {
        let TcpRunner { rt, lun, .. } = *self;
        if let Ok(lun) = Arc::try_unwrap(lun) {
            let _ = rt.block_on(lun.session.logout());
        }
    }
}

/// `qd` workers on one session until the time or count is used up.
async fn run_tcp(lun: Arc<TcpLun>, until: Until, progress: &Progress) -> Result<Sample> {
    let (deadline, budget) = match until {
        Until::Time(d) => (Some(Instant::now() + d), u64::MAX),
        Until::Count(n) => (None, n),
    };
    let remaining = Arc::new(AtomicU64::new(budget));
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..lun.w.qd {
        let (lun, remaining, stop, done) =
            (lun.clone(), remaining.clone(), stop.clone(), done.clone());
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
                record(&mut h, t.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(h)
        }));
    }
    let ticker = {
        let (done, stop) = (done.clone(), stop.clone());
        async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                progress.show(start.elapsed(), done.load(Ordering::Relaxed));
            }
        }
    };
    let collect = async {
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
        stop.store(true, Ordering::Relaxed);
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    };
    let total = tokio::select! {
        t = collect => t?,
        _ = ticker => unreachable!("the ticker only ends after the workers"),
    };
    let elapsed = start.elapsed();
    progress.done(elapsed);
    Ok(Sample {
        ios: total.len(),
        hist: total,
        secs: elapsed.as_secs_f64(),
    })
}

// ---------------------------------------------------------------- iSER

/// One of the `qd` logical workers of the iSER loop.
#[derive(Clone, Copy)]
enum Slot {
    Idle,
    /// A command in flight since `start`; for `zil`, `then_sync` marks the
    /// WRITE whose SYNCHRONIZE CACHE follows.
    Busy {
        tag: Tag,
        start: Instant,
        then_sync: bool,
    },
}

struct IserRunner {
    session: IserSession,
    lun: u64,
    blocks_per_io: u32,
    slots_on_lun: u64,
    w: Workload,
    payload: Vec<u8>,
    next: u64,
    rng: rand::rngs::StdRng,
    info: TargetInfo,
}

impl IserRunner {
    fn connect(url: &TargetUrl, w: Workload, o: &ConnectOptions) -> Result<IserRunner> {
        let mut opts = IserOptions::new(IserProfile::Linux);
        opts.queue_depth = w.qd as usize;
        opts.max_transfer = (w.bs as usize).max(4096);
        opts.spin = o.spin;
        // The benchmark is never idle long enough to need pings of its own.
        opts.idle_ping = None;
        let mut session = IserSession::connect_url(url, &o.initiator_name, &opts)
            .with_context(|| format!("login to {url}"))?;
        // A new I_T nexus starts with a unit attention: clear it.
        for _ in 0..8 {
            let r = session
                .test_unit_ready(url.lun)
                .context("TEST UNIT READY")?;
            if !is_unit_attention(r.status, r.sense.map(|s| s.key)) {
                break;
            }
        }
        let (last_lba, block) = session
            .read_capacity16(url.lun)
            .context("READ CAPACITY (16)")?;
        let (blocks_per_io, slots_on_lun) = geometry(w, last_lba, block)?;
        let inq = session.inquiry(url.lun, false, 0, 96).context("INQUIRY")?;
        let info = TargetInfo {
            url: url.to_string(),
            transport: "iser",
            product: product_of(&inq),
            block_size: block,
            blocks: slots_on_lun * u64::from(blocks_per_io),
            negotiated: session.negotiated().target_keys.clone(),
        };
        Ok(IserRunner {
            session,
            lun: url.lun,
            blocks_per_io,
            slots_on_lun,
            w,
            payload: random_payload(w.bs),
            next: 0,
            rng: rand::rngs::StdRng::from_entropy(),
            info,
        })
    }

    fn submit_io(&mut self) -> Result<Tag> {
        let slot = match self.w.pattern {
            Pattern::Randread => self.rng.gen_range(0..self.slots_on_lun),
            _ => {
                self.next = (self.next + 1) % self.slots_on_lun;
                self.next
            }
        };
        let lba = slot * u64::from(self.blocks_per_io);
        let tag = match self.w.pattern {
            Pattern::Write | Pattern::Fua | Pattern::Zil => {
                let c = cdb::write16(lba, self.blocks_per_io, self.w.pattern == Pattern::Fua);
                self.session.submit(self.lun, &c, &self.payload, 0)?
            }
            Pattern::Read | Pattern::Randread => {
                let c = cdb::read16(lba, self.blocks_per_io);
                self.session.submit(self.lun, &c, &[], self.w.bs)?
            }
        };
        Ok(tag)
    }
}

impl Runner for IserRunner {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn run(&mut self, until: Until, progress: &Progress) -> Result<Sample> {
        let (deadline, mut budget) = match until {
            Until::Time(d) => (Some(Instant::now() + d), u64::MAX),
            Until::Count(n) => (None, n),
        };
        let mut hist = new_hist()?;
        let mut slots = vec![Slot::Idle; self.w.qd as usize];
        let start = Instant::now();
        let mut last_show = start;
        let mut in_flight = 0usize;
        loop {
            let now = Instant::now();
            let stopping = budget == 0 || deadline.is_some_and(|d| now >= d);
            if !stopping {
                for slot in slots.iter_mut() {
                    if matches!(slot, Slot::Idle) && budget > 0 {
                        budget -= 1;
                        // Before submitting: submit may wait for a send slot
                        // and reap completions meanwhile.
                        let start = Instant::now();
                        let tag = self.submit_io()?;
                        *slot = Slot::Busy {
                            tag,
                            start,
                            then_sync: self.w.pattern == Pattern::Zil,
                        };
                        in_flight += 1;
                    }
                }
            }
            if in_flight == 0 {
                break;
            }
            let c = self.session.wait()?;
            let status = c.result?;
            status.check()?;
            let Some(i) = slots
                .iter()
                .position(|s| matches!(s, Slot::Busy { tag, .. } if *tag == c.tag))
            else {
                bail!("completion for a command this run did not send");
            };
            let Slot::Busy {
                start: t0,
                then_sync,
                ..
            } = slots[i]
            else {
                continue;
            };
            if then_sync {
                let tag = self
                    .session
                    .submit(self.lun, &cdb::sync_cache10(), &[], 0)?;
                slots[i] = Slot::Busy {
                    tag,
                    start: t0,
                    then_sync: false,
                };
                continue;
            }
            record(&mut hist, t0.elapsed());
            slots[i] = Slot::Idle;
            in_flight -= 1;
            if hist.len() % 256 == 0 && last_show.elapsed() > Duration::from_millis(500) {
                last_show = Instant::now();
                progress.show(start.elapsed(), hist.len());
            }
        }
        let elapsed = start.elapsed();
        progress.done(elapsed);
        Ok(Sample {
            ios: hist.len(),
            hist,
            secs: elapsed.as_secs_f64(),
        })
    }

    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<()> {
        // In pieces of the I/O size the session registered buffers for.
        let block = self.info.block_size as usize;
        let piece = (self.w.bs as usize).max(4096) / block * block;
        for (i, chunk) in out.chunks_mut(piece.max(block)).enumerate() {
            let at = lba + (i * piece.max(block) / block) as u64;
            self.session.read16(self.lun, at, chunk)?;
        }
        Ok(())
    }

    fn close(self: Box<Self>) {
        let _ = self.session.logout();
    }
}
