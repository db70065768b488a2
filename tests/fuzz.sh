#!/usr/bin/env bash
# Run every cargo-fuzz target for SECONDS each (default 20): the decoders
# (common/fuzz) and the engine fed arbitrary PDU sequences (target/fuzz).
# Stable Rust: RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z flags; no sanitizer
# runtime ships with stable, so the targets run without one (asserts and
# panics are what they catch).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked -j2
export RUSTC_BOOTSTRAP=1 CARGO_BUILD_JOBS=2
for crate in common target; do
  (
    cd "$crate"
    for t in $(cargo fuzz list); do
      echo "--- fuzz $crate/$t (${SECONDS_EACH}s)"
      cargo fuzz run --sanitizer none -j1 "$t" -- -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 2>&1 | tail -3
    done
  )
done
