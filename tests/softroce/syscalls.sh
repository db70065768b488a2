#!/usr/bin/env bash
# Syscalls per I/O on ramslog-target's iSER connection thread: a measurement,
# with one bound. Spinning (a large --iser-spin), the loop itself makes no
# syscall per I/O (docs/design.md, rules of the data path): besides rxe's
# doorbell `write`s the thread may make only its fixed set-up and teardown
# calls (thread start, registrations, verbs ioctls: about 80 here), at most
# SYSCALLS_FIXED_MAX (150) in all, over at least 250 I/Os, so that one call
# per I/O would break the bound. The sleeping loop's wake-ups are its
# documented price and only printed.
#
#   tests/softroce/run tests/softroce/syscalls.sh [IOS]
#   tests/softroce/run env SYSCALLS_BINS="before=/path/a after=/path/b" tests/softroce/syscalls.sh
#
# SYSCALLS_BINS compares builds of ramslog-target in one boot (label=path,
# paths inside the repository so the guest sees them).
#
# For --iser-spin 0 (sleep on the completion channel) and a large spin budget:
# rdma-bench writes IOS 4 KiB blocks at QD1 over iSER while strace follows every
# thread of the target; the connection's thread is the one that made the most
# calls. Printed per I/O, by syscall. rxe's own doorbells show as `write` on
# /dev/infiniband/uverbs* (post_send and req_notify_cq); everything else is the
# loop's. strace slows each call, never changes which calls are made.
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
IOS=${1:-2000}
BENCH=$(pick_bin rdma-bench) || { echo "build rdma-bench first"; exit 1; }
CURRENT=$(pick_bin ramslog-target) || { echo "build ramslog-target first"; exit 1; }
read -r -a BINS <<<"${SYSCALLS_BINS:-current=$CURRENT}"
# perf counts syscalls in the kernel (tracepoints) and barely slows the loop;
# strace stops the thread at every call, so the loop never finds time to sleep.
TRACER=strace
if command -v perf >/dev/null && perf version >/dev/null 2>&1; then
  mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
  TRACER=perf
fi
command -v "$TRACER" >/dev/null || { echo "neither perf nor strace is installed (apt-get install linux-perf strace)"; exit 1; }
IQN=iqn.2026-11.org.ramslog:syscalls
INI=iqn.2026-11.org.ramslog:rdma-bench
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do stop_pid "$p"; done
  rxe_down
}
mkdir -p "$RESULTS"

step "rxe up (targets: ${BINS[*]})"
rxe_up
trap cleanup EXIT

for bin in "${BINS[@]}"; do
  label=${bin%%=*}
  # shellcheck disable=SC2034 # read by target_start
  TARGET_BIN=${bin#*=}
  # A spinning loop holds one of the guest's two CPUs: fewer I/Os there.
  for spin in 0 100000; do
    ios=$IOS
    [ "$spin" = 0 ] || ios=$((IOS / 4))
    step "$label: --iser-spin $spin: $ios writes of 4 KiB at QD1 under $TRACER"
    target_start "$RESULTS/syscalls-$label-spin$spin.log" "iSER listening on $RXE_ADDR_A:3260" \
      --size 64M --ephemeral --listen "$RXE_ADDR_A:3260" --target-name "$IQN" --allow "$INI" \
      --iser-spin "$spin" --control-socket "/run/ramslog-syscalls.sock"
    target=$TARGET_STARTED
    PIDS+=("$target")
    trace=/tmp/syscalls-$label-spin$spin.trace
    bench=("$BENCH" lat "iser://$RXE_ADDR_A:3260/$IQN/0" --bs 4K --qd 1 --pattern write
      --count "$ios" --warmup 0 --spin 0 --initiator-name "$INI" --quiet)
    if [ "$TRACER" = perf ]; then
      # System-wide for the bench's run: -p would miss the connection
      # thread, born at login.
      perf trace -a -s -o "$trace" -- "${bench[@]}"
    else
      strace -f -qq -o "$trace" -p "$target" &
      tracer=$!
      PIDS+=("$tracer")
      sleep 2
      "${bench[@]}"
      stop_pid "$tracer"
    fi
    stop_pid "$target"
    bound=none
    if [ "$spin" != 0 ]; then
      bound=${SYSCALLS_FIXED_MAX:-150}
      [ "$ios" -ge 250 ] || { echo "the bound needs at least 250 spinning I/Os (IOS >= 1000)"; exit 1; }
    fi
    python3 - "$trace" "$ios" "$label, spin $spin ($TRACER)" "$TRACER" "$bound" <<'PY'
import collections, re, sys
path, ios, what, tracer, bound = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
by_tid = collections.defaultdict(collections.Counter)
tid = None
for line in open(path, errors="replace"):
    if tracer == "perf":
        # " ramslog-iser (254), 4099 events, ..." then "   syscall  calls ..." rows
        m = re.match(r"\s*(\S.*) \((\d+)\), \d+ events", line)
        if m:
            tid = m.group(2) if m.group(1) == "iser-conn" else None
            continue
        m = re.match(r"\s+([a-z_0-9]+)\s+(\d+)\s+\d+\s+[\d.]+", line)
        if m and tid:
            by_tid[tid][m.group(1)] += int(m.group(2))
    else:
        m = re.match(r"(\d+)\s+(<\.\.\. )?([a-z_0-9]+)[( ]", line)
        if m and not m.group(2):
            by_tid[m.group(1)][m.group(3)] += 1
if not by_tid:
    sys.stdout.write(open(path, errors="replace").read()[:3000])
    sys.exit(f"{tracer} recorded no calls of the connection thread")
tid, calls = max(by_tid.items(), key=lambda kv: sum(kv[1].values()))
total = sum(calls.values())
print(f"{what}: connection thread {tid}: {total} syscalls for {ios} I/Os = {total / ios:.2f} per I/O")
for name, n in calls.most_common():
    print(f"  {name:<16} {n:>8}  {n / ios:6.2f} per I/O")
if bound != "none":
    ours = sum(n for name, n in calls.items() if name != "write")
    print(f"  calls other than the doorbell write: {ours} in all for {ios} I/Os (at most {bound}: set-up and teardown)")
    if ours > int(bound):
        sys.exit(f"{what}: {ours} syscalls besides rxe's doorbells for {ios} I/Os, above the fixed {bound}: the loop makes calls per I/O")
PY
  done
done
echo "SYSCALLS MEASURED, spinning loop within its bound"
