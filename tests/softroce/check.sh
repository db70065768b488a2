#!/usr/bin/env bash
# The SoftRoCE tier of the README test command: harness exit-code check, lab
# self-test, LIO iSER peer baseline, ramslog-target with the Linux kernel
# initiator over TCP and over iSER, ramslog-initiator's iSER transport
# (Linux and illumos profiles), rdma-bench over rxe (floor, ramslog vs LIO,
# --softroce), and the ZFS end to end (zfs/run: pool with a mirrored log on two
# ramslog boxes, failures and recovery). Each boots its own guest (or runs on
# this host when its kernel has rdma_rxe).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if ! command -v qemu-system-x86_64 >/dev/null && [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = true ]; then
    echo "softroce: qemu-system-x86_64 is missing and this is not root: CI cannot run the lab" >&2
    exit 1
  fi
  echo "SKIPPED softroce: qemu-system-x86_64 is not installed and installing it needs root (apt-get install qemu-system-x86)"
  exit 0
fi
fail=0
t0=$(date +%s)
"$HERE/run" --prepare-only || exit 1
echo "softroce: prepare $(($(date +%s) - t0)) s"

"$HERE/run" "$HERE/expect-exit.sh" 3 >/tmp/softroce-exit.log 2>&1
rc=$?
if [ "$rc" = 3 ]; then echo "softroce: harness returns the script's exit code (3): ok"; else
  echo "softroce: harness returned $rc for a script that exits 3" >&2; tail -20 /tmp/softroce-exit.log >&2; fail=1; fi

for t in selftest.sh lio-baseline.sh "ramslog-open-iscsi.sh tcp" "ramslog-open-iscsi.sh iser" iser-initiators.sh bench-floor.sh bench-iser.sh; do
  t1=$(date +%s)
  # shellcheck disable=SC2086 # the script and its argument
  if "$HERE/run" "$HERE/"$t; then echo "softroce: $t passed in $(($(date +%s) - t1)) s"; else
    echo "softroce: $t FAILED" >&2; fail=1; fi
done
t1=$(date +%s)
if "$HERE/zfs/run"; then echo "softroce: zfs/run passed in $(($(date +%s) - t1)) s"; else
  echo "softroce: zfs/run FAILED" >&2; fail=1; fi
echo "softroce: total $(($(date +%s) - t0)) s"
exit $fail
