//! iser-initiator-check: drive a target over iSER the way the Linux or the
//! illumos initiator does, and check what it answers.
//!
//!   iser-initiator-check --profile illumos|linux --target ADDR:PORT --iqn IQN
//!       [--seconds N] [--initiator-name IQN] [--lun N] [--seed N]
//!       [--target-nop-interval S] [--flood-pings N]
//!
//! Connects with the profile's CM private data and logs in; checks the
//! negotiated keys (illumos: ImmediateData=No, InitialR2T=Yes,
//! MaxRecvDataSegmentLength <= 8192, MaxOutstandingR2T=1; Linux:
//! RDMAExtensions=Yes and a TargetRecvDataSegmentLength); runs WRITE (16) /
//! SYNCHRONIZE CACHE / READ (16) with a byte-for-byte compare over transfer
//! sizes from 512 B to 256 KiB at random LBAs with random data, for N
//! seconds, then a pipelined window; checks that after warm-up the I/O path
//! allocates nothing (a counting global allocator); stays idle for more than
//! 5 s, which makes the session send its idle NOP-Out ping as illumos does;
//! with --target-nop-interval S, stays idle S+3 s more without pinging, so
//! the target pings and the session answers; pings once more by hand; checks
//! SendTargets over an iSER discovery session; logs out. Prints
//! `ISER <PROFILE> CHECK PASSED` and exits 0, or says what failed and exits 1.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ramslog_common::iser::peer;
use ramslog_common::scsi_wire::sense_key;
use ramslog_initiator::iser::{self, IserOptions, IserProfile, IserSession, Tag};
use ramslog_initiator::{cdb, LoginParams};
use ramslog_tests::counting_alloc::CountingAllocator;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const USAGE: &str =
    "usage: iser-initiator-check --profile illumos|linux --target ADDR:PORT --iqn IQN \
[--seconds N] [--initiator-name IQN] [--lun N] [--seed N] [--target-nop-interval S] \
[--flood-pings N]";

/// Counts allocations, to show the I/O path makes none after setup.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// Transfer sizes of the verify loop (those that are whole blocks are used).
const SIZES: &[usize] = &[
    512,
    1024,
    4096,
    8192,
    12 * 1024,
    16 * 1024,
    64 * 1024,
    128 * 1024,
    256 * 1024,
];

struct Args {
    profile: IserProfile,
    target: SocketAddr,
    iqn: String,
    initiator: String,
    lun: u64,
    seconds: u64,
    seed: u64,
    target_nop_interval: Option<u64>,
    /// Instead of the checks: log in, send this many pings while taking
    /// nothing, then stay connected and silent (a peer whose receive queue
    /// never refills).
    flood_pings: Option<u64>,
}

/// The arguments, or None for --help.
fn parse_args() -> Result<Option<Args>, String> {
    let mut profile = None;
    let mut target = None;
    let mut iqn = None;
    let mut initiator = None;
    let mut lun = 0;
    let mut seconds = 10;
    let mut seed = None;
    let mut target_nop_interval = None;
    let mut flood_pings = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))
        };
        let num = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{a}: not a number: {v}"))
        };
        match a.as_str() {
            "--profile" => {
                profile = Some(match value()?.as_str() {
                    "illumos" => IserProfile::Illumos,
                    "linux" => IserProfile::Linux,
                    p => return Err(format!("unknown profile {p:?}\n{USAGE}")),
                })
            }
            "--target" => {
                let v = value()?;
                target = Some(
                    v.parse::<SocketAddr>()
                        .map_err(|e| format!("--target {v}: {e}"))?,
                )
            }
            "--iqn" => iqn = Some(value()?),
            "--initiator-name" => initiator = Some(value()?),
            "--lun" => lun = num(value()?)?,
            "--seconds" => seconds = num(value()?)?,
            "--seed" => seed = Some(num(value()?)?),
            "--target-nop-interval" => target_nop_interval = Some(num(value()?)?),
            "--flood-pings" => flood_pings = Some(num(value()?)?),
            "-h" | "--help" => return Ok(None),
            _ => return Err(format!("unknown argument {a:?}\n{USAGE}")),
        }
    }
    let profile = profile.ok_or_else(|| format!("--profile is required\n{USAGE}"))?;
    Ok(Some(Args {
        profile,
        target: target.ok_or_else(|| format!("--target is required\n{USAGE}"))?,
        iqn: iqn.ok_or_else(|| format!("--iqn is required\n{USAGE}"))?,
        initiator: initiator
            .unwrap_or_else(|| format!("iqn.2026-11.org.ramslog:check-{}", profile.name())),
        lun,
        seconds,
        seed: seed.unwrap_or_else(rand::random),
        target_nop_interval,
        flood_pings,
    }))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let name = args.profile.name().to_uppercase();
    match run(&args) {
        Ok(()) => {
            println!("ISER {name} CHECK PASSED");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ISER {name} CHECK FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn step(s: &str) {
    println!("-- {s}");
}

fn run(a: &Args) -> Result<(), String> {
    let mut opts = IserOptions::new(a.profile);
    // A read must show the target's bytes, never what its slot held.
    opts.poison_reads = true;
    // Generous: the lab runs rxe inside an emulated (TCG) guest.
    opts.timeout = Duration::from_secs(60);
    opts.queue_depth = 8;
    opts.max_transfer = 256 * 1024;
    println!(
        "profile {}, target {} {}, initiator {}, seed {}",
        a.profile.name(),
        a.target,
        a.iqn,
        a.initiator,
        a.seed
    );

    if a.flood_pings.is_some() {
        // A peer that takes nothing and asks to be retried for ever.
        opts.rnr_retry = Some(7);
    }
    step("connect (profile's CM private data) and log in");
    let p = LoginParams::normal(a.initiator.clone(), a.iqn.clone());
    let mut s =
        IserSession::connect(a.target, &p, &opts).map_err(|e| format!("connect/login: {e}"))?;
    check_keys(a.profile, &s)?;

    if let Some(n) = a.flood_pings {
        step("flood: pings while taking nothing (no receive handled or reposted)");
        let sent = s
            .flood_pings_taking_nothing(n as usize, Instant::now() + Duration::from_secs(20))
            .map_err(|e| format!("flood: {e}"))?;
        println!("sent {sent} pings; now silent, holding the connection");
        std::thread::sleep(Duration::from_secs(600));
        return Ok(());
    }

    step("TEST UNIT READY, INQUIRY, READ CAPACITY (16)");
    // The first command of a new I_T nexus may report UNIT ATTENTION
    // (power on / reset); sd and the Linux midlayer retry, so do we.
    let mut tries = 0;
    loop {
        let st = s
            .test_unit_ready(a.lun)
            .map_err(|e| format!("TEST UNIT READY: {e}"))?;
        tries += 1;
        match st.sense {
            _ if st.is_good() => break,
            Some(sense) if sense.key == sense_key::UNIT_ATTENTION && tries < 5 => {
                println!(
                    "TEST UNIT READY: UNIT ATTENTION {:#04x}/{:#04x} (retrying)",
                    sense.asc, sense.ascq
                );
            }
            _ => {
                return Err(format!(
                    "TEST UNIT READY: status {:#04x}, sense {:?}",
                    st.status, st.sense
                ))
            }
        }
    }
    let inq = s
        .inquiry(a.lun, false, 0, 96)
        .map_err(|e| format!("INQUIRY: {e}"))?;
    if inq.len() < 36 {
        return Err(format!("standard INQUIRY returned {} bytes", inq.len()));
    }
    println!(
        "INQUIRY: {} {} {}",
        String::from_utf8_lossy(&inq[8..16]).trim(),
        String::from_utf8_lossy(&inq[16..32]).trim(),
        String::from_utf8_lossy(&inq[32..36]).trim()
    );
    let (last_lba, bs) = s
        .read_capacity16(a.lun)
        .map_err(|e| format!("READ CAPACITY (16): {e}"))?;
    println!("LUN {}: {} blocks of {bs} bytes", a.lun, last_lba + 1);

    let mut d = Disk {
        lun: a.lun,
        last_lba,
        bs,
        rng: StdRng::seed_from_u64(a.seed),
    };
    step(&format!(
        "write / SYNCHRONIZE CACHE / read-verify, {} s",
        a.seconds
    ));
    let sizes: Vec<usize> = SIZES
        .iter()
        .copied()
        .filter(|n| n % bs as usize == 0 && *n <= s.max_transfer())
        .collect();
    let (n, bytes) = verify_loop(&mut s, &mut d, &sizes, a.seconds)?;
    println!("{n} write/sync/read-verify rounds, {bytes} bytes compared");

    step("pipelined: a window of writes, then of reads, verified");
    pipelined(&mut s, &mut d)?;

    step("no allocation per I/O after warm-up");
    zero_alloc(&mut s, &mut d)?;

    step("idle 6.5 s: the session pings after 5 s of silence (illumos ISCSI_DEFAULT_NOP_DELAY)");
    let before = s.stats();
    s.idle(Duration::from_millis(6500))
        .map_err(|e| format!("while idle: {e}"))?;
    let after = s.stats();
    println!("stats after idle: {after:?}");
    let idle_pings = after.idle_pings_sent - before.idle_pings_sent;
    let target_pings = after.target_pings_answered - before.target_pings_answered;
    if idle_pings == 0 && target_pings == 0 {
        return Err("6.5 s idle: neither an idle NOP-Out ping nor a target ping".into());
    }
    if idle_pings > 0 && after.ping_replies == before.ping_replies {
        return Err("the target did not echo our idle NOP-Out ping".into());
    }
    if let Some(t) = a.target_nop_interval {
        let wait = Duration::from_secs(t + 3);
        step(&format!(
            "idle {wait:?} without pinging: the target pings, we answer"
        ));
        opts.idle_ping = None;
        s.set_idle_ping(None);
        let before = s.stats().target_pings_answered;
        s.idle(wait).map_err(|e| format!("while idle: {e}"))?;
        let answered = s.stats().target_pings_answered - before;
        println!("answered {answered} target NOP-In ping(s)");
        if answered == 0 {
            return Err(format!(
                "no NOP-In ping from the target in {wait:?} (its nop interval is {t} s)"
            ));
        }
    }
    step("NOP-Out ping after idle");
    let rtt = s.nop().map_err(|e| format!("NOP-Out ping: {e}"))?;
    println!("NOP-Out echoed in {rtt:?}");

    step("a write/read after the idle period");
    let (n, _) = verify_loop(&mut s, &mut d, &sizes[..1], a.seconds)?;
    if n == 0 {
        return Err("no I/O after idle".into());
    }

    step("SendTargets over an iSER discovery session");
    let targets = iser::discover(a.target, &a.initiator, None, &opts)
        .map_err(|e| format!("discovery: {e}"))?;
    println!("SendTargets: {targets:?}");
    let Some((_, addrs)) = targets.iter().find(|(t, _)| *t == a.iqn) else {
        return Err(format!("SendTargets does not list {}", a.iqn));
    };
    let portal = a.target.ip().to_string();
    if !addrs.iter().any(|x| x.contains(&portal)) {
        return Err(format!(
            "SendTargets lists {} without the portal {portal}: {addrs:?}",
            a.iqn
        ));
    }

    let st = s.stats();
    println!("session stats: {st:?}");
    if a.profile == IserProfile::Linux
        && st.largest_full_feature_data > peer::LINUX_FULL_FEATURE_RECV_DATA
    {
        return Err(format!(
            "a {}-byte data segment in full feature phase (ib_iser receives {})",
            st.largest_full_feature_data,
            peer::LINUX_FULL_FEATURE_RECV_DATA
        ));
    }
    if st.largest_message as usize > peer::ILLUMOS_MSG_LEN {
        return Err(format!("a {}-byte message", st.largest_message));
    }

    step("logout");
    s.logout().map_err(|e| format!("logout: {e}"))?;
    Ok(())
}

fn check_keys(profile: IserProfile, s: &IserSession) -> Result<(), String> {
    let n = s.negotiated();
    println!("target's login keys: {:?}", n.target_keys);
    println!(
        "negotiated: ImmediateData={} InitialR2T={} target MRDSL={} MaxOutstandingR2T={} \
         FirstBurstLength={} MaxBurstLength={} RDMAExtensions={}; we receive up to {} bytes",
        yn(n.immediate_data),
        yn(n.initial_r2t),
        n.target_max_recv_data_segment_length,
        n.max_outstanding_r2t,
        n.first_burst_length,
        n.max_burst_length,
        yn(n.rdma_extensions),
        s.max_recv_data()
    );
    let key = |k: &str| {
        n.target_keys
            .iter()
            .rev()
            .find(|(kk, _)| kk == k)
            .map(|(_, v)| v.as_str())
    };
    let mut bad = Vec::new();
    match profile {
        IserProfile::Illumos => {
            if n.immediate_data {
                bad.push("ImmediateData must be No (the illumos buffer overrun, quirk Q4)");
            }
            if !n.initial_r2t {
                bad.push("InitialR2T must be Yes");
            }
            if n.target_max_recv_data_segment_length > 8192 {
                bad.push("the target's MaxRecvDataSegmentLength must be <= 8192");
            }
            if key("MaxRecvDataSegmentLength").is_none() {
                bad.push("the target declared no MaxRecvDataSegmentLength");
            }
            if n.max_outstanding_r2t != 1 {
                bad.push("MaxOutstandingR2T must be 1");
            }
            if key("RDMAExtensions").is_some() {
                bad.push("the target sent RDMAExtensions to an initiator that never offered it");
            }
        }
        IserProfile::Linux => {
            if !n.rdma_extensions {
                bad.push("RDMAExtensions must be Yes");
            }
            if key("TargetRecvDataSegmentLength").is_none() {
                bad.push("the target declared no TargetRecvDataSegmentLength");
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("; "))
    }
}

fn yn(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

/// The LUN under test and the random source for LBAs and data.
struct Disk {
    lun: u64,
    last_lba: u64,
    bs: u32,
    rng: StdRng,
}

impl Disk {
    /// Blocks in `len` bytes.
    fn blocks(&self, len: usize) -> u64 {
        (len / self.bs as usize) as u64
    }

    /// A random LBA where `blocks` blocks fit.
    fn random_lba(&mut self, blocks: u64) -> Result<u64, String> {
        let room = (self.last_lba + 1)
            .checked_sub(blocks)
            .ok_or_else(|| format!("the LUN is smaller than {blocks} blocks"))?;
        Ok(self.rng.gen_range(0..=room))
    }
}

fn compare(what: &str, want: &[u8], got: &[u8]) -> Result<(), String> {
    if want == got {
        return Ok(());
    }
    let first = want
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(want.len().min(got.len()));
    let wrong = want.iter().zip(got).filter(|(a, b)| a != b).count();
    Err(format!(
        "{what}: data differs: {wrong} of {} bytes wrong, first at offset {first} \
         (wrote {:#04x?}, read {:#04x?})",
        want.len(),
        &want[first..(first + 8).min(want.len())],
        &got[first.min(got.len())..(first + 8).min(got.len())],
    ))
}

/// Rounds of write, SYNCHRONIZE CACHE, read, compare over `sizes` until
/// `a.seconds` have passed (at least one pass).
fn verify_loop(
    s: &mut IserSession,
    d: &mut Disk,
    sizes: &[usize],
    seconds: u64,
) -> Result<(u64, u64), String> {
    let end = Instant::now() + Duration::from_secs(seconds);
    let max = sizes.iter().copied().max().unwrap_or(0);
    let mut data = vec![0u8; max];
    let mut back = vec![0u8; max];
    let (mut rounds, mut bytes) = (0u64, 0u64);
    loop {
        for &len in sizes {
            let lba = d.random_lba(d.blocks(len))?;
            d.rng.fill_bytes(&mut data[..len]);
            let what = format!("{len} bytes at LBA {lba}");
            s.write16(d.lun, lba, &data[..len], false)
                .map_err(|e| format!("WRITE (16) {what}: {e}"))?;
            s.sync_cache(d.lun)
                .map_err(|e| format!("SYNCHRONIZE CACHE after {what}: {e}"))?;
            back[..len].fill(0);
            s.read16(d.lun, lba, &mut back[..len])
                .map_err(|e| format!("READ (16) {what}: {e}"))?;
            compare(&what, &data[..len], &back[..len])?;
            rounds += 1;
            bytes += len as u64;
        }
        if Instant::now() >= end {
            return Ok((rounds, bytes));
        }
    }
}

/// WRITE/READ pairs (16 KiB: over Linux' 8 KiB of immediate data, so the
/// target RDMA-reads the rest) and a pipelined window, after warm-up:
/// the allocation counter must not move.
fn zero_alloc(s: &mut IserSession, d: &mut Disk) -> Result<(), String> {
    let len = (16 * 1024).max(d.bs as usize);
    let blocks = d.blocks(len);
    let depth = s.queue_depth() as u64;
    let lba = d.random_lba(blocks * depth)?;
    let mut data = vec![0u8; len];
    d.rng.fill_bytes(&mut data);
    let (lun, blocks) = (d.lun, blocks as u32);
    let mut back = vec![0u8; len];
    let write = cdb::write16(lba, blocks, false);
    let read = cdb::read16(lba, blocks);
    let fail = |e: ramslog_initiator::Error| format!("zero-allocation loop: {e}");
    let round = |s: &mut IserSession, back: &mut [u8]| -> Result<(), String> {
        s.write16(lun, lba, &data, false).map_err(fail)?;
        s.read16(lun, lba, back).map_err(fail)?;
        for _ in 0..depth {
            s.submit(lun, &write, &data, 0).map_err(fail)?;
        }
        for _ in 0..depth {
            s.wait().map_err(fail)?.result.map_err(fail)?;
        }
        for _ in 0..depth {
            s.submit(lun, &read, &[], len as u32).map_err(fail)?;
        }
        for _ in 0..depth {
            let c = s.wait().map_err(fail)?;
            c.result.and_then(|st| st.check()).map_err(fail)?;
            let n = s.data_in_into(c.tag, back).map_err(fail)?;
            if &back[..n] != data.as_slice() {
                return Err("zero-allocation loop: read data differs".to_string());
            }
        }
        Ok(())
    };
    for _ in 0..8 {
        round(s, &mut back)?;
    }
    let rounds = 50;
    let before = ALLOCATOR.allocations();
    for _ in 0..rounds {
        round(s, &mut back)?;
    }
    let n = ALLOCATOR.allocations() - before;
    compare("zero-allocation loop", &data, &back)?;
    let ios = rounds * (2 + 2 * depth);
    println!("{ios} I/Os of {len} bytes after warm-up: {n} allocations");
    if n != 0 {
        return Err(format!("{n} allocations in {ios} I/Os after warm-up"));
    }
    Ok(())
}

/// A window of writes at distinct LBAs in flight together, then a window of
/// reads of them, compared.
fn pipelined(s: &mut IserSession, d: &mut Disk) -> Result<(), String> {
    let depth = s.queue_depth();
    // 64 KiB each: more RDMA READs than illumos offers credits (4) are due at once.
    let len = (64 * 1024).max(d.bs as usize);
    let blocks = d.blocks(len);
    let region = d.random_lba(blocks * depth as u64)?;
    let mut datas = Vec::with_capacity(depth);
    let mut tags: Vec<Tag> = Vec::with_capacity(depth);
    for i in 0..depth {
        let mut data = vec![0u8; len];
        d.rng.fill_bytes(&mut data);
        let lba = region + i as u64 * blocks;
        tags.push(
            s.submit(d.lun, &cdb::write16(lba, blocks as u32, false), &data, 0)
                .map_err(|e| format!("pipelined WRITE {i}: {e}"))?,
        );
        datas.push(data);
    }
    println!("{} writes in flight", s.outstanding());
    for _ in 0..depth {
        let c = s.wait().map_err(|e| format!("pipelined writes: {e}"))?;
        c.result
            .and_then(|st| st.check())
            .map_err(|e| format!("pipelined write {:?}: {e}", c.tag))?;
    }
    s.sync_cache(d.lun)
        .map_err(|e| format!("SYNCHRONIZE CACHE: {e}"))?;
    tags.clear();
    for i in 0..depth {
        let lba = region + i as u64 * blocks;
        tags.push(
            s.submit(d.lun, &cdb::read16(lba, blocks as u32), &[], len as u32)
                .map_err(|e| format!("pipelined READ {i}: {e}"))?,
        );
    }
    let mut seen = 0;
    while seen < depth {
        let c = s.wait().map_err(|e| format!("pipelined reads: {e}"))?;
        let st = c
            .result
            .and_then(|st| st.check())
            .map_err(|e| format!("pipelined read {:?}: {e}", c.tag))?;
        let i = tags
            .iter()
            .position(|t| *t == c.tag)
            .ok_or_else(|| format!("completion for unknown {:?}", c.tag))?;
        if st.data_in_len as usize != len {
            return Err(format!(
                "pipelined read {i}: {} of {len} bytes",
                st.data_in_len
            ));
        }
        let got = s
            .data_in(c.tag)
            .map_err(|e| format!("pipelined read {i}: {e}"))?;
        compare(&format!("pipelined read {i}"), &datas[i], &got)?;
        seen += 1;
    }
    println!("{depth} pipelined writes and reads of {len} bytes verified");
    Ok(())
}
