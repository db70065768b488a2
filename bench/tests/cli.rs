//! rdma-bench against a real ramslog-target over 127.0.0.1: `lat`, `compare`
//! and `sweep` end to end, their JSON and plots, and the errors a user sees.

use std::process::Output;

use ramslog_tests::TargetProcess;

mod common;
use common::{json_of, rdma_bench, rdma_bench_line, stdout_of};
use serde_json::Value;

fn bench(args: &[&str]) -> Output {
    rdma_bench(args)
}

fn p50(result: &Value) -> f64 {
    result["summary"]["lat_us"]["p50"].as_f64().expect("p50")
}

#[test]
fn lat_reports_json_with_machine_target_and_plot() {
    let t = TargetProcess::start();
    let url = t.url(0);
    let dir = std::env::temp_dir().join(format!("rdma-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("lat.svg");
    let svg_arg = svg.to_str().unwrap();
    for pattern in ["fua", "zil", "write", "read", "randread"] {
        let out = bench(&[
            "lat",
            &url,
            "--pattern",
            pattern,
            "--count",
            "300",
            "--warmup",
            "0",
            "--json",
            "--plot",
            svg_arg,
        ]);
        let v = json_of(&out);
        assert_eq!(v["command"], "lat");
        assert_eq!(v["workload"]["pattern"], pattern);
        let r = &v["results"][0];
        assert_eq!(r["summary"]["ios"], 300, "{pattern}");
        assert!(p50(r) > 0.0);
        assert!(r["summary"]["lat_us"]["p99"].as_f64().unwrap() >= p50(r));
        assert_eq!(r["target"]["transport"], "iscsi/tcp");
        assert!(r["target"]["product"]
            .as_str()
            .unwrap()
            .starts_with("RAMSLOG"));
        assert!(!r["target"]["negotiated"].as_array().unwrap().is_empty());
        assert!(!v["machine"]["kernel"].as_str().unwrap().is_empty());
        let plot = std::fs::read_to_string(&svg).unwrap();
        assert!(plot.starts_with("<svg") && plot.contains("p99"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lat_table_by_default() {
    let t = TargetProcess::start();
    let out = rdma_bench_line(&format!("lat {} --qd 4 --time 0.5 --warmup 0.1", t.url(0)));
    let text = stdout_of(&out);
    assert!(text.contains("4 KiB Write QD4"), "{text}");
    assert!(text.contains("p99.9 µs") && text.contains("IOPS"), "{text}");
}

#[test]
fn compare_interleaves_targets_and_gives_ratios() {
    let a = TargetProcess::start();
    let b = TargetProcess::start();
    let out = rdma_bench_line(&format!(
        "compare {} {} --time 1 --rounds 2 --warmup 0.1 --json",
        a.url(0),
        b.url(0)
    ));
    let v = json_of(&out);
    assert_eq!(v["rounds"], 2);
    let r = v["results"].as_array().unwrap();
    assert_eq!(r.len(), 2);
    assert!(r[0]["p50_ratio"].is_null(), "the first is the reference");
    let ratio = r[1]["p50_ratio"].as_f64().unwrap();
    assert!((ratio - p50(&r[1]) / p50(&r[0])).abs() < 1e-6);
    assert!(r[1]["iops_ratio"].as_f64().unwrap() > 0.0);
    assert!(r.iter().all(|x| x["summary"]["ios"].as_u64().unwrap() > 0));
}

#[test]
fn sweep_covers_every_cell() {
    let t = TargetProcess::start();
    let out = rdma_bench_line(&format!(
        "sweep {} --bs 512,4K,64K --qd 1,4 --time 0.3 --warmup 0 --json",
        t.url(0)
    ));
    let v = json_of(&out);
    let cells = v["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 6);
    let mut seen: Vec<(u64, u64)> = cells
        .iter()
        .map(|c| (c["bs"].as_u64().unwrap(), c["qd"].as_u64().unwrap()))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (512, 1),
            (512, 4),
            (4096, 1),
            (4096, 4),
            (65536, 1),
            (65536, 4)
        ]
    );
    assert!(cells
        .iter()
        .all(|c| c["summary"]["ios"].as_u64().unwrap() > 0));
}

#[test]
fn user_errors_are_clear() {
    let t = TargetProcess::start();
    let url = t.url(0);
    let out = bench(&["lat", &url, "--bs", "1000", "--count", "1", "--warmup", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("not a multiple of the LUN's 512-byte blocks"));

    let wrong = url.replace(
        ramslog_tests::DEFAULT_TARGET_NAME,
        "iqn.2026-11.org.ramslog:nope",
    );
    let out = bench(&["lat", &wrong, "--count", "1", "--warmup", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("login"));

    let out = bench(&["lat", "http://x/y/0"]);
    assert!(!out.status.success());

    let out = bench(&["sweep", &url, "--bs", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a block size"));
}
