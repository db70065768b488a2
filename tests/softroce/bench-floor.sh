#!/usr/bin/env bash
# rdma-bench's transport floor over SoftRoCE: `rdma-bench floor-server` on one
# rxe device's address (TCP and rdma_cm on the same port), then
#   - an RDMA floor client SIGKILLed mid-run (the server must keep serving),
#   - `rdma-bench floor --transport rdma` (SEND+block/SEND, SEND/RDMA READ/SEND,
#     ib_write_lat-style RDMA WRITE ping-pong, ib_read_lat-style RDMA READ),
#   - `rdma-bench floor --transport tcp` (48+bs out, 48 back),
# each with --json into build/softroce/results/floor-{rdma,tcp}.json, and the
# tables printed from that JSON. Client and server share one rxe address
# (rxe cannot connect across its two devices in one namespace).
#
# Build first (on the host):  cargo build -j1 -p rdma-bench
# Run:  tests/softroce/run tests/softroce/bench-floor.sh [SECONDS_PER_SHAPE] [BS]
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
SECS=${1:-2}
BS=${2:-4096}

BIN=${RDMA_BENCH_BIN:-$(pick_bin rdma-bench)} || { echo "build rdma-bench first: cargo build -j1 -p rdma-bench"; exit 1; }
SERVER_PID=
LOG=$RESULTS/floor-server.log

cleanup() {
  [ -n "$SERVER_PID" ] && stop_pid "$SERVER_PID"
  rxe_down
}

# The table of one `floor --json` result.
table() {
  python3 - "$1" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"transport floor: {j['addr']} over {j['transport']}, bs={j['bs']} qd=1, spin={j['spin']}")
cols = ["min", "p50", "p90", "p99", "p99_9", "max"]
print(f"{'shape':<28} {'I/Os':>8} {'secs':>5} {'IOPS':>7} " + " ".join(f"{c + ' us':>9}" for c in cols))
for s in j["samples"]:
    name = s["shape"] + (" *" if s["half_rtt"] else "")
    l = s["lat_us"]
    print(f"{name:<28} {s['ios']:>8} {s['secs']:>5.2f} {s['iops']:>7.0f} " + " ".join(f"{l[c]:>9.2f}" for c in cols))
if any(s["half_rtt"] for s in j["samples"]):
    print("* RTT/2, as perftest's ib_write_lat reports it; the other rows are full round trips.")
EOF
}

step "network: rxe on a veth pair"
rxe_up
trap cleanup EXIT
ibv_devices

ADDR="$RXE_ADDR_A:7470"
step "rdma-bench floor-server on $ADDR ($BIN)"
mkdir -p "$RESULTS"
# Spin budget 0: busy polling on emulated CPUs starves rxe and the client.
"$BIN" floor-server --listen "$ADDR" --spin 0 >"$LOG" 2>&1 &
SERVER_PID=$!
wait_for_log "$LOG" "listening on $ADDR (tcp and rdma_cm)" "$SERVER_PID" 20 ||
  { echo "floor-server is not listening on $ADDR"; exit 1; }
cat "$LOG"

fail=0
step "an RDMA floor client SIGKILLed mid-run"
"$BIN" floor "$ADDR" --transport rdma --time 30 --warmup 0 >/dev/null 2>&1 &
victim=$!
sleep 3
kill -9 "$victim" 2>/dev/null || { echo "the victim client ended early"; fail=1; }
wait "$victim" 2>/dev/null || true
kill -0 "$SERVER_PID" 2>/dev/null || { echo "floor-server died with its client"; fail=1; }

for t in rdma tcp; do
  step "rdma-bench floor $ADDR --transport $t --time $SECS --bs $BS"
  out=$RESULTS/floor-$t.json
  if timeout 300 "$BIN" floor "$ADDR" --transport "$t" --time "$SECS" --bs "$BS" --json >"$out.tmp"; then
    mv "$out.tmp" "$out"
    table "$out"
    echo "(JSON: $out)"
  else
    echo "rdma-bench floor --transport $t FAILED (exit $?)"
    fail=1
  fi
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "floor-server died"; fail=1; break; }
done

step "floor-server log"
cat "$LOG"
[ "$fail" = 0 ] || { echo "BENCH FLOOR FAILED"; exit 1; }
echo "BENCH FLOOR PASSED"
