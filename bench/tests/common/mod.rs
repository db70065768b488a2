//! What both rdma-bench test binaries run it with.

use std::process::{Command, Output};

use serde_json::Value;

/// `rdma-bench ARGS`, run to the end.
pub fn rdma_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rdma-bench"))
        .args(args)
        .output()
        .expect("run rdma-bench")
}

/// `rdma-bench` with the words of `line` (no word may hold a space).
pub fn rdma_bench_line(line: &str) -> Output {
    rdma_bench(&line.split_whitespace().collect::<Vec<_>>())
}

/// The JSON a successful run printed; a failed run panics with its stderr.
pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "rdma-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// What a successful run printed; a failed run panics with its stderr.
pub fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "rdma-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
