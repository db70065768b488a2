#!/usr/bin/env bash
# Lab self-test: rxe is visible to ibv_devices, rping and ib_write_lat work.
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"

step "rxe up"
rxe_up
rdma link
ibv_devices | tee /tmp/devs
grep -q "$RXE_DEV_A" /tmp/devs

step "rping on $RXE_ADDR_A"
timeout 60 rping -s -a "$RXE_ADDR_A" -C 3 >/tmp/rping-server.log 2>&1 &
srv=$!
wait_rdma_listener 7174 "$srv" || { cat /tmp/rping-server.log; exit 1; }
timeout 40 rping -c -a "$RXE_ADDR_A" -C 3 -S 64 -v || { cat /tmp/rping-server.log; exit 1; }
wait "$srv"
echo "rping ok"

step "ib_write_lat on $RXE_DEV_A"
timeout 120 ib_write_lat -d "$RXE_DEV_A" -R -F -n 200 >/tmp/lat-server.log 2>&1 &
srv=$!
wait_rdma_listener 18515 "$srv" || { cat /tmp/lat-server.log; exit 1; }
timeout 120 ib_write_lat -d "$RXE_DEV_A" -R -F -n 200 "$RXE_ADDR_A" | sed -n '/#bytes/,$p'
wait "$srv"
echo "SELFTEST PASSED"
