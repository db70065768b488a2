//! The opt-in Prometheus endpoint (`--metrics`): an OpenMetrics text page
//! at `/metrics`, encoded by `prometheus-client` from the counters at
//! scrape time.
//!
//! Labels are the configured target names, LUN numbers and fixed word lists;
//! never a name a peer sent (an IQN), so no peer can grow the page.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::{
    bucket_bound_seconds, sense_key_label, CommandKind, LimitHit, LoginRefusal, LunTotals,
    ProcessMemory, FINITE_BUCKETS,
};
use crate::portal::Portal;
use crate::scsi::Readiness;

/// Scrapes served at once; more wait for a slot.
const CONCURRENT_SCRAPES: usize = 4;
/// Longest request head read.
const MAX_REQUEST: usize = 8 * 1024;
/// A scraper gets this long to send its request head…
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// …and this long for the whole exchange.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Reads the portal's counters at each scrape.
struct PortalCollector {
    portal: Arc<Portal>,
}

impl fmt::Debug for PortalCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PortalCollector")
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

impl Collector for PortalCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let lus: Vec<LuFacts> = self
            .portal
            .targets
            .iter()
            .flat_map(|t| {
                t.scsi.luns().map(|lu| {
                    let v = lu.volume();
                    let st = v.status();
                    LuFacts {
                        labels: [("target", t.name.clone()), ("lun", lu.lun().to_string())],
                        ready: st.readiness == Readiness::Ready,
                        generation: st.generation,
                        written_bytes: st.written_bytes,
                        size: v.size(),
                        totals: lu.metrics().totals(),
                    }
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

        let portal = &self.portal;
        let sessions = portal.sessions_info();
        gauge(
            e,
            "ramslog_sessions",
            "Logged-in sessions, by target (discovery sessions under target=\"\")",
            portal
                .targets
                .iter()
                .map(|t| t.name.clone())
                .chain(std::iter::once(String::new()))
                .map(|name| {
                    let n = sessions.iter().filter(|s| s.key.target == name).count();
                    ([("target", name)], n as f64)
                }),
        )?;
        let (total, iser) = portal.gate.counts_now();
        gauge(
            e,
            "ramslog_connections",
            "Open connections, by transport",
            [
                (
                    [("transport", "tcp")],
                    f64::from(total.saturating_sub(iser)),
                ),
                ([("transport", "iser")], f64::from(iser)),
            ],
        )?;
        counter(
            e,
            "ramslog_logins_refused",
            "Logins refused, by reason",
            LoginRefusal::ALL
                .into_iter()
                .map(|r| ([("reason", r.label())], portal.counters.logins_refused(r))),
        )?;
        counter(
            e,
            "ramslog_limit_hits",
            "Times a configured limit refused a connection or a command, by limit",
            LimitHit::ALL
                .into_iter()
                .map(|h| ([("limit", h.label())], portal.counters.limit_hits(h))),
        )?;
        plain_gauge(
            e,
            "ramslog_staging_bytes",
            "Staging memory held by commands now",
            portal.staging.used() as f64,
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
pub fn render(portal: &Arc<Portal>) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(PortalCollector {
        portal: portal.clone(),
    }));
    let mut page = String::new();
    prometheus_client::encoding::text::encode(&mut page, &registry)?;
    Ok(page)
}

/// Bind the endpoint; the returned task serves it until the daemon exits.
pub async fn serve(addr: SocketAddr, portal: Arc<Portal>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    if bound.ip().is_loopback() {
        tracing::info!("metrics on http://{bound}/metrics");
    } else {
        tracing::warn!(
            "metrics on http://{bound}/metrics, beyond this host: anyone who reaches it sees \
             target names, LUN sizes and load"
        );
    }
    let slots = Arc::new(Semaphore::new(CONCURRENT_SCRAPES));
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off, go on.
                    tracing::warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // All slots busy (slow or idle clients): this one is closed at
            // once, so idle sockets cannot keep a scraper out for long.
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                drop(stream);
                continue;
            };
            let portal = portal.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tokio::time::timeout(SCRAPE_TIMEOUT, answer(stream, &portal)).await;
            });
        }
    });
    Ok(())
}

/// One HTTP/1.x request, one answer, then close.
async fn answer(mut stream: TcpStream, portal: &Arc<Portal>) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    let mut scanned = 0usize;
    while !head[scanned.saturating_sub(3)..]
        .windows(4)
        .any(|w| w == b"\r\n\r\n")
    {
        if head.len() >= MAX_REQUEST {
            let status = "431 Request Header Fields Too Large";
            return reply(&mut stream, status, "text/plain", "", true).await;
        }
        scanned = head.len();
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(r) => r?,
            Err(_) => return Ok(()),
        };
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET" | b"HEAD", b"/metrics") => {
            // Scrapes read /proc and lock each LU's registry briefly: off the
            // runtime's worker threads.
            let p = portal.clone();
            let page = tokio::task::spawn_blocking(move || render(&p))
                .await
                .map_err(std::io::Error::other)?
                .map_err(std::io::Error::other)?;
            let with_body = method == b"GET";
            reply(&mut stream, "200 OK", CONTENT_TYPE, &page, with_body).await
        }
        (b"GET" | b"HEAD", _) => {
            let body = "only /metrics is served here\n";
            reply(&mut stream, "404 Not Found", "text/plain", body, true).await
        }
        _ => {
            let body = "GET /metrics\n";
            reply(
                &mut stream,
                "405 Method Not Allowed",
                "text/plain",
                body,
                true,
            )
            .await
        }
    }
}

async fn reply(
    stream: &mut TcpStream,
    status: &str,
    ty: &str,
    body: &str,
    with_body: bool,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ty}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if with_body {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}
