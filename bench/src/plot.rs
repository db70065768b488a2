//! `--plot FILE.svg`: the latency percentile curve, one line per target,
//! latency on a log scale against percentiles spaced by their nines
//! (50, 90, 99, 99.9, ...), the workload in the title.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// One line of the plot: a label and its (percentile, µs) points.
pub struct Curve {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Percentile → "nines" position: 0 at p0, 1 at p90, 2 at p99, 3 at p99.9.
fn nines(p: f64) -> f64 {
    let rest = (1.0 - p / 100.0).max(1e-7);
    -rest.log10()
}

fn nines_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-x));
    if p < 99.0 {
        format!("p{p:.0}")
    } else {
        let s = format!("p{p:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

pub fn write_svg(path: &Path, title: &str, curves: &[Curve]) -> Result<()> {
    let pts = || curves.iter().flat_map(|c| c.points.iter());
    if pts().next().is_none() {
        return Err(anyhow!("nothing to plot: no latencies were recorded"));
    }
    let max_x = pts()
        .map(|p| nines(p.0))
        .fold(1.0f64, f64::max)
        .ceil()
        .min(7.0);
    let lo = pts().map(|p| p.1).fold(f64::MAX, f64::min).max(0.01);
    let hi = pts().map(|p| p.1).fold(0.0f64, f64::max).max(lo * 1.5);
    let root = SVGBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_x, (lo * 0.8..hi * 1.25).log_scale())
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (µs, log scale)")
        .x_labels(max_x as usize + 1)
        .x_label_formatter(&|x| nines_label(*x))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, c) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                c.points.iter().map(|(p, us)| (nines(*p).min(max_x), *us)),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(c.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_axis() {
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.0) - 2.0).abs() < 1e-9);
        assert!(nines(0.0).abs() < 1e-9);
        assert_eq!(nines_label(1.0), "p90");
        assert_eq!(nines_label(3.0), "p99.9");
        assert_eq!(nines_label(std::f64::consts::LOG10_2), "p50");
    }

    #[test]
    fn writes_an_svg_with_every_label() {
        let dir = std::env::temp_dir().join(format!("rdma-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.svg");
        let curves = vec![
            Curve {
                label: "ramslog".into(),
                points: vec![(0.0, 10.0), (50.0, 12.0), (99.0, 20.0), (100.0, 40.0)],
            },
            Curve {
                label: "tgt".into(),
                points: vec![(0.0, 30.0), (50.0, 35.0), (99.9, 80.0)],
            },
        ];
        write_svg(&path, "4 KiB fua QD1", &curves).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for s in ["ramslog", "tgt", "4 KiB fua QD1", "p99"] {
            assert!(svg.contains(s), "{s} missing");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(write_svg(&path, "x", &[]).is_err());
    }
}
