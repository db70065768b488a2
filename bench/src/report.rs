//! Latency summaries: histograms in, numbers and tables out.

use std::time::Duration;

use anyhow::Result;
use hdrhistogram::Histogram;
use serde::Serialize;

/// A histogram of latencies in nanoseconds: 1 ns .. 100 s, 3 significant digits.
pub fn new_hist() -> Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 100_000_000_000, 3)?)
}

/// Record one latency (never fails: out-of-range values saturate).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record((d.as_nanos() as u64).max(1));
}

/// What a measurement produced.
#[derive(Clone)]
pub struct Sample {
    pub hist: Histogram<u64>,
    pub ios: u64,
    pub secs: f64,
}

impl Sample {
    pub fn empty() -> Result<Sample> {
        Ok(Sample {
            hist: new_hist()?,
            ios: 0,
            secs: 0.0,
        })
    }

    /// Add another sample of the same workload (rounds of `compare`).
    pub fn merge(&mut self, other: &Sample) -> Result<()> {
        self.hist.add(&other.hist)?;
        self.ios += other.ios;
        self.secs += other.secs;
        Ok(())
    }

    pub fn summary(&self, bs: u32) -> Summary {
        Summary::of(&self.hist, self.ios, self.secs, bs)
    }
}

/// Latency percentiles in µs.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Lat {
    pub min: f64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub ios: u64,
    pub secs: f64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub lat_us: Lat,
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl Summary {
    pub fn of(h: &Histogram<u64>, ios: u64, secs: f64, bs: u32) -> Summary {
        let (iops, mb_per_s) = if secs > 0.0 {
            let iops = ios as f64 / secs;
            (iops, iops * f64::from(bs) / 1e6)
        } else {
            (0.0, 0.0)
        };
        let empty = h.is_empty();
        let q = |q: f64| {
            if empty {
                0.0
            } else {
                us(h.value_at_quantile(q))
            }
        };
        Summary {
            ios,
            secs,
            iops,
            mb_per_s,
            lat_us: Lat {
                min: if empty { 0.0 } else { us(h.min()) },
                mean: if empty { 0.0 } else { h.mean() / 1000.0 },
                p50: q(0.50),
                p90: q(0.90),
                p99: q(0.99),
                p99_9: q(0.999),
                max: if empty { 0.0 } else { us(h.max()) },
            },
        }
    }
}

/// Points of the latency percentile curve, (percentile, µs), from p0 up to
/// the largest value, spaced for a log-scaled "nines" axis.
pub fn percentile_curve(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut pts: Vec<(f64, f64)> = h
        .iter_quantiles(2)
        .map(|v| (v.quantile_iterated_to() * 100.0, us(v.value_iterated_to())))
        .collect();
    pts.dedup_by(|a, b| a.0 == b.0);
    pts
}

pub const TABLE_HEAD: [&str; 8] = [
    "IOPS",
    "MB/s",
    "min µs",
    "p50 µs",
    "p90 µs",
    "p99 µs",
    "p99.9 µs",
    "max µs",
];

/// The numeric columns of one table row, in [`TABLE_HEAD`] order.
pub fn row(s: &Summary) -> [String; 8] {
    let l = &s.lat_us;
    [
        format!("{:.0}", s.iops),
        format!("{:.1}", s.mb_per_s),
        format!("{:.1}", l.min),
        format!("{:.1}", l.p50),
        format!("{:.1}", l.p90),
        format!("{:.1}", l.p99),
        format!("{:.1}", l.p99_9),
        format!("{:.1}", l.max),
    ]
}

/// A plain text table: first column left-aligned, the rest right-aligned.
pub fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let cols = head.len();
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(cols) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let fmt_row = |cells: Vec<&str>| {
        let mut line = String::new();
        for (i, c) in cells.iter().enumerate() {
            let pad = w[i].saturating_sub(c.chars().count());
            if i == 0 {
                line.push_str(c);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str("  ");
                line.push_str(&" ".repeat(pad));
                line.push_str(c);
            }
        }
        line.trim_end().to_string()
    };
    let mut out = fmt_row(head.to_vec());
    out.push('\n');
    for r in rows {
        out.push_str(&fmt_row(r.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist_of(values_us: &[u64]) -> Histogram<u64> {
        let mut h = new_hist().unwrap();
        for v in values_us {
            record(&mut h, Duration::from_micros(*v));
        }
        h
    }

    #[test]
    fn summary_percentiles_and_rates() {
        let h = hist_of(&(1..=100).collect::<Vec<_>>());
        let s = Summary::of(&h, 100, 2.0, 4096);
        assert_eq!(s.iops, 50.0);
        assert!((s.mb_per_s - 50.0 * 4096.0 / 1e6).abs() < 1e-9);
        assert!((s.lat_us.p50 - 50.0).abs() < 0.1, "{}", s.lat_us.p50);
        assert!((s.lat_us.p99 - 99.0).abs() < 0.1);
        assert!((s.lat_us.min - 1.0).abs() < 0.01);
        assert!((s.lat_us.max - 100.0).abs() < 0.1);
        assert!(s.lat_us.p50 <= s.lat_us.p90 && s.lat_us.p90 <= s.lat_us.p99);
    }

    #[test]
    fn empty_sample_has_no_nan() {
        let s = Sample::empty().unwrap().summary(4096);
        assert_eq!(s.iops, 0.0);
        assert_eq!(s.lat_us.p50, 0.0);
        assert!(percentile_curve(&new_hist().unwrap()).is_empty());
    }

    #[test]
    fn merge_adds_counts_and_time() {
        let mut a = Sample {
            hist: hist_of(&[10, 20]),
            ios: 2,
            secs: 1.0,
        };
        let b = Sample {
            hist: hist_of(&[30]),
            ios: 1,
            secs: 0.5,
        };
        a.merge(&b).unwrap();
        assert_eq!((a.ios, a.secs, a.hist.len()), (3, 1.5, 3));
    }

    #[test]
    fn curve_is_monotonic_and_ends_at_max() {
        let h = hist_of(&[5, 6, 7, 100, 1000]);
        let c = percentile_curve(&h);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        let last = c.last().unwrap();
        assert!((last.1 - 1000.0).abs() < 1.0);
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["target", "p50 µs"],
            &[
                vec!["a".into(), "1.0".into()],
                vec!["long name".into(), "123.4".into()],
            ],
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1].chars().count(), lines[2].chars().count());
        assert!(lines[2].ends_with("123.4"));
    }
}
