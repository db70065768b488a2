#!/usr/bin/env bash
# Run every cargo-fuzz target for SECONDS each (default 20): the decoders
# (common/fuzz) and the engine fed arbitrary PDU sequences (target/fuzz).
# Stable Rust: RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z flags; no sanitizer
# runtime ships with stable, so the targets run without one (asserts and
# panics are what they catch).
# Both crates build into the workspace's one build directory (build/, from
# .cargo/config.toml), so what they share (libFuzzer itself) is built once.
# Each target is single-threaded: they run FUZZ_PARALLEL (default: the
# number of cores) at a time, every one for its full SECONDS, from its
# working corpus (CRATE/fuzz/corpus/TARGET, not committed) and its committed
# seeds (CRATE/fuzz/seeds/TARGET, where there are some). A target that the
# manifests declare and `cargo fuzz list` does not name, or a list that
# fails, fails the run.
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
  # Not `for t in $(cargo fuzz list)`: a failing list would be an empty loop.
  targets=$(cd "$crate" && cargo fuzz list) || { echo "fuzz: cargo fuzz list failed in $crate" >&2; exit 1; }
  [ -n "$targets" ] || { echo "fuzz: $crate/fuzz lists no target" >&2; exit 1; }
  for t in $targets; do jobs+=("$crate/$t"); done
done
# Every fuzz target of the manifests runs: a target cargo-fuzz stopped
# listing would otherwise drop out unnoticed.
declared=$(sed -n 's/^name = "\([a-z_]*\)"$/\1/p' common/fuzz/Cargo.toml target/fuzz/Cargo.toml |
  grep -v -e '^ramslog' | sort)
listed=$(printf '%s\n' "${jobs[@]#*/}" | sort)
[ "$declared" = "$listed" ] || { echo "fuzz: the manifests declare $(echo $declared), cargo fuzz lists $(echo $listed)" >&2; exit 1; }
run_one() { # CRATE/TARGET: its output goes to a log, its tail is shown
  local crate=${1%%/*} t=${1#*/} rc=0 corpus
  # The working corpus (ignored by git) first, libFuzzer adds to it; then
  # the committed seeds, read only: valid PDUs, keys, sense and headers,
  # so that each run starts from inputs the decoders accept.
  corpus=("$PWD/$crate/fuzz/corpus/$t")
  mkdir -p "${corpus[0]}"
  [ -d "$PWD/$crate/fuzz/seeds/$t" ] && corpus+=("$PWD/$crate/fuzz/seeds/$t")
  (cd "$crate" && cargo fuzz run --sanitizer none -j1 "$t" "${corpus[@]}" -- \
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
