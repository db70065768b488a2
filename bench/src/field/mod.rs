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

mod device;
mod machine;
mod markdown;
mod redact;
mod scrape;

use device::*;
pub use machine::*;
use markdown::*;
use redact::*;
use scrape::*;

#[derive(Args)]
pub struct ReportArgs {
    /// The ramslog LUN, `iser://BOX[:PORT]/IQN/LUN` (iscsi:// for TCP). Without
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

#[cfg(test)]
mod tests;
