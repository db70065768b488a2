//! `rdma-bench report`: the measurement this project cannot take itself — how
//! ramslog performs on an operator's own fabric — as files to send back: one
//! JSON, an SVG of the latency curves and a markdown summary.
//!
//! On a Linux host against a ramslog box it records the machine and its RDMA
//! devices, the transport floor, `lat` for fua and zil at QD1 and QD32, a
//! kernel-initiator fio run on the attached LUN, the target's own service
//! times, and optionally a second target. Without a URL (an OmniOS host
//! cannot run rdma-bench) it records only the target's service times over a
//! window, run on the box while the host works, plus pasted `zpool iostat`
//! and `iostat` output. IQNs, addresses and the host name are redacted
//! unless `--no-redact`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ramslog_initiator::{TargetUrl, Transport};
use serde::Serialize;

use crate::machine::Machine;
use crate::report::{percentile_curve, Sample, Summary};
use crate::runner::{self, Pattern, Progress, TargetInfo, Until, Workload};
use crate::{describe, floors_for, measure_floors, plot, seconds, FloorOpt, SessionArgs};

#[derive(Args)]
pub struct ReportArgs {
    /// The ramslog LUN, iser://BOX[:PORT]/IQN/LUN (iscsi:// for TCP). Without
    /// it, only the target side is recorded (`--metrics`; for OmniOS hosts).
    url: Option<String>,
    /// A second target measured the same way, for comparison.
    #[arg(long, value_name = "URL")]
    compare: Option<String>,
    #[command(flatten)]
    floor: FloorOpt,
    /// The ramslog LUN as this host's kernel initiator attached it (e.g.
    /// /dev/sdc): a 4 KiB QD1 O_DIRECT|O_SYNC fio run. Its content is
    /// overwritten, so it must be a ramslog LUN that holds nothing (no
    /// partition, filesystem or ZFS label, not in use).
    #[arg(long, value_name = "DEVICE")]
    device: Option<PathBuf>,
    /// The box's metrics endpoint (`ramslog-target --metrics`): the target's
    /// own service times over the whole run.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<SocketAddr>,
    /// Seconds per measurement (without a URL: the window watched).
    #[arg(long, default_value_t = 10.0)]
    time: f64,
    /// Directory for report.json, latency.svg and report.md.
    #[arg(long, default_value = "rdma-bench-report")]
    out: PathBuf,
    /// Keep IQNs, addresses and the host name in the files.
    #[arg(long)]
    no_redact: bool,
    /// Write to the LUNs even when their first or last 512 KiB hold data.
    /// The runs write 4 KiB blocks from the start of each LUN: never point
    /// the report at a log that is in a pool.
    #[arg(long)]
    overwrite: bool,
    /// A text file to include verbatim (repeatable), e.g. the output of
    /// `zpool iostat -vl POOL 1 10` or `iostat -xn 1 10` on the host.
    #[arg(long, value_name = "FILE")]
    paste: Vec<PathBuf>,
    #[command(flatten)]
    session: SessionArgs,
}

/// One port of an RDMA device, as `ibv_devinfo -v` and sysfs show it.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RdmaPort {
    pub port: u32,
    pub state: String,
    pub link_layer: String,
    pub active_mtu: String,
    pub active_width: String,
    pub active_speed: String,
    /// sysfs `rate`, e.g. "100 Gb/sec (4X EDR)".
    pub rate: String,
    /// The Ethernet/IPoIB interface of the port and its MTU.
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct RdmaDevice {
    pub name: String,
    pub transport: String,
    pub fw_ver: String,
    pub vendor_id: String,
    pub vendor_part_id: String,
    pub hw_ver: String,
    pub board_id: String,
    /// rdma_rxe or siw: RDMA done by the CPU.
    pub software: bool,
    pub ports: Vec<RdmaPort>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MachineFacts {
    #[serde(flatten)]
    pub base: Machine,
    /// The CPU runs under a hypervisor (the `hypervisor` cpuinfo flag).
    pub virtualised: bool,
    pub rdma_devices: Vec<RdmaDevice>,
    /// Why absolute numbers from this machine mean little; empty on real
    /// hardware.
    pub emulated: Vec<String>,
}

fn sysfs(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Parse `ibv_devinfo -v`: one entry per hca_id, ports in order. GUIDs and
/// GIDs are left out: they identify the hardware and measure nothing.
fn parse_devinfo(text: &str) -> Vec<RdmaDevice> {
    let mut devs: Vec<RdmaDevice> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim().to_string();
        if key == "hca_id" {
            devs.push(RdmaDevice {
                name: value,
                ..Default::default()
            });
            continue;
        }
        let Some(dev) = devs.last_mut() else {
            continue;
        };
        if key == "port" {
            dev.ports.push(RdmaPort {
                port: value.parse().unwrap_or(0),
                ..Default::default()
            });
            continue;
        }
        let port = dev.ports.last_mut();
        match (key, port) {
            ("transport", None) => dev.transport = value,
            ("fw_ver", None) => dev.fw_ver = value,
            ("vendor_id", None) => dev.vendor_id = value,
            ("vendor_part_id", None) => dev.vendor_part_id = value,
            ("hw_ver", None) => dev.hw_ver = value,
            ("board_id", None) => dev.board_id = value,
            ("state", Some(p)) => p.state = value,
            ("link_layer", Some(p)) => p.link_layer = value,
            ("active_mtu", Some(p)) => p.active_mtu = value,
            ("active_width", Some(p)) => p.active_width = value,
            ("active_speed", Some(p)) => p.active_speed = value,
            _ => {}
        }
    }
    devs
}

impl MachineFacts {
    pub fn here() -> MachineFacts {
        let base = Machine::here();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let virtualised = cpuinfo
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
        let mut rdma_devices = match Command::new("ibv_devinfo").arg("-v").output() {
            Ok(o) if o.status.success() => parse_devinfo(&String::from_utf8_lossy(&o.stdout)),
            _ => Vec::new(),
        };
        for d in &mut rdma_devices {
            let dir = Path::new("/sys/class/infiniband").join(&d.name);
            // A software device has no PCI device behind it.
            d.software = d.name.starts_with("rxe")
                || d.name.starts_with("siw")
                || !dir.join("device").exists();
            for p in &mut d.ports {
                let pdir = dir.join("ports").join(p.port.to_string());
                p.rate = sysfs(&pdir.join("rate")).unwrap_or_default();
                p.netdev = sysfs(&pdir.join("gid_attrs/ndevs/0"));
                p.netdev_mtu = p
                    .netdev
                    .as_ref()
                    .and_then(|n| sysfs(&Path::new("/sys/class/net").join(n).join("mtu")))
                    .and_then(|m| m.parse().ok());
            }
        }
        let mut emulated = Vec::new();
        for d in rdma_devices.iter().filter(|d| d.software) {
            emulated.push(format!(
                "{} is software RDMA (rdma_rxe/siw): the CPU does the HCA's work",
                d.name
            ));
        }
        let cpu = base.cpu.to_ascii_lowercase();
        if cpu.contains("tcg") || (virtualised && cpu.contains("qemu")) {
            emulated.push(format!(
                "the CPU is emulated ({}): every instruction is translated",
                base.cpu
            ));
        }
        MachineFacts {
            base,
            virtualised,
            rdma_devices,
            emulated,
        }
    }
}

/// One `lat` measurement in the report.
#[derive(Debug, Serialize)]
struct Run {
    workload: String,
    pattern: Pattern,
    qd: u32,
    /// The URL as given (the target's own description when it answered).
    url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<TargetInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    summary: Option<Summary>,
    /// Why this run has no numbers (e.g. a compared target refuses FUA).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// Median above the transport floor of the same shape, measured in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    above_floor_us: Option<f64>,
}

#[derive(Debug, Serialize)]
struct FloorRun {
    shape: &'static str,
    summary: Summary,
}

#[derive(Debug, Serialize)]
struct FioRun {
    device: String,
    workload: &'static str,
    iops: f64,
    ios: u64,
    p50_us: f64,
    p99_us: f64,
    p99_9_us: f64,
    mean_us: f64,
    max_us: f64,
}

/// The target's own service times over the run (from its metrics endpoint).
#[derive(Debug, Serialize, Default)]
struct TargetSide {
    seconds: f64,
    kinds: Vec<KindTimes>,
}

#[derive(Debug, Serialize)]
struct KindTimes {
    kind: String,
    commands: u64,
    mean_us: f64,
    /// Upper bounds of the histogram buckets holding the quantiles.
    p50_us_at_most: Option<f64>,
    p99_us_at_most: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Pasted {
    file: String,
    text: String,
}

#[derive(Debug, Serialize)]
struct FieldReport {
    rdma_bench: &'static str,
    machine: MachineFacts,
    /// True when the numbers come from emulation (see machine.emulated).
    emulated: bool,
    redacted: bool,
    seconds_per_run: f64,
    floors: Vec<FloorRun>,
    runs: Vec<Run>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fio: Option<FioRun>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fio_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    target_side: Option<TargetSide>,
    #[serde(skip_serializing_if = "Option::is_none")]
    target_side_error: Option<String>,
    pasted: Vec<Pasted>,
}

/// The workloads every report measures: what a ZFS log sees.
const WORKLOADS: [(Pattern, u32); 4] = [
    (Pattern::Fua, 1),
    (Pattern::Zil, 1),
    (Pattern::Fua, 32),
    (Pattern::Zil, 32),
];

pub fn run(a: ReportArgs) -> Result<()> {
    let secs = seconds(a.time, "--time")?;
    if a.url.is_none() && a.metrics.is_none() {
        bail!(
            "give the LUN's URL (iser://BOX/IQN/0) to measure from this host, or --metrics \
             BOX:PORT to record the target side while another host (OmniOS) runs its workload"
        );
    }
    let pasted = a
        .paste
        .iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("--paste {}", p.display()))?;
            if text.len() > 1 << 20 {
                bail!("--paste {}: over 1 MiB; paste a summary", p.display());
            }
            Ok(Pasted {
                file: p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                text,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(dev) = &a.device {
        check_device(dev)?;
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let machine = MachineFacts::here();
    let before = a.metrics.map(scrape).transpose()?;
    let started = std::time::Instant::now();

    let mut urls = Vec::new();
    if let Some(u) = &a.url {
        urls.push(TargetUrl::parse(u)?);
    }
    if let Some(u) = &a.compare {
        if a.url.is_none() {
            bail!("--compare needs the ramslog LUN's URL first");
        }
        urls.push(TargetUrl::parse(u)?);
    }
    let transports: Vec<Transport> = urls.iter().map(|u| u.transport).collect();
    let o = a.session.options();
    if !a.overwrite {
        for url in &urls {
            refuse_if_holding_data(url, &o)?;
        }
    }
    let mut runs = Vec::new();
    let mut curves = Vec::new();
    let mut floor_runs = Vec::new();
    if !urls.is_empty() {
        // The floor of a 4 KiB write: what each transport costs without SCSI.
        let shape = Workload {
            pattern: Pattern::Fua,
            bs: 4096,
            qd: 1,
        };
        let mut floors = floors_for(&a.floor, &transports, &shape, a.session.spin)?;
        measure_floors(&mut floors, secs.min(Duration::from_secs(5)))?;
        for f in &floors {
            curves.push(plot::Curve {
                label: format!("floor: {}", f.shape),
                points: percentile_curve(&f.sample.hist),
            });
            floor_runs.push(FloorRun {
                shape: f.shape,
                summary: f.sample.summary(4096),
            });
        }
        for (pattern, qd) in WORKLOADS {
            let w = Workload {
                pattern,
                bs: 4096,
                qd,
            };
            for url in &urls {
                let mut run = Run {
                    workload: describe(&w),
                    pattern,
                    qd,
                    url: url.to_string(),
                    target: None,
                    summary: None,
                    error: None,
                    above_floor_us: None,
                };
                match measure(url, w, &o, secs) {
                    Ok((info, sample)) => {
                        let summary = sample.summary(w.bs);
                        let floor = floors
                            .iter()
                            .find(|f| f.transport == url.transport && qd == 1);
                        curves.push(plot::Curve {
                            label: format!("{} {} ({})", describe(&w), info.url, info.transport),
                            points: percentile_curve(&sample.hist),
                        });
                        run.above_floor_us =
                            floor.map(|f| summary.lat_us.p50 - f.sample.summary(4096).lat_us.p50);
                        run.target = Some(info);
                        run.summary = Some(summary);
                    }
                    Err(e) => {
                        // One refusal (a compared target without FUA) must not
                        // cost the whole report: it is recorded and shown.
                        eprintln!("rdma-bench: {} against {url}: {e:#}", describe(&w));
                        run.error = Some(format!("{e:#}"));
                    }
                }
                runs.push(run);
            }
        }
    }
    // Checked again: the device may have changed during the runs.
    let fio_result = a
        .device
        .as_ref()
        .map(|dev| check_device(dev).and_then(|real| fio_sync_qd1(&real, secs)));
    let (fio, fio_error) = match fio_result {
        Some(Ok(f)) => (Some(f), None),
        Some(Err(e)) => {
            eprintln!("rdma-bench: fio: {e:#}");
            (None, Some(format!("{e:#}")))
        }
        None => (None, None),
    };
    if urls.is_empty() {
        eprintln!(
            "rdma-bench: watching the target's service times for {:.0} s",
            secs.as_secs_f64()
        );
        std::thread::sleep(secs);
    }
    let only = urls
        .first()
        .map(|u| (u.target_name.clone(), u.lun.to_string()));
    let side = match (a.metrics, before) {
        (Some(addr), Some(before)) => Some(scrape(addr).and_then(|after| {
            target_side(
                &before,
                &after,
                started.elapsed().as_secs_f64(),
                only.as_ref(),
            )
        })),
        _ => None,
    };
    let (target_side, target_side_error) = match side {
        Some(Ok(t)) => (Some(t), None),
        Some(Err(e)) => {
            eprintln!("rdma-bench: target side: {e:#}");
            (None, Some(format!("{e:#}")))
        }
        None => (None, None),
    };

    let emulated = !machine.emulated.is_empty();
    let mut report = FieldReport {
        rdma_bench: env!("CARGO_PKG_VERSION"),
        emulated,
        machine,
        redacted: !a.no_redact,
        seconds_per_run: secs.as_secs_f64(),
        floors: floor_runs,
        runs,
        fio,
        fio_error,
        target_side,
        target_side_error,
        pasted,
    };
    let redact = if a.no_redact {
        Redactor::default()
    } else {
        Redactor::for_run(&a)
    };
    if !a.no_redact {
        // By field, not by search: a short name would hit other words.
        report.machine.base.hostname = "redacted".into();
        for t in report.runs.iter_mut().filter_map(|r| r.target.as_mut()) {
            for (k, v) in &mut t.negotiated {
                if k == "TargetAlias" || k == "TargetAddress" {
                    *v = "redacted".into();
                }
            }
        }
    }
    let json = redact.apply(&serde_json::to_string_pretty(&report)?);
    serde_json::from_str::<serde_json::Value>(&json).context(
        "redaction broke the JSON (a redacted name matched its syntax): use --no-redact and redact by hand",
    )?;
    write(&a.out.join("report.json"), &json)?;
    if !curves.is_empty() {
        let svg = a.out.join("latency.svg");
        let title = if emulated {
            "4 KiB sync writes (EMULATED: compare ratios, not µs)"
        } else {
            "4 KiB sync writes"
        };
        plot::write_svg(&svg, title, &curves).with_context(|| format!("plot {}", svg.display()))?;
        let text = std::fs::read_to_string(&svg)?;
        write(&svg, &redact.apply(&text))?;
    }
    write(&a.out.join("report.md"), &redact.apply(&markdown(&report)))?;
    let primary = a.url.as_deref().and_then(|u| TargetUrl::parse(u).ok());
    let failed: Vec<&Run> = report
        .runs
        .iter()
        .filter(|r| r.error.is_some() && primary.as_ref().is_some_and(|p| p.to_string() == r.url))
        .collect();
    println!(
        "rdma-bench: report in {}/ (report.md, report.json{}){}",
        a.out.display(),
        if curves.is_empty() {
            ""
        } else {
            ", latency.svg"
        },
        if a.no_redact {
            ": NOT redacted"
        } else {
            ": IQNs, addresses and the host name redacted; read it before sending"
        }
    );
    if let Some(e) = report
        .fio_error
        .as_ref()
        .or(report.target_side_error.as_ref())
    {
        bail!("the report is written, but incomplete: {e}");
    }
    if !failed.is_empty() {
        bail!(
            "{} of the LUN's runs failed (see report.md): {}",
            failed.len(),
            failed
                .iter()
                .map(|r| r.workload.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// Warm up, then measure one workload on one target for `secs`.
fn measure(
    url: &TargetUrl,
    w: Workload,
    o: &runner::ConnectOptions,
    secs: Duration,
) -> Result<(TargetInfo, Sample)> {
    let mut r = runner::connect(url, w, o)?;
    let warm = Until::Time(Duration::from_millis(500));
    r.run(warm, &Progress::new("warm-up", warm, true))
        .context("warm-up")?;
    let until = Until::Time(secs);
    let label = format!("{} {url}", describe(&w));
    let sample = r.run(until, &Progress::new(label, until, false))?;
    let info = r.info().clone();
    r.close();
    Ok((info, sample))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

/// The device must be an unused ramslog LUN: fio overwrites it. Returns
/// its canonical path.
fn check_device(dev: &Path) -> Result<PathBuf> {
    let real = std::fs::canonicalize(dev).with_context(|| format!("--device {}", dev.display()))?;
    let name = real
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let sys = Path::new("/sys/class/block").join(&name);
    if !sys.exists() {
        bail!("--device {}: not a block device", dev.display());
    }
    let vendor = sysfs(&sys.join("device/vendor")).unwrap_or_default();
    if vendor != "RAMSLOG" {
        bail!(
            "--device {}: its vendor is {vendor:?}, not RAMSLOG: the fio run overwrites the \
             device, so it only runs on a ramslog LUN",
            dev.display()
        );
    }
    let holders = std::fs::read_dir(sys.join("holders"))
        .map(|d| d.count())
        .unwrap_or(0);
    let partitions = std::fs::read_dir(&sys)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
                .count()
        })
        .unwrap_or(0);
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mounted = mounts
        .lines()
        .any(|l| l.split_whitespace().next() == Some(&real.to_string_lossy()));
    // Low-level probe of the whole device: filesystems, ZFS labels and
    // partition tables (PTTYPE); exit status 2 alone means "nothing found".
    let probe = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(&real)
        .output()
        .context(
            "cannot run blkid (apt-get install util-linux) to see whether the device holds data",
        )?;
    let signature = match probe.status.code() {
        Some(2) => String::new(),
        Some(0) => String::from_utf8_lossy(&probe.stdout)
            .lines()
            .filter(|l| l.starts_with("TYPE=") || l.starts_with("PTTYPE="))
            .collect::<Vec<_>>()
            .join(" "),
        _ => format!(
            "an unreadable probe (blkid: {})",
            String::from_utf8_lossy(&probe.stderr).trim()
        ),
    };
    if holders > 0 || partitions > 0 || mounted || !signature.is_empty() {
        bail!(
            "--device {}: in use or holding data ({}): the fio run would overwrite it. Measure \
             a LUN before `zpool add`, or one removed from the pool (`zpool remove`) and cleared \
             (`zpool labelclear`)",
            dev.display(),
            [
                (holders > 0).then(|| "held by another device".to_string()),
                (partitions > 0).then(|| "partitioned".to_string()),
                mounted.then(|| "mounted".to_string()),
                (!signature.is_empty()).then(|| signature.clone()),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
        );
    }
    Ok(real)
}

/// How much of each end of a LUN is checked for data: ZFS keeps two labels
/// of 256 KiB at each end, GPT its headers at both ends.
const CHECKED_END: u64 = 512 * 1024;

/// Refuse to measure (write to) a LUN whose ends hold anything but zeros.
fn refuse_if_holding_data(url: &TargetUrl, o: &runner::ConnectOptions) -> Result<()> {
    let w = Workload {
        pattern: Pattern::Read,
        bs: 4096,
        qd: 1,
    };
    let mut r = runner::connect(url, w, o)?;
    let info = r.info().clone();
    let block = u64::from(info.block_size.max(1));
    // The blocks the workload addresses: whole 4 KiB I/Os, so up to 3.5 KiB
    // short of the end on a 512-byte LUN whose size is no multiple of 4 KiB.
    let total = info.blocks * block;
    let span = CHECKED_END.min(total / 2) / block * block;
    let mut buf = vec![0u8; span as usize];
    let mut dirty = false;
    for start in [0, total - span] {
        r.read_at(start / block, &mut buf)
            .with_context(|| format!("reading {url} to see whether it holds data"))?;
        dirty |= buf.iter().any(|&b| b != 0);
    }
    r.close();
    if dirty {
        bail!(
            "{url} holds data in its first or last {} KiB (a ZFS label, a partition table, or an \
             earlier benchmark): the report writes over it. If it is in a pool, stop: measure a \
             LUN that is not. If the data does not matter, add --overwrite",
            CHECKED_END / 1024
        );
    }
    Ok(())
}

/// The sync-write job every device in the lab is measured with: 4 KiB random
/// writes, O_DIRECT + O_SYNC, QD1.
fn fio_sync_qd1(dev: &Path, secs: Duration) -> Result<FioRun> {
    let out = Command::new("fio")
        .arg("--name=ramslog-sync-qd1")
        // fio splits --filename at ':'.
        .arg(format!(
            "--filename={}",
            dev.display().to_string().replace(':', "\\:")
        ))
        .args([
            "--rw=randwrite",
            "--bs=4k",
            "--direct=1",
            "--sync=1",
            "--ioengine=psync",
            "--iodepth=1",
            "--time_based",
            "--percentile_list=50:99:99.9",
            "--output-format=json",
        ])
        .arg(format!("--runtime={}", secs.as_secs().max(1)))
        .output()
        .context("cannot run fio (apt-get install fio)")?;
    if !out.status.success() {
        bail!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio's JSON output")?;
    let w = &j["jobs"][0]["write"];
    let pct = |p: &str| w["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1e3;
    Ok(FioRun {
        device: dev.display().to_string(),
        workload: "4 KiB randwrite, QD1, O_DIRECT|O_SYNC (psync)",
        iops: w["iops"].as_f64().unwrap_or(0.0),
        ios: w["total_ios"].as_u64().unwrap_or(0),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        p99_9_us: pct("99.900000"),
        mean_us: w["clat_ns"]["mean"].as_f64().unwrap_or(f64::NAN) / 1e3,
        max_us: w["clat_ns"]["max"].as_f64().unwrap_or(f64::NAN) / 1e3,
    })
}

/// Service-time buckets and command counts by kind, summed over LUNs.
#[derive(Debug, Default, Clone)]
struct Scrape {
    /// kind → (bucket bound in seconds → cumulative count)
    buckets: BTreeMap<String, BTreeMap<u64, f64>>,
    sum_seconds: BTreeMap<String, f64>,
    count: BTreeMap<String, f64>,
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let rest = &labels[start..];
    Some(&rest[..rest.find('"')?])
}

/// `only`: count just this (target, lun); other LUNs on the box may carry
/// other hosts' I/O.
fn parse_scrape(page: &str, only: Option<&(String, String)>) -> Scrape {
    let mut s = Scrape::default();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let Some((name, labels)) = series.split_once('{') else {
            continue;
        };
        let Some(kind) = label(labels, "kind") else {
            continue;
        };
        if let Some((target, lun)) = only {
            if label(labels, "target") != Some(target) || label(labels, "lun") != Some(lun) {
                continue;
            }
        }
        let kind = kind.to_string();
        match name {
            "ramslog_lun_service_time_seconds_bucket" => {
                let le = match label(labels, "le") {
                    Some("+Inf") => u64::MAX,
                    // Bounds are whole microseconds: key them in nanoseconds.
                    Some(b) => b
                        .parse::<f64>()
                        .map_or(u64::MAX, |x| (x * 1e9).round() as u64),
                    None => continue,
                };
                *s.buckets.entry(kind).or_default().entry(le).or_default() += v;
            }
            "ramslog_lun_service_time_seconds_sum" => *s.sum_seconds.entry(kind).or_default() += v,
            "ramslog_lun_service_time_seconds_count" => *s.count.entry(kind).or_default() += v,
            _ => {}
        }
    }
    s
}

/// The raw page; parsed by [`parse_scrape`] once the LUN is known.
fn scrape(addr: SocketAddr) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .with_context(|| format!("--metrics {addr}: is ramslog-target running with --metrics?"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.take(64 << 20).read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "--metrics {addr}: {}",
            head.lines().next().unwrap_or("no answer")
        );
    }
    if !body.contains("ramslog_lun_service_time_seconds") {
        bail!("--metrics {addr}: the page has no ramslog service-time histogram");
    }
    Ok(body.to_string())
}

fn target_side(
    before: &str,
    after: &str,
    seconds: f64,
    only: Option<&(String, String)>,
) -> Result<TargetSide> {
    let (before, after) = (parse_scrape(before, only), parse_scrape(after, only));
    if only.is_some() && after.count.is_empty() {
        bail!("the metrics page has no service times for the LUN measured (another daemon?)");
    }
    let went_down = before
        .count
        .iter()
        .any(|(k, n)| after.count.get(k).copied().unwrap_or(0.0) < *n);
    if went_down {
        bail!("the target's counters went down during the run: the daemon restarted");
    }
    let kinds = after
        .count
        .iter()
        .filter_map(|(kind, n_after)| {
            let n = (n_after - before.count.get(kind).copied().unwrap_or(0.0)).max(0.0);
            if n < 1.0 {
                return None;
            }
            let sum = after.sum_seconds.get(kind).copied().unwrap_or(0.0)
                - before.sum_seconds.get(kind).copied().unwrap_or(0.0);
            let empty = BTreeMap::new();
            let b0 = before.buckets.get(kind).unwrap_or(&empty);
            let delta: Vec<(u64, f64)> = after
                .buckets
                .get(kind)
                .unwrap_or(&empty)
                .iter()
                .map(|(le, c)| (*le, c - b0.get(le).copied().unwrap_or(0.0)))
                .collect();
            let quantile = |q: f64| {
                delta
                    .iter()
                    .find(|(_, c)| *c >= (n * q).ceil())
                    .and_then(|(le, _)| (*le != u64::MAX).then(|| *le as f64 / 1e3))
            };
            Some(KindTimes {
                kind: kind.clone(),
                commands: n as u64,
                mean_us: sum / n * 1e6,
                p50_us_at_most: quantile(0.5),
                p99_us_at_most: quantile(0.99),
            })
        })
        .collect();
    Ok(TargetSide { seconds, kinds })
}

/// Replaces every name that identifies the site with a placeholder.
#[derive(Default)]
struct Redactor {
    /// (secret, placeholder), longest secret first.
    pairs: Vec<(String, String)>,
    /// Also replace every iqn./eui./naa. name and IPv4 address left (in
    /// pasted output, error messages, resolved addresses).
    scrub: bool,
}

impl Redactor {
    fn for_run(a: &ReportArgs) -> Redactor {
        let mut pairs: Vec<(String, String)> = Vec::new();
        let mut add = |secret: &str, placeholder: String| {
            // Short names would hit other words; the scrub pass and the
            // field-level redaction cover names and addresses.
            if secret.len() >= 4 && !pairs.iter().any(|(s, _)| s == secret) {
                pairs.push((secret.to_string(), placeholder));
            }
        };
        for (i, u) in [&a.url, &a.compare].into_iter().flatten().enumerate() {
            if let Ok(url) = TargetUrl::parse(u) {
                add(&url.target_name, format!("iqn.redacted:target-{}", i + 1));
                add(&url.host, format!("box-{}", i + 1));
                if let Some((_, secret)) = &url.chap {
                    add(secret, "chap-secret".into());
                }
            }
        }
        add(&a.session.initiator_name, "iqn.redacted:initiator".into());
        for addr in [a.metrics, a.floor.floor].into_iter().flatten() {
            add(&addr.ip().to_string(), "box".into());
        }
        pairs.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        Redactor { pairs, scrub: true }
    }

    fn apply(&self, text: &str) -> String {
        let mut t = text.to_string();
        for (secret, placeholder) in &self.pairs {
            t = t.replace(secret.as_str(), placeholder);
        }
        if self.scrub {
            t = scrub(&t);
        }
        t
    }
}

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '_')
}

/// Replace SCSI names (`iqn.…`, `eui.…`, `naa.…`) and dotted-quad IPv4
/// addresses, token by token; the placeholders themselves are kept.
fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(name_char) {
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        let end = tail.find(|c| !name_char(c)).unwrap_or(tail.len());
        let token = &tail[..end];
        let lower = token.to_ascii_lowercase();
        let scsi_name = ["iqn.", "eui.", "naa."]
            .iter()
            .any(|p| lower.starts_with(p))
            && !lower.starts_with("iqn.redacted")
            && token.len() > 8;
        if scsi_name {
            out.push_str("iqn.redacted");
        } else {
            out.push_str(&scrub_ipv4(token));
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Within one token (e.g. `10.0.0.1:3260`), a dotted quad becomes `ip-redacted`.
fn scrub_ipv4(token: &str) -> String {
    token
        .split(':')
        .map(|p| {
            let octets: Vec<&str> = p.split('.').collect();
            let quad = octets.len() == 4
                && octets.iter().all(|o| {
                    !o.is_empty() && o.len() <= 3 && o.bytes().all(|b| b.is_ascii_digit())
                });
            if quad {
                "ip-redacted"
            } else {
                p
            }
        })
        .collect::<Vec<_>>()
        .join(":")
}

fn us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "-".into()
    }
}

fn markdown(r: &FieldReport) -> String {
    let mut m = String::from("# ramslog field report\n\n");
    if r.emulated {
        m += "**EMULATED.** These numbers come from emulation, not from an RDMA fabric: ";
        m += &r.machine.emulated.join("; ");
        m += ". Absolute microseconds mean nothing here; only ratios measured side by side in this run do.\n\n";
    }
    let mach = &r.machine;
    m += "## Machine\n\n";
    m += &format!(
        "- host `{}`, kernel {}, {} × {}{}\n",
        mach.base.hostname,
        mach.base.kernel,
        mach.base.cpus,
        mach.base.cpu,
        if mach.virtualised {
            " (virtualised)"
        } else {
            ""
        }
    );
    if mach.rdma_devices.is_empty() {
        m += "- no RDMA device listed (ibv_devinfo missing, or no device)\n";
    }
    for d in &mach.rdma_devices {
        m += &format!(
            "- RDMA device {}: {}, firmware {}, vendor {} part {}, board {}{}\n",
            d.name,
            d.transport,
            d.fw_ver,
            d.vendor_id,
            d.vendor_part_id,
            d.board_id,
            if d.software { " (software)" } else { "" }
        );
        for p in &d.ports {
            m += &format!(
                "  - port {}: {} {}, {} (width {}, speed {}), MTU {}{}\n",
                p.port,
                p.state,
                p.link_layer,
                p.rate,
                p.active_width,
                p.active_speed,
                p.active_mtu,
                match (&p.netdev, p.netdev_mtu) {
                    (Some(n), Some(mtu)) => format!(", netdev {n} MTU {mtu}"),
                    _ => String::new(),
                }
            );
        }
    }
    if !r.floors.is_empty() || !r.runs.is_empty() {
        m += &format!(
            "\n## Latency ({} s per run, µs)\n\n| workload | target | IOPS | p50 | p99 | p99.9 | above floor |\n|---|---|---:|---:|---:|---:|---:|\n",
            r.seconds_per_run
        );
        for f in &r.floors {
            let l = &f.summary.lat_us;
            m += &format!(
                "| floor: {} | floor-server | {:.0} | {} | {} | {} | |\n",
                f.shape,
                f.summary.iops,
                us(l.p50),
                us(l.p99),
                us(l.p99_9)
            );
        }
        for run in &r.runs {
            let (Some(t), Some(s)) = (&run.target, &run.summary) else {
                m += &format!(
                    "| {} | {} | failed: {} | | | | |\n",
                    run.workload,
                    run.url,
                    run.error
                        .as_deref()
                        .unwrap_or("no result")
                        .replace('|', "/")
                );
                continue;
            };
            let l = &s.lat_us;
            m += &format!(
                "| {} | {} ({}, {}) | {:.0} | {} | {} | {} | {} |\n",
                run.workload,
                t.url,
                t.transport,
                t.product,
                s.iops,
                us(l.p50),
                us(l.p99),
                us(l.p99_9),
                run.above_floor_us.map_or(String::new(), us)
            );
        }
    }
    if let Some(f) = &r.fio {
        m += &format!(
            "\n## Kernel initiator (fio)\n\n{} on `{}`: {:.0} IOPS, p50 {} µs, p99 {} µs, p99.9 {} µs, max {} µs\n",
            f.workload,
            f.device,
            f.iops,
            us(f.p50_us),
            us(f.p99_us),
            us(f.p99_9_us),
            us(f.max_us)
        );
    }
    if let Some(t) = &r.target_side {
        m += &format!(
            "\n## Inside the target ({:.0} s, from its metrics)\n\nArrival of the command to its status sent; quantiles are histogram bucket bounds.\n\n| kind | commands | mean µs | p50 ≤ µs | p99 ≤ µs |\n|---|---:|---:|---:|---:|\n",
            t.seconds
        );
        if t.kinds.is_empty() {
            m += "| (no commands in the window) | | | | |\n";
        }
        for k in &t.kinds {
            m += &format!(
                "| {} | {} | {} | {} | {} |\n",
                k.kind,
                k.commands,
                us(k.mean_us),
                k.p50_us_at_most.map_or("-".into(), us),
                k.p99_us_at_most.map_or("-".into(), us)
            );
        }
    }
    for p in &r.pasted {
        m += &format!(
            "\n## Pasted: {}\n\n```\n{}\n```\n",
            p.file,
            p.text.trim_end()
        );
    }
    m += &format!(
        "\n---\nrdma-bench {}; {}.\n",
        r.rdma_bench,
        if r.redacted {
            "IQNs, addresses and the host name are redacted"
        } else {
            "not redacted"
        }
    );
    m
}

#[cfg(test)]
mod tests;
