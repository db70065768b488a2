//! Where a measurement ran, for JSON reports: numbers travel, and a number
//! without its machine and kernel means little.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub hostname: String,
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
    pub rdma_bench: &'static str,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

impl Machine {
    pub fn here() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines().find_map(|l| {
                    l.strip_prefix("model name")
                        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
                })
            })
            .unwrap_or_else(|| "unknown".into());
        Machine {
            hostname: read_trimmed("/proc/sys/kernel/hostname"),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            cpu,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            rdma_bench: env!("CARGO_PKG_VERSION"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn describes_this_machine() {
        let m = super::Machine::here();
        assert!(m.cpus >= 1);
        assert_ne!(m.kernel, "");
        assert!(!m.rdma_bench.is_empty());
    }
}
