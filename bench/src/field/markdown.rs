//! report.md.

use super::*;

pub(super) fn us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "-".into()
    }
}

pub(super) fn markdown(r: &FieldReport) -> String {
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
