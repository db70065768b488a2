#!/usr/bin/env bash
# The verbs wrapper (ramslog_common::verbs) against real RDMA: the
# verbs_pingpong example as server and client on one rxe device's address
# (rdma_cm RC connect with private data, SEND/RECV round trips, RDMA READ,
# RDMA WRITE chained with a SEND, READ back, byte checks on both sides,
# disconnect), then a connect to a port nobody listens on (Rejected).
#
# Build first (on the host):
#   cargo build -j1 -p ramslog-common --features rdma --example verbs_pingpong
# Run:  tests/softroce/run tests/softroce/verbs-pingpong.sh [ROUND_TRIPS]
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
BIN=${VERBS_PINGPONG:-$REPO/build/debug/examples/verbs_pingpong}
ROUNDS=${1:-1000}
[ -x "$BIN" ] || {
  echo "missing $BIN: cargo build -j1 -p ramslog-common --features rdma --example verbs_pingpong"
  exit 1
}
LOGDIR=$(mktemp -d /tmp/verbs-pingpong.XXXXXX)

step "rxe up"
rxe_up
"$BIN" probe

ADDR="$RXE_ADDR_A:7471"
step "server and client on $ADDR ($ROUNDS round trips)"
timeout 120 "$BIN" server "$ADDR" >"$LOGDIR/server.log" 2>&1 &
srv=$!
# The client's own error says enough if the server never listens.
wait_for_log "$LOGDIR/server.log" listening "$srv" 5 || true
crc=0
timeout 120 "$BIN" client "$ADDR" "$ROUNDS" >"$LOGDIR/client.log" 2>&1 || crc=$?
src=0
wait "$srv" || src=$?
echo "-- server (exit $src)"
cat "$LOGDIR/server.log"
echo "-- client (exit $crc)"
cat "$LOGDIR/client.log"
[ "$crc" = 0 ] && [ "$src" = 0 ] || { echo "VERBS PINGPONG FAILED"; exit 1; }
grep -q '^pingpong ok' "$LOGDIR/client.log" || { echo "VERBS PINGPONG FAILED: no 'pingpong ok'"; exit 1; }

step "client to a port nobody listens on: rejected, clean exit 1"
rc=0
timeout 60 "$BIN" client "$RXE_ADDR_A:7472" 1 >"$LOGDIR/reject.log" 2>&1 || rc=$?
cat "$LOGDIR/reject.log"
[ "$rc" = 1 ] && grep -q 'rejected the connection' "$LOGDIR/reject.log" || { echo "VERBS PINGPONG FAILED: expected a rejection (exit $rc)"; exit 1; }
echo "VERBS PINGPONG PASSED"
