//! The opt-in Prometheus endpoint (`--metrics`): a face over the core,
//! beside `control`. This module renders the page, OpenMetrics text encoded
//! by `prometheus-client` from the counters `metrics` keeps; `endpoint`
//! serves it.
//!
//! Labels are the configured target names, LUN numbers and fixed word lists;
//! never a name a peer sent (an IQN), so no peer can grow the page.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

pub mod endpoint;

use crate::admission::FrontEnd;
use crate::core::{Core, FrontEndView};
use crate::metrics::{
    bucket_bound_seconds, sense_key_label, CommandKind, LimitHit, LoginRefusal, LunTotals,
    ProcessMemory, FINITE_BUCKETS,
};

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a scrape reads: the core's volumes and counters, and each front
/// end's sessions.
#[derive(Clone)]
pub struct Faces {
    pub core: Arc<Core>,
    pub front_ends: Vec<Arc<dyn FrontEndView>>,
}

/// Reads the counters at each scrape.
struct Scrape {
    faces: Faces,
}

impl fmt::Debug for Scrape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Collector")
    }
}

type LunLabels = [(&'static str, String); 2];

struct LuFacts {
    labels: LunLabels,
    ready: bool,
    generation: u64,
    written_bytes: u64,
    size: u64,
    totals: LunTotals,
}

fn gauge<S: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (S, f64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        m.encode_family(&labels)?.encode_gauge(&v)?;
    }
    Ok(())
}

fn plain_gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> fmt::Result {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&v)
}

fn counter<S: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (S, u64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        m.encode_family(&labels)?
            .encode_counter::<NoLabelSet, u64, u64>(&v, None)?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let core = &self.faces.core;
        let lus: Vec<LuFacts> = core
            .exported()
            .flat_map(|(v, exports)| {
                let facts = v.facts();
                exports
                    .iter()
                    .filter(|e| e.front_end == FrontEnd::Iscsi)
                    .map(move |e| LuFacts {
                        labels: [("target", e.owner.clone()), ("lun", e.unit.to_string())],
                        ready: facts.is_ready(),
                        generation: facts.status.generation,
                        written_bytes: facts.status.written_bytes,
                        size: facts.size,
                        totals: facts.io.clone(),
                    })
            })
            .collect();
        let e = &mut enc;
        gauge(
            e,
            "ramslog_lun_ready",
            "1 when the LUN serves I/O; 0 when NOT READY (content lost, needs accept-empty)",
            lus.iter()
                .map(|l| (l.labels.clone(), f64::from(u8::from(l.ready)))),
        )?;
        gauge(
            e,
            "ramslog_lun_generation",
            "The LUN's content generation (bumped at each start that restores it)",
            lus.iter().map(|l| (l.labels.clone(), l.generation as f64)),
        )?;
        gauge(
            e,
            "ramslog_lun_size_bytes",
            "The LUN's capacity",
            lus.iter().map(|l| (l.labels.clone(), l.size as f64)),
        )?;
        gauge(
            e,
            "ramslog_lun_written_bytes",
            "Bytes of the LUN ever written: what the next dump saves",
            lus.iter()
                .map(|l| (l.labels.clone(), l.written_bytes as f64)),
        )?;
        let by_kind = |l: &LuFacts, k: CommandKind| {
            let [a, b] = l.labels.clone();
            [a, b, ("kind", k.label().to_string())]
        };
        counter(
            e,
            "ramslog_lun_commands",
            "SCSI commands answered, by kind",
            lus.iter().flat_map(|l| {
                CommandKind::ALL
                    .into_iter()
                    .map(move |k| (by_kind(l, k), l.totals.commands[k as usize]))
            }),
        )?;
        counter(
            e,
            "ramslog_lun_data_bytes",
            "Data bytes moved by commands that succeeded, by kind",
            lus.iter().flat_map(|l| {
                [CommandKind::Read, CommandKind::Write]
                    .into_iter()
                    .map(move |k| (by_kind(l, k), l.totals.bytes[k as usize]))
            }),
        )?;
        counter(
            e,
            "ramslog_lun_errors",
            "Commands that ended with a status other than GOOD, by status and sense key",
            lus.iter().flat_map(|l| {
                l.totals.errors().map(move |(st, key, n)| {
                    let [a, b] = l.labels.clone();
                    (
                        [
                            a,
                            b,
                            ("status", st.label().to_string()),
                            ("sense_key", sense_key_label(key).to_string()),
                        ],
                        n,
                    )
                })
            }),
        )?;
        {
            let mut m = e.encode_descriptor(
                "ramslog_lun_service_time_seconds",
                "From the command's arrival to its status posted (iSER) or written (TCP), by kind",
                None,
                MetricType::Histogram,
            )?;
            for l in &lus {
                for k in CommandKind::ALL {
                    let s = &l.totals.service[k as usize];
                    // Per bucket: the encoder accumulates, and marks f64::MAX +Inf.
                    let buckets: Vec<(f64, u64)> = s
                        .buckets
                        .iter()
                        .enumerate()
                        .map(|(i, c)| {
                            let bound = if i < FINITE_BUCKETS {
                                bucket_bound_seconds(i)
                            } else {
                                f64::MAX
                            };
                            (bound, *c)
                        })
                        .collect();
                    m.encode_family(&by_kind(l, k))?
                        .encode_histogram::<NoLabelSet>(
                            s.sum_nanos as f64 * 1e-9,
                            s.count(),
                            &buckets,
                            None,
                        )?;
                }
            }
        }

        let fronts = &self.faces.front_ends;
        let sessions: Vec<_> = fronts.iter().flat_map(|f| f.sessions()).collect();
        gauge(
            e,
            "ramslog_sessions",
            "Logged-in sessions, by target (discovery sessions under target=\"\")",
            fronts
                .iter()
                .flat_map(|f| f.owners())
                .chain(std::iter::once(String::new()))
                .map(|name| {
                    let n = sessions.iter().filter(|s| s.owner == name).count();
                    ([("target", name)], n as f64)
                }),
        )?;
        let open = core.gate.counts_now();
        // `iser` names the RDMA transport: the label predates a second RDMA
        // front end and stays for dashboards.
        gauge(
            e,
            "ramslog_connections",
            "Open connections, by transport",
            [
                ([("transport", "tcp")], f64::from(open.tcp())),
                ([("transport", "iser")], f64::from(open.rdma)),
            ],
        )?;
        gauge(
            e,
            "ramslog_front_end_connections",
            "Open connections, by front end (protocol)",
            FrontEnd::ALL
                .into_iter()
                .map(|f| ([("front_end", f.label())], f64::from(open.of(f)))),
        )?;
        counter(
            e,
            "ramslog_logins_refused",
            "Logins refused, by reason",
            LoginRefusal::ALL
                .into_iter()
                .map(|r| ([("reason", r.label())], core.counters.logins_refused(r))),
        )?;
        counter(
            e,
            "ramslog_limit_hits",
            "Times a configured limit refused a connection or a command, by limit",
            LimitHit::ALL
                .into_iter()
                .map(|h| ([("limit", h.label())], core.counters.limit_hits(h))),
        )?;
        plain_gauge(
            e,
            "ramslog_staging_bytes",
            "Staging memory held by commands now",
            core.staging.used() as f64,
        )?;
        let mem = ProcessMemory::now();
        plain_gauge(
            e,
            "ramslog_process_locked_memory_bytes",
            "Locked (mlock) memory of the daemon: the LUN memory",
            mem.locked_bytes as f64,
        )?;
        plain_gauge(
            e,
            "ramslog_process_pinned_memory_bytes",
            "Memory pinned by RDMA registrations: each LUN once per RDMA device, and every iSER connection's buffers",
            mem.pinned_bytes as f64,
        )?;
        plain_gauge(
            e,
            "ramslog_process_resident_memory_bytes",
            "Resident memory of the daemon",
            mem.resident_bytes as f64,
        )?;
        Ok(())
    }
}

/// The page a scrape returns.
pub fn render(faces: &Faces) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape {
        faces: faces.clone(),
    }));
    let mut page = String::new();
    prometheus_client::encoding::text::encode(&mut page, &registry)?;
    Ok(page)
}
