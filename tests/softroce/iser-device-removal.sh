#!/usr/bin/env bash
# An RDMA device hot-removed under a live iSER session (SoftRoCE: `rdma link
# delete`), then added back. The kernel finishes removing a SoftRoCE device
# only once every process let go of it (rxe cannot detach a process), so a
# target that keeps its listener, its protection domain or its LUN
# registrations on the removed device holds the removal up forever. Checked:
# the removal completes within 30 s with the session up; the target stays up
# and iSCSI/TCP still serves the address; once the device is back the
# target listens for iSER there again by itself, and the Linux initiator's
# session recovers with the data intact.
#
# Build first (on the host):  cargo build -j2 -p ramslog-target --bin ramslog-target
# Run:  tests/softroce/run tests/softroce/iser-device-removal.sh
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
. "$HERE/lib/iscsi.sh"
IQN=iqn.2026-12.org.ramslog:device-removal
TARGET_BIN=${RAMSLOG_TARGET_BIN:-$(pick_bin ramslog-target)} || { echo "build ramslog-target first"; exit 1; }
TARGET_PID=
LOG=$RESULTS/ramslog-target-device-removal.log
# How long the removal may take: the target notices within a second.
REMOVAL_WAIT=30

cleanup() {
  iscsid_stop
  [ -n "$TARGET_PID" ] && stop_pid "$TARGET_PID"
  rxe_down
}

step "network: rxe on a veth pair"
rxe_up
iscsid_start
trap cleanup EXIT
INITIATOR=$(initiator_name)

step "ramslog-target on $RXE_ADDR_A:3260 ($TARGET_BIN)"
rc=0
target_start "$LOG" "iSER listening on $RXE_ADDR_A:3260" --size 64M --listen "$RXE_ADDR_A:3260" \
  --target-name "$IQN" --ephemeral --allow "$INITIATOR" --nop-interval 5 --iser-spin 0 || rc=$?
TARGET_PID=$TARGET_STARTED
[ "$rc" = 0 ] || { echo "ramslog-target is not listening for iSER"; exit 1; }

step "login over iSER, 1 MiB written"
iscsiadm -m discovery -t sendtargets -p "$RXE_ADDR_A:3260" -I iser >/dev/null
iscsiadm -m node -T "$IQN" -p "$RXE_ADDR_A:3260" -I iser -o update -n node.session.timeo.replacement_timeout -v 120
timeout 60 iscsiadm -m node -T "$IQN" -p "$RXE_ADDR_A:3260" -I iser --login
disk=$(iscsi_disk "$IQN")
dd if=/dev/urandom of=/tmp/removal-pattern bs=1M count=1 status=none
dd if=/tmp/removal-pattern of="$disk" bs=1M count=1 seek=10 oflag=direct status=none
cmp <(dd if="$disk" bs=1M count=1 skip=10 iflag=direct status=none) /tmp/removal-pattern
echo "written and read back on $disk"

step "rdma link delete $RXE_DEV_A with the session up: done within $REMOVAL_WAIT s"
t0=$(date +%s)
rdma link delete "$RXE_DEV_A" &
deleter=$!
for ((i = 0; i < REMOVAL_WAIT * 5; i++)); do
  kill -0 "$deleter" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$deleter" 2>/dev/null; then
  echo "rdma link delete still waits after $REMOVAL_WAIT s; where it waits:"
  cat "/proc/$deleter/stack" 2>/dev/null || true
  echo "target log:"; tail -n 20 "$LOG"
  echo "DEVICE REMOVAL FAILED: the target holds the removed device"
  # The cleanup stops the target, which lets the removal finish.
  exit 1
fi
wait "$deleter" || { echo "rdma link delete failed"; exit 1; }
echo "removed in $(($(date +%s) - t0)) s"
kill -0 "$TARGET_PID" || { echo "ramslog-target died"; exit 1; }
wait_for_log "$LOG" "RDMA device under $RXE_ADDR_A:3260 was removed" "$TARGET_PID" 10

step "iSCSI/TCP still serves $RXE_ADDR_A:3260"
iscsiadm -m discovery -t sendtargets -p "$RXE_ADDR_A:3260" -I default -o nonpersistent | grep -q "$IQN"
echo "SendTargets over TCP answered"

step "rdma link add $RXE_DEV_A: the target listens again, the session recovers, the data is intact"
rdma link add "$RXE_DEV_A" type rxe netdev rsl-a
wait_for_log "$LOG" "iSER listening on $RXE_ADDR_A:3260 again" "$TARGET_PID" 30
grep "listening on $RXE_ADDR_A:3260 again" "$LOG"
recovered=
for ((i = 0; i < 90; i++)); do
  if iscsiadm -m session -P1 2>/dev/null | grep -q "iSCSI Session State: LOGGED_IN"; then
    recovered=yes
    break
  fi
  sleep 1
done
[ -n "$recovered" ] || { iscsi_diagnostics; echo "the iSER session did not recover in 90 s"; exit 1; }
echo "session logged in again after $i s"
disk=$(iscsi_disk "$IQN")
cmp <(dd if="$disk" bs=1M count=1 skip=10 iflag=direct status=none) /tmp/removal-pattern
dd if=/tmp/removal-pattern of="$disk" bs=1M count=1 seek=20 oflag=direct status=none
cmp <(dd if="$disk" bs=1M count=1 skip=20 iflag=direct status=none) /tmp/removal-pattern
echo "data intact; new writes land"
iscsiadm -m session -P1 | grep -q "Iface Transport: iser" || { echo "the session is not on iSER"; exit 1; }
kill -0 "$TARGET_PID" || { echo "ramslog-target died"; exit 1; }
echo "DEVICE REMOVAL PASSED"
