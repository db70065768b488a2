#!/usr/bin/env bash
# The SoftRoCE tier of the README test command, in two guest boots:
#  1. the short lab scripts (SUITE below) one after the other in one guest
#     (suite.sh): lab self-test, LIO iSER peer baseline, ramslog-target with
#     the Linux kernel initiator over TCP and over iSER, an RDMA device
#     hot-removed under an iSER session and added back, ramslog-initiator's
#     iSER transport (Linux and illumos profiles, aborts, floods), rdma-bench
#     over rxe (floor, ramslog vs LIO). If a script leaves the guest off its
#     baseline, the rest run in a fresh guest. The suite's exit code (64 +
#     failures) is checked against its results: the harness hands the guest's
#     exit code back.
#  2. the ZFS end to end (zfs/run: a pool with a mirrored log on two ramslog
#     boxes, failures and recovery), in its own 6 GiB guest; then, in a
#  3. third boot, ramslog's .deb under Debian's systemd 252 as the guest's
#     PID 1 (systemd.sh: reload, kill -9, OOM kill, a crash loop,
#     daemon-reload, a broken binary, a dpkg -i upgrade, systemctl kill, a
#     stop during start-up).
# The two boots run at the same time: under emulation each guest keeps the
# host's two cores only about half busy (its scripts wait on QD1 round
# trips, timers and one another), so together they fill the idle time
# instead of doubling the lab's wall clock (RAMSLOG_LAB_SERIAL=1: one after
# the other). The ZFS run's output is prefixed "[zfs] ". Together the two
# guests have no more vCPUs than the host has cores (one each here): with
# more vCPU threads than cores, a guest's vCPU spins on a lock its preempted
# sibling holds (measured: two 2-vCPU guests on two cores took 312 s for the
# TCP verify matrix that takes 60 s alone, and 73 s with one vCPU each).
# Runs on this host instead when its kernel has rdma_rxe.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
if ! command -v qemu-system-x86_64 >/dev/null && [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = true ]; then
    echo "softroce: qemu-system-x86_64 is missing and this is not root: CI cannot run the lab" >&2
    exit 1
  fi
  echo "SKIPPED softroce: qemu-system-x86_64 is not installed and installing it needs root (apt-get install qemu-system-x86)"
  exit 0
fi
# Per-script timeouts (seconds) are generous: under emulation a slow day
# runs 1.7x the usual time.
# lio-baseline.sh is not here: ramslog-open-iscsi.sh iser runs the same LIO
# export through the same fio job in its own boot (results/lio-iser.json).
SUITE="600:selftest.sh
1200:ramslog-open-iscsi.sh tcp
1200:ramslog-open-iscsi.sh iser
600:iser-device-removal.sh
900:iser-initiators.sh
600:bench-floor.sh
900:bench-iser.sh"
fail=0
t0=$(date +%s)
"$HERE/run" --prepare-only || exit 1
echo "softroce: prepare $(($(date +%s) - t0)) s"

mkdir -p "$REPO/build/softroce"
zfs_result=$REPO/build/softroce/zfs-run.rc
rm -f "$zfs_result"
# zfs/run: its exit code to a file (a pipeline's status would be sed's).
zfs_run() {
  local t1 rc
  t1=$(date +%s)
  { "$HERE/zfs/run"; echo $? >"$zfs_result"; } 2>&1 | sed -u 's/^/[zfs] /'
  rc=$(cat "$zfs_result" 2>/dev/null || echo 125)
  echo "softroce: zfs/run $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $(($(date +%s) - t1)) s"
  [ -n "${RAMSLOG_TIMES:-}" ] && printf 'lab\tzfs/run (its own boot, module build included)\t%s\t%s\n' \
    "$([ "$rc" = 0 ] && echo passed || echo FAILED)" $(($(date +%s) - t1)) >>"$RAMSLOG_TIMES"
  return 0
}
# The package the systemd boot installs (the release binaries are built).
deb=$REPO/$("$REPO/target/debian/build-deb.sh" 2>"$REPO/build/softroce/build-deb.log") ||
  { tail -20 "$REPO/build/softroce/build-deb.log"; echo "softroce: building the .deb failed" >&2; exit 1; }
upgrade=$REPO/build/deb/ramslog-upgrade-lab.deb
"$HERE/systemd.sh" --upgrade-package "$deb" "$upgrade" ||
  { echo "softroce: building the upgrade package for systemd.sh failed" >&2; exit 1; }
systemd_result=$REPO/build/softroce/systemd-run.rc
rm -f "$systemd_result"
systemd_run() {
  local t1 rc
  t1=$(date +%s)
  { RAMSLOG_SOFTROCE_MODE=guest RAMSLOG_SOFTROCE_INIT=systemd RAMSLOG_SOFTROCE_TIMEOUT=900 \
    "$HERE/run" "$HERE/systemd.sh" "$deb" "$upgrade"; echo $? >"$systemd_result"; } 2>&1 | sed -u 's/^/[systemd] /'
  rc=$(cat "$systemd_result" 2>/dev/null || echo 125)
  echo "softroce: systemd.sh $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $(($(date +%s) - t1)) s"
  [ -n "${RAMSLOG_TIMES:-}" ] && printf 'lab\tsystemd.sh (its own boot, systemd as PID 1)\t%s\t%s\n' \
    "$([ "$rc" = 0 ] && echo passed || echo FAILED)" $(($(date +%s) - t1)) >>"$RAMSLOG_TIMES"
  return 0
}
zfs_pid=
if [ "${RAMSLOG_LAB_SERIAL:-0}" != 1 ]; then
  half=$(($(nproc) / 2))
  export RAMSLOG_SOFTROCE_SMP=${RAMSLOG_SOFTROCE_SMP:-$((half > 0 ? half : 1))}
  # The ZFS run is the shorter of the two: the systemd boot follows it.
  { zfs_run; systemd_run; } &
  zfs_pid=$!
fi

list=$REPO/build/softroce/suite.list
echo "$SUITE" >"$list"
results=$REPO/build/softroce/results/suite.tsv
all=$REPO/build/softroce/results/suite-all.tsv
: >"$all"
for boot in 1 2 3; do
  t1=$(date +%s)
  RAMSLOG_SOFTROCE_TIMEOUT=${RAMSLOG_SOFTROCE_TIMEOUT:-5400} "$HERE/run" "$HERE/suite.sh" "$list"
  rc=$?
  cat "$results" >>"$all" 2>/dev/null
  failures=$(awk -F'\t' '$2 != 0' "$results" 2>/dev/null | wc -l)
  if [ "$rc" = $((64 + failures)) ]; then
    echo "softroce: suite boot $boot: $failures failed; the harness returned the guest's exit code ($rc): ok ($(($(date +%s) - t1)) s)"
  else
    echo "softroce: suite boot $boot returned $rc, but its results say $failures failed (expected $((64 + failures)))" >&2
    fail=1
  fi
  [ "$failures" = 0 ] || fail=1
  [ -s "$list.rest" ] || break
  mv "$list.rest" "$list"
done
[ -s "$list.rest" ] && { echo "softroce: scripts left unrun after three boots: $(tr '\n' ' ' <"$list.rest")" >&2; fail=1; }
echo "softroce: the short scripts:"
awk -F'\t' '{ printf "  %-32s %s in %s s\n", $1, ($2 == 0 ? "passed" : "FAILED (exit " $2 ")"), $3 }' "$all"
# A failed script's end, here where a CI summary that keeps only the tail of
# the output still shows it (the whole output streamed above).
while IFS=$'\t' read -r entry rc _ log; do
  [ "$rc" != 0 ] && [ -s "${log:-}" ] || continue
  echo "softroce: the last 40 lines of $entry (all of it: $log):"
  tail -n 40 "$log" | sed 's/^/  | /'
done <"$all"

if [ -n "$zfs_pid" ]; then
  echo "softroce: waiting for zfs/run and systemd.sh (running beside the suite since the start)"
  wait "$zfs_pid"
else
  zfs_run
  systemd_run
fi
[ "$(cat "$zfs_result" 2>/dev/null)" = 0 ] || fail=1
[ "$(cat "$systemd_result" 2>/dev/null)" = 0 ] || fail=1
echo "softroce: total $(($(date +%s) - t0)) s"
exit $fail
