//! rdma-bench: the latency instrument for ramslog and its peers.
//!
//! `lat` measures one workload against one LUN, `compare` the same workload
//! against several targets interleaved in rounds, `sweep` block sizes ×
//! queue depths, `floor` the transport alone (against `floor-server`).

mod field;
mod floor;
mod machine;
mod plot;
mod report;
mod runner;
mod softroce;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use ramslog_initiator::{TargetUrl, Transport, DEFAULT_INITIATOR_NAME};
use serde::Serialize;

use machine::Machine;
use report::{row, table, Sample, Summary, TABLE_HEAD};
use runner::{ConnectOptions, Pattern, Progress, TargetInfo, Until, Workload};

#[derive(Parser)]
#[command(
    name = "rdma-bench",
    version,
    about = "Latency instrument for ramslog and its peers (iSCSI/TCP and iSER)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Latency of one workload against one LUN.
    Lat(LatArgs),
    /// The same workload against several targets, interleaved in rounds so
    /// that machine drift hits all alike; ratios to the first.
    Compare(CompareArgs),
    /// Block size × queue depth grid against one LUN.
    Sweep(SweepArgs),
    /// The transport floor without SCSI, against `rdma-bench floor-server`.
    Floor(floor::FloorArgs),
    /// Serve `rdma-bench floor` clients (TCP, and rdma_cm on the same port).
    FloorServer(floor::FloorServerArgs),
    /// A report of this fabric to send back: machine and RDMA devices, the
    /// transport floor, fua and zil at QD1 and QD32, fio on the attached LUN,
    /// the target's own service times; JSON, SVG and markdown, redacted.
    Report(field::ReportArgs),
}

#[derive(Args, Clone)]
struct WorkloadArgs {
    /// Bytes per I/O, a multiple of the LUN's block size (K and M suffixes allowed).
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    bs: u32,
    /// I/Os in flight.
    #[arg(long, default_value_t = 1)]
    qd: u32,
    #[arg(long, value_enum, default_value_t = Pattern::Write)]
    pattern: Pattern,
}

#[derive(Args, Clone)]
struct SessionArgs {
    #[arg(long, default_value = DEFAULT_INITIATOR_NAME)]
    initiator_name: String,
    /// iSER: empty completion-queue polls before sleeping (0 on SoftRoCE or
    /// shared CPUs, where spinning starves the peer).
    #[arg(long, default_value_t = 1_000_000)]
    spin: u32,
}

impl SessionArgs {
    fn options(&self) -> ConnectOptions {
        ConnectOptions {
            initiator_name: self.initiator_name.clone(),
            spin: self.spin,
        }
    }
}

#[derive(Args, Clone)]
struct FloorOpt {
    /// Also measure the transport floor against this `rdma-bench
    /// floor-server` in the same run (write patterns), and report
    /// "target adds = measured − floor" at the median.
    #[arg(long, value_name = "ADDR:PORT")]
    floor: Option<SocketAddr>,
}

#[derive(Args, Clone)]
struct OutputArgs {
    /// Print one JSON object (with machine, kernel, transport, negotiated
    /// parameters and versions) instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw the latency percentile curve(s) into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args)]
struct LatArgs {
    /// `iscsi://host[:port]/IQN/LUN` or `iser://host[:port]/IQN/LUN` (not with --softroce).
    #[arg(required_unless_present = "softroce")]
    url: Option<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Measure for this many seconds (default 10 unless --count).
    #[arg(long, conflicts_with = "count")]
    time: Option<f64>,
    /// Measure this many I/Os.
    #[arg(long)]
    count: Option<u64>,
    /// Unrecorded warm-up, seconds.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    #[command(flatten)]
    session: SessionArgs,
    #[command(flatten)]
    floor: FloorOpt,
    #[command(flatten)]
    out: OutputArgs,
    /// Demo on a host with rdma_rxe: create an rxe device on NETDEV, start a
    /// ramslog-target on its IPv4 address, measure over iSER, tear both down.
    #[arg(long, value_name = "NETDEV", conflicts_with = "url")]
    softroce: Option<String>,
}

#[derive(Args)]
struct CompareArgs {
    /// Targets, the first is the reference for ratios.
    #[arg(required = true, num_args = 2..)]
    urls: Vec<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Seconds of measurement per target, split over the rounds.
    #[arg(long, default_value_t = 10.0)]
    time: f64,
    /// Rounds: each target runs time/rounds per round, in turn.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Unrecorded warm-up per target, seconds.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    #[command(flatten)]
    session: SessionArgs,
    #[command(flatten)]
    floor: FloorOpt,
    #[command(flatten)]
    out: OutputArgs,
}

#[derive(Args)]
struct SweepArgs {
    url: String,
    #[arg(long, value_enum, default_value_t = Pattern::Write)]
    pattern: Pattern,
    /// Block sizes (K and M suffixes allowed).
    #[arg(long, value_delimiter = ',', default_value = "512,4K,16K,64K,256K,1M", value_parser = parse_size)]
    bs: Vec<u32>,
    /// Queue depths.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    qd: Vec<u32>,
    /// Seconds per cell.
    #[arg(long, default_value_t = 2.0)]
    time: f64,
    /// Unrecorded warm-up per cell, seconds.
    #[arg(long, default_value_t = 0.3)]
    warmup: f64,
    #[command(flatten)]
    session: SessionArgs,
    #[command(flatten)]
    out: OutputArgs,
}

fn parse_size(s: &str) -> Result<u32, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1024),
        Some('M' | 'm') => (&s[..s.len() - 1], 1024 * 1024),
        _ => (s, 1),
    };
    num.parse::<u32>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("'{s}' is not a block size: use e.g. 512, 4K or 1M"))
}

fn seconds(s: f64, what: &str) -> Result<Duration> {
    if !s.is_finite() || s < 0.0 {
        bail!("{what} must be a non-negative number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

fn describe(w: &Workload) -> String {
    let bs = if w.bs.is_multiple_of(1024 * 1024) {
        format!("{} MiB", w.bs / (1024 * 1024))
    } else if w.bs.is_multiple_of(1024) {
        format!("{} KiB", w.bs / 1024)
    } else {
        format!("{} B", w.bs)
    };
    format!("{bs} {:?} QD{}", w.pattern, w.qd).replace("Zil", "zil (WRITE + SYNC CACHE)")
}

#[derive(Serialize)]
struct TargetResult {
    target: TargetInfo,
    summary: Summary,
    /// Ratios to the first target: p50 latency and IOPS.
    #[serde(skip_serializing_if = "Option::is_none")]
    p50_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    iops_ratio: Option<f64>,
    /// Median latency above the transport floor measured in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    target_adds_us: Option<f64>,
}

/// A transport floor measured in the same run.
struct Floor {
    transport: Transport,
    args: floor::FloorArgs,
    shape: &'static str,
    sample: Sample,
}

#[derive(Serialize)]
struct FloorResult {
    addr: SocketAddr,
    shape: &'static str,
    summary: Summary,
}

#[derive(Serialize)]
struct Report {
    command: &'static str,
    machine: Machine,
    workload: Workload,
    rounds: u32,
    results: Vec<TargetResult>,
    floors: Vec<FloorResult>,
}

/// The floor shape a target's write takes on `transport` (reads, whose data
/// comes back, have none): immediate data up to 8 KiB, the iSER targets'
/// receive size; beyond it the block is RDMA-read.
fn floor_shape(
    transport: Transport,
    w: &Workload,
) -> Option<(floor::FloorTransport, &'static str)> {
    if !matches!(w.pattern, Pattern::Write | Pattern::Fua) || w.qd != 1 {
        return None;
    }
    Some(match transport {
        Transport::Tcp => (floor::FloorTransport::Tcp, floor::SHAPE_TCP),
        Transport::Iser if w.bs <= 8192 => (floor::FloorTransport::Rdma, floor::SHAPE_RDMA_SEND),
        Transport::Iser => (floor::FloorTransport::Rdma, floor::SHAPE_RDMA_SEND_READ),
    })
}

/// Floors to measure for these targets, one per transport.
fn floors_for(
    opt: &FloorOpt,
    transports: &[Transport],
    w: &Workload,
    spin: u32,
) -> Result<Vec<Floor>> {
    let Some(addr) = opt.floor else {
        return Ok(Vec::new());
    };
    let mut v: Vec<Floor> = Vec::new();
    let mut seen = Vec::new();
    for &t in transports {
        if seen.contains(&t) {
            continue;
        }
        seen.push(t);
        let Some((ft, shape)) = floor_shape(t, w) else {
            eprintln!(
                "rdma-bench: no floor for {:?} at QD{}: the floor is the shape of a QD1 write",
                w.pattern, w.qd
            );
            continue;
        };
        v.push(Floor {
            transport: t,
            args: floor::FloorArgs {
                addr,
                transport: ft,
                bs: w.bs,
                time: Some(1.0),
                count: None,
                warmup: 0.2,
                spin,
                json: false,
            },
            shape,
            sample: Sample::empty()?,
        });
    }
    Ok(v)
}

/// Measure each floor for `d` and add it to what it has.
fn measure_floors(floors: &mut [Floor], d: Duration) -> Result<()> {
    for f in floors {
        f.args.time = Some(d.as_secs_f64().max(0.1));
        let s = floor::measure_shape(&f.args, f.shape)
            .with_context(|| format!("transport floor against {}", f.args.addr))?;
        f.sample.merge(&Sample {
            hist: s.hist,
            ios: s.ios,
            secs: s.secs,
        })?;
    }
    Ok(())
}

/// Print the table (or JSON) and draw the plot of one or more targets.
fn emit(
    command: &'static str,
    w: Workload,
    rounds: u32,
    targets: &[(TargetInfo, Transport, Sample)],
    floors: &[Floor],
    out: &OutputArgs,
) -> Result<()> {
    let first = targets.first().map(|(_, _, s)| s.summary(w.bs));
    let results: Vec<TargetResult> = targets
        .iter()
        .enumerate()
        .map(|(i, (info, transport, s))| {
            let summary = s.summary(w.bs);
            let ratios = (i > 0).then_some(()).and(first).map(|f| {
                (
                    summary.lat_us.p50 / f.lat_us.p50.max(1e-9),
                    summary.iops / f.iops.max(1e-9),
                )
            });
            let floor = floors.iter().find(|f| f.transport == *transport);
            TargetResult {
                target: info.clone(),
                summary,
                p50_ratio: ratios.map(|r| r.0),
                iops_ratio: ratios.map(|r| r.1),
                target_adds_us: floor
                    .map(|f| summary.lat_us.p50 - f.sample.summary(w.bs).lat_us.p50),
            }
        })
        .collect();
    let floor_results: Vec<FloorResult> = floors
        .iter()
        .map(|f| FloorResult {
            addr: f.args.addr,
            shape: f.shape,
            summary: f.sample.summary(w.bs),
        })
        .collect();
    if let Some(path) = &out.plot {
        let mut curves: Vec<plot::Curve> = targets
            .iter()
            .map(|(info, _, s)| plot::Curve {
                label: format!("{} ({})", info.url, info.transport),
                points: report::percentile_curve(&s.hist),
            })
            .collect();
        curves.extend(floors.iter().map(|f| plot::Curve {
            label: format!("floor: {}", f.shape),
            points: report::percentile_curve(&f.sample.hist),
        }));
        plot::write_svg(path, &describe(&w), &curves)
            .with_context(|| format!("plot {}", path.display()))?;
    }
    if out.json {
        let r = Report {
            command,
            machine: Machine::here(),
            workload: w,
            rounds,
            results,
            floors: floor_results,
        };
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("{}", describe(&w));
    let mut head = vec!["target"];
    head.extend(TABLE_HEAD);
    let many = results.len() > 1;
    if many {
        head.extend(["p50 ratio", "IOPS ratio"]);
    }
    if !floors.is_empty() {
        head.push("adds µs");
    }
    let mut rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let mut v = vec![format!("{} ({})", r.target.url, r.target.transport)];
            v.extend(row(&r.summary));
            if many {
                v.push(r.p50_ratio.map_or("1.00".into(), |x| format!("{x:.2}")));
                v.push(r.iops_ratio.map_or("1.00".into(), |x| format!("{x:.2}")));
            }
            if !floors.is_empty() {
                v.push(r.target_adds_us.map_or("-".into(), |x| format!("{x:.1}")));
            }
            v
        })
        .collect();
    for f in &floor_results {
        let mut v = vec![format!("floor: {} ({})", f.shape, f.addr)];
        v.extend(row(&f.summary));
        while v.len() < head.len() {
            v.push(String::new());
        }
        rows.push(v);
    }
    print!("{}", table(&head, &rows));
    if !floors.is_empty() {
        println!(
            "adds µs: the target's median latency above the transport floor measured in this run"
        );
    }
    Ok(())
}

fn lat(a: LatArgs) -> Result<()> {
    if let Some(netdev) = &a.softroce {
        return softroce::demo(netdev, &a.session.initiator_name);
    }
    let url = a.url.as_deref().unwrap_or_default();
    lat_on(&a, url)
}

fn lat_on(a: &LatArgs, url: &str) -> Result<()> {
    let url = TargetUrl::parse(url)?;
    let w = Workload {
        pattern: a.workload.pattern,
        bs: a.workload.bs,
        qd: a.workload.qd,
    };
    let mut r = runner::connect(&url, w, &a.session.options())?;
    let mut floors = floors_for(&a.floor, &[url.transport], &w, a.session.spin)?;
    let quiet = a.out.quiet || a.out.json;
    if a.warmup > 0.0 {
        let until = Until::Time(seconds(a.warmup, "--warmup")?);
        r.run(until, &Progress::new("warm-up", until, true))
            .context("warm-up")?;
    }
    let until = match (a.time, a.count) {
        (_, Some(n)) => Until::Count(n),
        (t, None) => Until::Time(seconds(t.unwrap_or(10.0), "--time")?),
    };
    let sample = r.run(until, &Progress::new(url.to_string(), until, quiet))?;
    let info = r.info().clone();
    r.close();
    let floor_time = match until {
        Until::Time(d) => d.min(Duration::from_secs(5)),
        Until::Count(_) => Duration::from_secs(2),
    };
    measure_floors(&mut floors, floor_time)?;
    emit(
        "lat",
        w,
        1,
        &[(info, url.transport, sample)],
        &floors,
        &a.out,
    )
}

fn compare(a: CompareArgs) -> Result<()> {
    let w = Workload {
        pattern: a.workload.pattern,
        bs: a.workload.bs,
        qd: a.workload.qd,
    };
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let o = a.session.options();
    let mut runners = Vec::new();
    let mut transports = Vec::new();
    for u in &a.urls {
        let url = TargetUrl::parse(u)?;
        runners.push(runner::connect(&url, w, &o)?);
        transports.push(url.transport);
    }
    let mut floors = floors_for(&a.floor, &transports, &w, a.session.spin)?;
    let quiet = a.out.quiet || a.out.json;
    if a.warmup > 0.0 {
        let until = Until::Time(seconds(a.warmup, "--warmup")?);
        for r in &mut runners {
            r.run(until, &Progress::new("warm-up", until, true))
                .with_context(|| format!("warm-up of {}", r.info().url))?;
        }
    }
    let per_round = Until::Time(seconds(a.time / f64::from(a.rounds), "--time")?);
    let mut samples = Vec::new();
    for _ in &runners {
        samples.push(Sample::empty()?);
    }
    for round in 0..a.rounds {
        for (r, total) in runners.iter_mut().zip(samples.iter_mut()) {
            let label = format!("round {}/{} {}", round + 1, a.rounds, r.info().url);
            let s = r.run(per_round, &Progress::new(label, per_round, quiet))?;
            total.merge(&s)?;
        }
        if let Until::Time(d) = per_round {
            measure_floors(&mut floors, d)?;
        }
    }
    let mut targets = Vec::new();
    for ((r, s), t) in runners.into_iter().zip(samples).zip(transports) {
        targets.push((r.info().clone(), t, s));
        r.close();
    }
    emit("compare", w, a.rounds, &targets, &floors, &a.out)
}

#[derive(Serialize)]
struct SweepCell {
    bs: u32,
    qd: u32,
    summary: Summary,
}

#[derive(Serialize)]
struct SweepReport {
    command: &'static str,
    machine: Machine,
    target: Option<TargetInfo>,
    pattern: Pattern,
    cells: Vec<SweepCell>,
}

fn sweep(a: SweepArgs) -> Result<()> {
    let url = TargetUrl::parse(&a.url)?;
    let o = a.session.options();
    let quiet = a.out.quiet || a.out.json;
    let mut cells = Vec::new();
    let mut info = None;
    let mut curves = Vec::new();
    for &bs in &a.bs {
        for &qd in &a.qd {
            let w = Workload {
                pattern: a.pattern,
                bs,
                qd,
            };
            let mut r = runner::connect(&url, w, &o)?;
            if a.warmup > 0.0 {
                let until = Until::Time(seconds(a.warmup, "--warmup")?);
                r.run(until, &Progress::new("warm-up", until, true))?;
            }
            let until = Until::Time(seconds(a.time, "--time")?);
            let s = r.run(until, &Progress::new(describe(&w), until, quiet))?;
            info.get_or_insert_with(|| r.info().clone());
            r.close();
            if !quiet {
                let l = s.summary(bs);
                eprintln!(
                    "{:>8} QD{:<3} {:>9.0} IOPS {:>9.1} MB/s  p50 {:>9.1} µs  p99 {:>9.1} µs",
                    bs, qd, l.iops, l.mb_per_s, l.lat_us.p50, l.lat_us.p99
                );
            }
            curves.push(plot::Curve {
                label: format!(
                    "{} QD{qd}",
                    describe(&w)
                        .split(' ')
                        .take(2)
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                points: report::percentile_curve(&s.hist),
            });
            cells.push(SweepCell {
                bs,
                qd,
                summary: s.summary(bs),
            });
        }
    }
    if let Some(path) = &a.out.plot {
        plot::write_svg(path, &format!("sweep {:?} {}", a.pattern, url), &curves)?;
    }
    if a.out.json {
        let r = SweepReport {
            command: "sweep",
            machine: Machine::here(),
            target: info,
            pattern: a.pattern,
            cells,
        };
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("sweep {:?} {url}", a.pattern);
    let head = ["bs", "QD", "IOPS", "MB/s", "p50 µs", "p99 µs", "p99.9 µs"];
    let rows: Vec<Vec<String>> = cells
        .iter()
        .map(|c| {
            let l = &c.summary.lat_us;
            vec![
                c.bs.to_string(),
                c.qd.to_string(),
                format!("{:.0}", c.summary.iops),
                format!("{:.1}", c.summary.mb_per_s),
                format!("{:.1}", l.p50),
                format!("{:.1}", l.p99),
                format!("{:.1}", l.p99_9),
            ]
        })
        .collect();
    print!("{}", table(&head, &rows));
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Lat(a) => lat(a),
        Cmd::Compare(a) => compare(a),
        Cmd::Sweep(a) => sweep(a),
        Cmd::Floor(a) => floor::run_client(&a),
        Cmd::FloorServer(a) => floor::serve(&a),
        Cmd::Report(a) => field::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("8192M").is_err());
    }

    #[test]
    fn workload_titles() {
        let w = Workload {
            pattern: Pattern::Fua,
            bs: 4096,
            qd: 1,
        };
        assert_eq!(describe(&w), "4 KiB Fua QD1");
    }
}
