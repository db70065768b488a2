//! `rdma-bench floor` / `floor-server`: the transport floor without SCSI.
//!
//! The same message shapes a SCSI WRITE uses, timed at queue depth 1 over a
//! bare transport against `floor-server`, so that a `lat` figure can be read
//! as "floor + what the target adds":
//!
//! | shape | wire | SCSI equivalent |
//! |---|---|---|
//! | `tcp 48+bs/48` | 48 bytes + block out, 48 back | WRITE with immediate data, iSCSI/TCP |
//! | `rdma send 28+48+bs/76` | SEND of iSER + BHS headers + block, SEND of 76 back | WRITE with immediate data, iSER |
//! | `rdma send/read bs/send` | SEND of 76, server RDMA-READs the block, SEND of 76 back | WRITE without immediate data, iSER (illumos) |
//! | `rdma write (ib_write_lat)` | RDMA WRITE ping-pong polling the last byte, RTT/2 | perftest's ib_write_lat |
//! | `rdma read (ib_read_lat)` | RDMA READ of the block, post to completion | perftest's ib_read_lat |
//!
//! TCP uses blocking std::net with TCP_NODELAY; RDMA uses rdma_cm RC and
//! blocking verbs with a spin budget (see [`rdma`]). The server listens for
//! both on one address and port (rdma_cm's port space is its own) and runs
//! a thread per connection.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;

mod rdma;
mod tcp;
mod wire;

/// Arguments of `rdma-bench floor-server`.
#[derive(clap::Args, Clone, Debug)]
pub struct FloorServerArgs {
    /// listen address (TCP and rdma_cm both on it, same port)
    #[arg(long, default_value = "127.0.0.1:7470")]
    pub listen: SocketAddr,
    /// Serve TCP only (no RDMA device needed).
    #[arg(long)]
    pub no_rdma: bool,
    /// empty polls before sleeping (0 = sleep at once; use 0 on SoftRoCE)
    #[arg(long, default_value_t = 0)]
    pub spin: u32,
}

/// Arguments of `rdma-bench floor`.
#[derive(clap::Args, Clone, Debug)]
pub struct FloorArgs {
    /// Address of an `rdma-bench floor-server`.
    pub addr: SocketAddr,
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: FloorTransport,
    /// Bytes per I/O (the block).
    #[arg(long, default_value_t = 4096)]
    pub bs: u32,
    /// Measure each shape for this many seconds (default 5 unless --count).
    #[arg(long, conflicts_with = "count")]
    pub time: Option<f64>,
    /// Measure this many I/Os of each shape (wins over --time).
    #[arg(long)]
    pub count: Option<u64>,
    /// Unrecorded warm-up per shape, seconds.
    #[arg(long, default_value_t = 0.5)]
    pub warmup: f64,
    /// Empty completion-queue polls before sleeping (0 = sleep at once); in
    /// ib_write_lat, memory polls before yielding the CPU between polls.
    #[arg(long, default_value_t = 0)]
    pub spin: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FloorTransport {
    Tcp,
    Rdma,
}

/// One measured shape.
#[derive(Clone, Debug)]
pub struct FloorSample {
    /// e.g. "tcp 48+bs/48", "rdma send 28+48+bs/76".
    pub shape: &'static str,
    /// Latency in ns (1 ns .. 100 s, 3 significant digits).
    pub hist: Histogram<u64>,
    pub ios: u64,
    pub secs: f64,
    /// True where, like perftest's ib_write_lat, the figure is RTT/2.
    pub half_rtt: bool,
}

pub const SHAPE_TCP: &str = "tcp 48+bs/48";
pub const SHAPE_RDMA_SEND: &str = "rdma send 28+48+bs/76";
pub const SHAPE_RDMA_SEND_READ: &str = "rdma send/read bs/send";
pub const SHAPE_RDMA_WRITE: &str = "rdma write (ib_write_lat)";
pub const SHAPE_RDMA_READ: &str = "rdma read (ib_read_lat)";

/// How long each shape is measured.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Limit {
    Time(Duration),
    Count(u64),
}

/// Check the arguments; the measuring limit and the warm-up.
fn limits(a: &FloorArgs) -> Result<(Limit, Duration)> {
    if a.bs == 0 || a.bs > wire::MAX_BS {
        bail!("--bs must be 1..={} bytes, not {}", wire::MAX_BS, a.bs);
    }
    let secs = |what: &str, v: f64| {
        Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| *d <= Duration::from_secs(86_400))
            .with_context(|| format!("{what} must be 0..=86400 seconds, not {v}"))
    };
    let warmup = secs("--warmup", a.warmup)?;
    let limit = match (a.count, a.time) {
        (Some(0), _) => bail!("--count must be at least 1"),
        (Some(n), _) => Limit::Count(n),
        (None, t) => {
            let d = secs("--time", t.unwrap_or(5.0))?;
            if d.is_zero() {
                bail!("--time must be above 0");
            }
            Limit::Time(d)
        }
    };
    Ok((limit, warmup))
}

use crate::report::{new_hist, Summary};

/// Warm up, then run `op` (which returns the ns to record) until the
/// limit; wall-clock seconds of the measured part.
fn drive(
    shape: &'static str,
    half_rtt: bool,
    limit: Limit,
    warmup: Duration,
    mut op: impl FnMut() -> Result<u64>,
) -> Result<FloorSample> {
    let end = Instant::now() + warmup;
    while Instant::now() < end {
        op().with_context(|| format!("{shape}: warm-up"))?;
    }
    let mut hist = new_hist()?;
    let start = Instant::now();
    let mut one = |h: &mut Histogram<u64>| -> Result<()> {
        let ns = op().with_context(|| format!("{shape}: I/O {}", h.len() + 1))?;
        h.saturating_record(ns.max(1));
        Ok(())
    };
    match limit {
        Limit::Count(n) => {
            for _ in 0..n {
                one(&mut hist)?;
            }
        }
        Limit::Time(d) => {
            let end = start + d;
            while Instant::now() < end {
                one(&mut hist)?;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(FloorSample {
        shape,
        ios: hist.len(),
        hist,
        secs,
        half_rtt,
    })
}

/// One client run: every shape of `args.transport` against the
/// floor-server at `args.addr`, in the order of the table above.
pub fn measure(args: &FloorArgs) -> Result<Vec<FloorSample>> {
    let (limit, warmup) = limits(args)?;
    match args.transport {
        FloorTransport::Tcp => {
            let mut c = tcp::Client::connect(args.addr, args.bs)?;
            let s = drive(SHAPE_TCP, false, limit, warmup, || {
                let t = Instant::now();
                c.round_trip()?;
                Ok(elapsed_ns(t))
            })?;
            Ok(vec![s])
        }
        FloorTransport::Rdma => {
            let mut c = rdma::Client::connect(args.addr, args.bs, args.spin)?;
            let send = drive(SHAPE_RDMA_SEND, false, limit, warmup, || c.send_block())?;
            let send_read = drive(SHAPE_RDMA_SEND_READ, false, limit, warmup, || c.send_read())?;
            c.wlat_start().context("starting ib_write_lat")?;
            let write = drive(SHAPE_RDMA_WRITE, true, limit, warmup, || c.wlat())?;
            c.wlat_stop().context("ending ib_write_lat")?;
            let read = drive(SHAPE_RDMA_READ, false, limit, warmup, || c.read())?;
            c.close();
            Ok(vec![send, send_read, write, read])
        }
    }
}

/// One shape only (what `lat --floor` and `compare --floor` subtract): the
/// shape a target's write path has on this transport.
pub fn measure_shape(args: &FloorArgs, shape: &'static str) -> Result<FloorSample> {
    let (limit, warmup) = limits(args)?;
    match (args.transport, shape) {
        (FloorTransport::Tcp, SHAPE_TCP) => {
            let mut c = tcp::Client::connect(args.addr, args.bs)?;
            drive(SHAPE_TCP, false, limit, warmup, || {
                let t = Instant::now();
                c.round_trip()?;
                Ok(elapsed_ns(t))
            })
        }
        (FloorTransport::Rdma, SHAPE_RDMA_SEND | SHAPE_RDMA_SEND_READ) => {
            let mut c = rdma::Client::connect(args.addr, args.bs, args.spin)?;
            let s = if shape == SHAPE_RDMA_SEND {
                drive(shape, false, limit, warmup, || c.send_block())?
            } else {
                drive(shape, false, limit, warmup, || c.send_read())?
            };
            c.close();
            Ok(s)
        }
        _ => bail!("no floor shape {shape:?} over {:?}", args.transport),
    }
}

fn elapsed_ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Serve floor clients forever: TCP always, rdma_cm unless `no_rdma`, a
/// thread per connection. Returns only when a listener fails.
pub fn serve(args: &FloorServerArgs) -> Result<()> {
    let tcp = TcpListener::bind(args.listen)
        .with_context(|| format!("floor-server: cannot listen on {} (tcp)", args.listen))?;
    let addr = tcp.local_addr()?;
    let rdma = if args.no_rdma {
        None
    } else {
        // Same port as TCP (which may have been chosen by the kernel).
        Some(rdma::Listener::bind(addr, args.spin)?)
    };
    eprintln!(
        "floor-server: listening on {addr} (tcp{})",
        if rdma.is_some() { " and rdma_cm" } else { "" }
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let t = tx.clone();
    std::thread::Builder::new()
        .name("floor-tcp-accept".into())
        .spawn(move || {
            let _ = t.send(("tcp", tcp::serve(tcp)));
        })?;
    if let Some(l) = rdma {
        std::thread::Builder::new()
            .name("floor-rdma-accept".into())
            .spawn(move || {
                let _ = tx.send(("rdma_cm", l.run()));
            })?;
    } else {
        drop(tx);
    }
    match rx.recv() {
        Ok((what, Err(e))) => Err(e.context(format!("floor-server: {what} listener"))),
        Ok((what, Ok(()))) => bail!("floor-server: the {what} listener stopped"),
        Err(_) => bail!("floor-server: every listener stopped"),
    }
}

/// `rdma-bench floor`: measure and print a table (or JSON with `--json`).
pub fn run_client(args: &FloorArgs) -> Result<()> {
    let samples = measure(args)?;
    if args.json {
        println!("{}", serde_json::to_string(&to_json(args, &samples))?);
    } else {
        print!("{}", table(args, &samples));
    }
    Ok(())
}

#[derive(Serialize)]
struct SampleJson {
    shape: &'static str,
    half_rtt: bool,
    #[serde(flatten)]
    summary: Summary,
}

#[derive(Serialize)]
struct FloorJson {
    addr: SocketAddr,
    transport: FloorTransport,
    bs: u32,
    spin: u32,
    samples: Vec<SampleJson>,
}

impl FloorSample {
    pub fn summary(&self, bs: u32) -> Summary {
        Summary::of(&self.hist, self.ios, self.secs, bs)
    }
}

/// The JSON `floor --json` prints: `{addr, transport, bs, spin, samples:
/// [{shape, half_rtt, ios, secs, iops, mb_per_s, lat_us: {min, mean, p50,
/// p90, p99, p99_9, max}}]}`.
pub fn to_json(args: &FloorArgs, samples: &[FloorSample]) -> serde_json::Value {
    let j = FloorJson {
        addr: args.addr,
        transport: args.transport,
        bs: args.bs,
        spin: args.spin,
        samples: samples
            .iter()
            .map(|s| SampleJson {
                shape: s.shape,
                half_rtt: s.half_rtt,
                summary: s.summary(args.bs),
            })
            .collect(),
    };
    serde_json::to_value(j).unwrap_or(serde_json::Value::Null)
}

fn table(args: &FloorArgs, samples: &[FloorSample]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let transport = match args.transport {
        FloorTransport::Tcp => "tcp",
        FloorTransport::Rdma => "rdma",
    };
    let _ = writeln!(
        o,
        "transport floor: {} over {transport}, bs={} qd=1",
        args.addr, args.bs
    );
    let mut head = vec!["shape", "I/Os", "secs"];
    head.extend(crate::report::TABLE_HEAD);
    let rows: Vec<Vec<String>> = samples
        .iter()
        .map(|s| {
            let mut r = vec![
                format!("{}{}", s.shape, if s.half_rtt { " *" } else { "" }),
                s.ios.to_string(),
                format!("{:.2}", s.secs),
            ];
            r.extend(crate::report::row(&s.summary(args.bs)));
            r
        })
        .collect();
    o.push_str(&crate::report::table(&head, &rows));
    if samples.iter().any(|s| s.half_rtt) {
        let _ = writeln!(
            o,
            "* RTT/2, as perftest's ib_write_lat reports it; the other rows are full round trips."
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand)]
    enum Cmd {
        Floor(FloorArgs),
        FloorServer(FloorServerArgs),
    }

    fn parse(args: &[&str]) -> Result<FloorArgs, clap::Error> {
        let mut v = vec!["rdma-bench", "floor"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v)?.cmd {
            Cmd::Floor(a) => Ok(a),
            Cmd::FloorServer(_) => unreachable!(),
        }
    }

    #[test]
    fn args_defaults_and_limits() {
        let a = parse(&["10.99.0.1:7470"]).unwrap();
        assert_eq!(a.transport, FloorTransport::Tcp);
        assert_eq!((a.bs, a.spin, a.json), (4096, 0, false));
        assert_eq!(
            limits(&a).unwrap(),
            (
                Limit::Time(Duration::from_secs(5)),
                Duration::from_millis(500)
            )
        );
        let a = parse(&[
            "127.0.0.1:1",
            "--transport",
            "rdma",
            "--count",
            "7",
            "--json",
        ])
        .unwrap();
        assert_eq!(a.transport, FloorTransport::Rdma);
        assert_eq!(limits(&a).unwrap().0, Limit::Count(7));
        assert!(parse(&["127.0.0.1:1", "--count", "7", "--time", "1"]).is_err());
        assert!(parse(&["127.0.0.1:1", "--transport", "udp"]).is_err());
        assert!(parse(&["not-an-address"]).is_err());
        for bad in [
            &["127.0.0.1:1", "--bs", "0"][..],
            &["127.0.0.1:1", "--bs", "16777217"],
            &["127.0.0.1:1", "--count", "0"],
            &["127.0.0.1:1", "--time", "0"],
            &["127.0.0.1:1", "--time=-1"],
            &["127.0.0.1:1", "--time", "NaN"],
            &["127.0.0.1:1", "--warmup=-0.5"],
        ] {
            let a = parse(bad).unwrap();
            assert!(limits(&a).is_err(), "{bad:?}");
        }
        let Cmd::FloorServer(s) = Cli::try_parse_from(["x", "floor-server"]).unwrap().cmd else {
            panic!("not floor-server");
        };
        assert_eq!(s.listen, "127.0.0.1:7470".parse().unwrap());
        assert!(!s.no_rdma);
        assert_eq!(s.spin, 0);
    }

    #[test]
    fn drive_counts_and_times() {
        let mut calls = 0u64;
        let s = drive("x", false, Limit::Count(100), Duration::ZERO, || {
            calls += 1;
            Ok(calls * 1000)
        })
        .unwrap();
        assert_eq!((s.ios, calls), (100, 100));
        assert_eq!(s.hist.min(), 1000);
        assert!(s.hist.max() >= 99_900 && s.hist.max() <= 100_100);
        // A zero reading is recorded as 1 ns, not lost.
        let s = drive("x", true, Limit::Count(3), Duration::ZERO, || Ok(0)).unwrap();
        assert_eq!((s.ios, s.hist.min()), (3, 1));
        assert!(s.half_rtt);
        // Timed, with a warm-up whose I/Os are not recorded.
        let mut calls = 0u64;
        let s = drive(
            "x",
            false,
            Limit::Time(Duration::from_millis(20)),
            Duration::from_millis(10),
            || {
                calls += 1;
                std::thread::sleep(Duration::from_micros(200));
                Ok(200_000)
            },
        )
        .unwrap();
        assert!(s.ios > 0 && s.ios < calls, "{} of {calls}", s.ios);
        assert!(s.secs >= 0.02);
        // Errors carry the shape.
        let e = drive("tcp x", false, Limit::Count(3), Duration::ZERO, || {
            bail!("boom")
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("tcp x: I/O 1: boom"), "{e:#}");
    }

    #[test]
    fn report_json_and_table() {
        let a = parse(&["127.0.0.1:7470", "--bs", "512"]).unwrap();
        let mut hist = new_hist().unwrap();
        for v in [1_000u64, 2_000, 3_000, 50_000] {
            hist.record(v).unwrap();
        }
        let samples = vec![
            FloorSample {
                shape: SHAPE_TCP,
                hist: hist.clone(),
                ios: 4,
                secs: 0.5,
                half_rtt: false,
            },
            FloorSample {
                shape: SHAPE_RDMA_WRITE,
                hist,
                ios: 4,
                secs: 0.0,
                half_rtt: true,
            },
        ];
        let j = to_json(&a, &samples);
        assert_eq!(j["transport"], "tcp");
        assert_eq!(j["bs"], 512);
        assert_eq!(j["addr"], "127.0.0.1:7470");
        let s = &j["samples"][0];
        assert_eq!(s["shape"], SHAPE_TCP);
        assert_eq!(s["ios"], 4);
        assert_eq!(s["iops"], 8.0);
        assert_eq!(s["lat_us"]["min"], 1.0);
        assert_eq!(s["lat_us"]["p50"], 2.0);
        assert!(s["lat_us"]["max"].as_f64().unwrap() >= 49.9);
        assert_eq!(j["samples"][1]["half_rtt"], true);
        assert_eq!(j["samples"][1]["iops"], 0.0);
        let t = table(&a, &samples);
        assert!(t.contains("tcp 48+bs/48"), "{t}");
        assert!(t.contains("rdma write (ib_write_lat) *"), "{t}");
        assert!(t.contains("* RTT/2"), "{t}");
        assert_eq!(t.lines().count(), 5, "{t}");
    }

    #[test]
    fn tcp_round_trips_and_server_survives_bad_clients() {
        use std::io::Write;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || tcp::serve(l));
        // A client that leaves mid-message, one that sends garbage, one that
        // announces an oversized block.
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let mut hdr = [0u8; wire::FRAME_LEN];
        wire::Frame {
            data_len: 4096,
            ..wire::Frame::new(wire::Op::Data, 1)
        }
        .encode(&mut hdr);
        s.write_all(&hdr).unwrap();
        s.write_all(&[0u8; 100]).unwrap();
        drop(s);
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(&[0x55u8; 48]).unwrap();
        drop(s);
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        hdr[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        s.write_all(&hdr).unwrap();
        drop(s);
        // Still serving.
        let mut a = parse(&[&addr.to_string(), "--count", "50", "--bs", "100000"]).unwrap();
        a.warmup = 0.01;
        let v = measure(&a).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(
            (v[0].shape, v[0].ios, v[0].half_rtt),
            (SHAPE_TCP, 50, false)
        );
        assert!(v[0].hist.value_at_quantile(0.5) > 0);
    }

    #[test]
    fn clear_errors() {
        // Nobody listens on a port we just closed.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let a = parse(&[&format!("127.0.0.1:{port}"), "--count", "1"]).unwrap();
        let e = measure(&a).unwrap_err();
        assert!(
            format!("{e:#}").contains("cannot connect to a floor-server"),
            "{e:#}"
        );
        // Over RDMA on a host without RDMA: say so. (With RDMA: 127.0.0.1
        // is refused or unreachable; either way an error, never a hang.)
        let a = parse(&["127.0.0.1:9", "--transport", "rdma", "--count", "1"]).unwrap();
        let e = measure(&a).unwrap_err();
        if ramslog_common::verbs::device_count().map_or(true, |n| n == 0) {
            let m = format!("{e:#}");
            assert!(
                m.contains("no RDMA device") || m.contains("not reachable over RDMA"),
                "{m}"
            );
        }
    }
}
