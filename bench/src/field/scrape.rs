//! The target side: scrapes of ramslog-target's metrics endpoint.

use super::*;

/// Service-time buckets and command counts by kind, summed over LUNs.
#[derive(Debug, Default, Clone)]
pub(super) struct Scrape {
    /// kind → (bucket bound in seconds → cumulative count)
    buckets: BTreeMap<String, BTreeMap<u64, f64>>,
    sum_seconds: BTreeMap<String, f64>,
    count: BTreeMap<String, f64>,
}

pub(super) fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let rest = &labels[start..];
    Some(&rest[..rest.find('"')?])
}

/// `only`: count just this (target, lun); other LUNs on the box may carry
/// other hosts' I/O.
pub(super) fn parse_scrape(page: &str, only: Option<&(String, String)>) -> Scrape {
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
pub(super) fn scrape(addr: SocketAddr) -> Result<String> {
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

pub(super) fn target_side(
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
