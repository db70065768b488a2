#!/usr/bin/env bash
# The loopback comparison of issue 5's acceptance, in one run per workload:
# ramslog-target vs Debian tgt (LUN in /dev/shm) over iSCSI/TCP on 127.0.0.1,
# interleaved in rounds, with the TCP transport floor measured in the same
# run. Writes bench/results/loopback-{fua-qd1,write-qd32}.{json,svg}.
#   bench/run-loopback.sh [SECONDS_PER_TARGET]     (root: starts tgtd)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-20}
cargo build -j2 --release -p ramslog-target -p rdma-bench
B=build/release
OUT=bench/results
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; bench/peers/tgt.sh stop; }
trap cleanup EXIT
"$B/rdma-bench" floor-server --no-rdma --listen 127.0.0.1:7470 2>/dev/null &
PIDS+=($!)
"$B/ramslog-target" --size 1G --ephemeral --listen 127.0.0.1:3262 \
  --target-name iqn.2026-11.org.ramslog:bench >/tmp/ramslog-bench-target.log 2>&1 &
PIDS+=($!)
TGT=$(bench/peers/tgt.sh start 3261)
sleep 1
RAMSLOG=iscsi://127.0.0.1:3262/iqn.2026-11.org.ramslog:bench/0
for w in "fua 1" "write 32"; do
  set -- $w
  name=loopback-$1-qd$2
  "$B/rdma-bench" compare "$RAMSLOG" "$TGT" --pattern "$1" --qd "$2" --time "$SECS" --rounds 5 \
    --floor 127.0.0.1:7470 --quiet --plot "$OUT/$name.svg" --json >"$OUT/$name.json"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
w = j["workload"]
print(f"\n{w['bs']} B {w['pattern']} QD{w['qd']}, {j['rounds']} rounds ({j['machine']['kernel']}, {j['machine']['cpus']} CPUs)")
print(f"{'target':<16} {'IOPS':>8} {'p50 us':>8} {'p99 us':>8} {'p50 ratio':>9} {'IOPS ratio':>10} {'adds us':>8}")
for r in j["results"]:
    s = r["summary"]; l = s["lat_us"]
    name = r["target"]["product"].split()[0]
    adds = r.get("target_adds_us")
    print(f"{name:<16} {s['iops']:>8.0f} {l['p50']:>8.1f} {l['p99']:>8.1f} {r.get('p50_ratio') or 1:>9.2f} "
          f"{r.get('iops_ratio') or 1:>10.2f} {adds if adds is not None else float('nan'):>8.1f}")
for f in j["floors"]:
    l = f["summary"]["lat_us"]
    print(f"{'floor ' + f['shape']:<16} {f['summary']['iops']:>8.0f} {l['p50']:>8.1f} {l['p99']:>8.1f}")
PY
done
