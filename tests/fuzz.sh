#!/usr/bin/env bash
# Run every cargo-fuzz target of common/fuzz for SECONDS each (default 20).
# Stable Rust: RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z flags; no sanitizer
# runtime ships with stable, so the targets run without one (asserts and
# panics are what they catch).
set -euo pipefail
cd "$(dirname "$0")/../common"
SECONDS_EACH=${1:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked -j2
export RUSTC_BOOTSTRAP=1
for t in $(cargo fuzz list); do
  echo "--- fuzz $t (${SECONDS_EACH}s)"
  cargo fuzz run --sanitizer none -j1 "$t" -- -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 2>&1 | tail -3
done
