#!/usr/bin/env bash
# Run every cargo-fuzz target for SECONDS each (default 20): the decoders
# (common/fuzz) and the engine fed arbitrary PDU sequences (target/fuzz).
# Stable Rust: RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z flags; no sanitizer
# runtime ships with stable, so the targets run without one (asserts and
# panics are what they catch).
# Both crates build into the workspace's one build directory (build/, from
# .cargo/config.toml), so what they share (libFuzzer itself) is built once.
# Each target is single-threaded: they run FUZZ_PARALLEL (default: the
# number of cores) at a time, every one for its full SECONDS.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-20}
PARALLEL=${FUZZ_PARALLEL:-$(nproc)}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked -j2
export RUSTC_BOOTSTRAP=1 CARGO_BUILD_JOBS=2
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
jobs=()
for crate in common target; do
  echo "--- fuzz: building $crate/fuzz"
  (cd "$crate" && cargo fuzz build --sanitizer none)
  for t in $(cd "$crate" && cargo fuzz list); do jobs+=("$crate/$t"); done
done
run_one() { # CRATE/TARGET: its output goes to a log, its tail is shown
  local crate=${1%%/*} t=${1#*/} rc=0
  (cd "$crate" && cargo fuzz run --sanitizer none -j1 "$t" -- \
    -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048) >"$logs/${crate}_$t.log" 2>&1 || rc=$?
  echo "--- fuzz $crate/$t (${SECONDS_EACH}s): $([ "$rc" = 0 ] && echo ok || echo "FAILED ($rc)")"
  tail -3 "$logs/${crate}_$t.log"
  return "$rc"
}
failed=0
running=()
for job in "${jobs[@]}"; do
  run_one "$job" &
  running+=($!)
  if ((${#running[@]} >= PARALLEL)); then
    wait "${running[0]}" || failed=$((failed + 1))
    running=("${running[@]:1}")
  fi
done
for pid in "${running[@]}"; do wait "$pid" || failed=$((failed + 1)); done
((failed == 0)) || { echo "fuzz: $failed target(s) failed" >&2; exit 1; }
echo "fuzz: ${#jobs[@]} targets, ${SECONDS_EACH} s each, $PARALLEL at a time: no crash"
