#!/usr/bin/env bash
# Peer baseline: LIO (kernel target) with a RAM backstore exported over iSER,
# logged in by open-iscsi through its `iser` iface, measured with the lab's
# sync-write fio job. Results: $RESULTS/lio-iser.json.
#
# Other scripts reuse the pieces (lib/rxe.sh, lib/iscsi.sh, lib/fio.sh and
# lio_export below), so ramslog-target can run through the same fio job in the
# same boot and the two can be compared.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
RESULTS=${RESULTS:-$REPO/build/softroce/results}
SECS=${FIO_SECONDS:-15}
. "$HERE/lib/rxe.sh"
. "$HERE/lib/iscsi.sh"
. "$HERE/lib/fio.sh"
IQN=iqn.2026-11.org.ramslog.lab:lio-rd0
step() { echo; echo "== $*"; }

# LIO through configfs (targetcli-fb wants a system D-Bus the guest lacks;
# configfs is what it writes anyway): a 256 MiB rd_mcp ramdisk on ADDR:PORT
# (3260 unless given), iSER-enabled unless TRANSPORT is tcp.
lio_export() {
  local iqn=$1 addr=$2 name=$3 transport=${4:-iser} port=${5:-3260}
  local c=/sys/kernel/config/target tpg=/sys/kernel/config/target/iscsi/$1/tpgt_1
  modprobe target_core_mod && modprobe iscsi_target_mod && modprobe ib_isert
  mkdir -p "$c/core/rd_mcp_0/$name"
  echo rd_pages=65536 >"$c/core/rd_mcp_0/$name/control"
  echo 1 >"$c/core/rd_mcp_0/$name/enable"
  mkdir -p "$tpg/lun/lun_0"
  ln -s "$c/core/rd_mcp_0/$name" "$tpg/lun/lun_0/$name"
  mkdir "$tpg/np/$addr:$port"
  if [ "$transport" = iser ]; then echo 1 >"$tpg/np/$addr:$port/iser"; fi
  local kv
  for kv in authentication=0 generate_node_acls=1 demo_mode_write_protect=0 cache_dynamic_acls=1; do
    echo "${kv#*=}" >"$tpg/attrib/${kv%=*}"
  done
  echo 1 >"$tpg/enable"
}

lio_remove() {
  local iqn=$1 addr=$2 name=$3 port=${4:-3260}
  local c=/sys/kernel/config/target tpg=/sys/kernel/config/target/iscsi/$1/tpgt_1
  echo 0 >"$tpg/enable"
  rm "$tpg/lun/lun_0/$name"
  rmdir "$tpg/lun/lun_0" "$tpg/np/$addr:$port" "$tpg" "$c/iscsi/$iqn" "$c/core/rd_mcp_0/$name"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
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
fi
