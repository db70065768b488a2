#!/usr/bin/env bash
# Peer baseline: LIO (kernel target) with a RAM backstore exported over iSER,
# logged in by open-iscsi through its `iser` iface, measured with the lab's
# sync-write fio job. Results: $RESULTS/lio-iser.json.
#
# Other scripts reuse the pieces (lib/rxe.sh, lib/iscsi.sh, lib/fio.sh and
# lib/lio.sh), so ramslog-target can run through the same fio job in the same
# boot and the two can be compared.
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
# Reported, not asserted: 8 s of QD1 sync writes is thousands of I/Os even
# under emulation, enough for a stable p50 (FIO_SECONDS for longer runs).
SECS=${FIO_SECONDS:-8}
. "$HERE/lib/iscsi.sh"
. "$HERE/lib/fio.sh"
. "$HERE/lib/lio.sh"
IQN=iqn.2026-11.org.ramslog.lab:lio-rd0

step "rxe up"
rxe_up
step "LIO: $IQN on $RXE_ADDR_A:3260 (iSER)"
lio_export "$IQN" "$RXE_ADDR_A" rd0
step "open-iscsi: discover and log in through the iser iface"
iscsid_start
trap 'iscsid_stop; rxe_down' EXIT
iscsiadm -m discovery -t sendtargets -p "$RXE_ADDR_A:3260" -I iser
timeout 90 iscsiadm -m node -T "$IQN" -p "$RXE_ADDR_A:3260" -I iser --login
iscsiadm -m session -P1 | grep -E 'Iface Transport|Iface Name|Session State'
iscsiadm -m session -P1 | grep -q 'Iface Transport: iser'
disk=$(iscsi_disk "$IQN")
echo "disk $disk: $(blockdev --getsize64 "$disk") bytes"
step "fio: 4 KiB random sync writes, QD1, ${SECS} s"
fio_sync_qd1 lio-iser "$disk" "$SECS" "$RESULTS"
timeout 60 iscsiadm -m node -T "$IQN" -p "$RXE_ADDR_A:3260" --logout
lio_remove "$IQN" "$RXE_ADDR_A" rd0
echo "LIO BASELINE PASSED: $RESULTS/lio-iser.json"
