#!/usr/bin/env bash
# ramslog-target against ramslog-initiator's iSER transport in both initiator
# profiles: `illumos` (56-byte CM private data with 0xC0 in byte 3 and
# garbage after it, no iSER login keys, 16 KiB receive buffers, 4 RDMA READ
# credits, RNR retry 2) and `linux` (ib_iser private data, RDMAExtensions=Yes,
# I/T RDSL, ImmediateData=Yes, 128-byte full-feature receives). For each:
# login and the negotiated keys, write/SYNCHRONIZE CACHE/read-verify over
# 512 B..256 KiB at random LBAs, pipelined I/O, idle > 5 s with the idle
# NOP-Out ping, target NOP-In pings answered, SendTargets over an iSER
# discovery session, logout. Then an initiator SIGKILLed mid-transfer: its
# connection alone ends and a new session works; one frozen (SIGSTOP),
# which the target must drop by itself within NOP interval + NOP timeout;
# and one that floods pings but posts no receives, which the target must
# stop reading and drop when its sends make no progress. Then PREEMPT AND ABORT with
# the preempted host's RDMA READs in flight, and iSER floods that must not keep the
# allowed initiator out, and --max-iser-connections (iser-admission-check). Client and server share one
# rxe address (rxe cannot connect across its two devices in one namespace).
#
# Build first (on the host):
#   cargo build -j1 -p ramslog-target -p ramslog-tests --bin ramslog-target --bin iser-initiator-check --bin iser-admission-check
# Run:  tests/softroce/run tests/softroce/iser-initiators.sh [SECONDS]
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
SECS=${1:-5}
IQN=iqn.2026-11.org.ramslog:iser-initiators
# The target pings after this many idle seconds; the check waits for one.
NOP_INTERVAL=8
# An unanswered ping ends the connection after this many seconds.
NOP_TIMEOUT=10
# Sends that make no progress end it after this many: far beyond the NOP
# timers, so the frozen initiator's case shows which timer fired.
OUTPUT_STALL=120

TARGET_BIN=${RAMSLOG_TARGET_BIN:-$(pick_bin ramslog-target)} || { echo "build ramslog-target first"; exit 1; }
BIN=$TARGET_BIN
CHECK=${ISER_CHECK_BIN:-$(pick_bin iser-initiator-check)} ||
  { echo "build the check first: cargo build -j1 -p ramslog-tests --bin iser-initiator-check"; exit 1; }
TARGET_PID=
LOG=$RESULTS/ramslog-target-iser-initiators.log

STALL_PID= CAP_PID= FLOOD_PID= FLOOD_CHAP_PID=
cleanup() {
  # Every daemon a step started, in case a failure left the step early:
  # one holding the RDMA device would block its removal. One that does not
  # stop fails the script (the exit status a trap sets is the script's).
  local p stuck=
  for p in "$TARGET_PID" "$STALL_PID" "$CAP_PID" "$FLOOD_PID" "$FLOOD_CHAP_PID"; do
    if [ -n "$p" ] && kill -0 "$p" 2>/dev/null && ! stop_pid "$p"; then
      echo "cleanup: a target (pid $p) did not stop" >&2
      stuck=yes
    fi
  done
  rxe_down
  [ -z "$stuck" ] || exit 1
}

step "network: rxe on a veth pair"
rxe_up
trap cleanup EXIT
ibv_devices

step "ramslog-target on $RXE_ADDR_A:3260 ($BIN)"
# Spin budget 0: busy polling on emulated CPUs starves rxe and the initiator.
rc=0
target_start "$LOG" "iSER listening on $RXE_ADDR_A:3260" \
  --size 256M --listen "$RXE_ADDR_A:3260" --target-name "$IQN" --ephemeral \
  --allow "iqn.2026-11.org.ramslog:check-illumos" --allow "iqn.2026-11.org.ramslog:check-linux" \
  --nop-interval "$NOP_INTERVAL" --nop-timeout "$NOP_TIMEOUT" --iser-spin 0 \
  --output-stall-timeout "$OUTPUT_STALL" || rc=$?
TARGET_PID=$TARGET_STARTED
[ "$rc" = 0 ] || { echo "ramslog-target is not listening for iSER on $RXE_ADDR_A:3260"; exit 1; }
grep "iSER listening" "$LOG"

fail=0
for profile in illumos linux; do
  step "iser-initiator-check --profile $profile"
  if timeout 600 "$CHECK" --profile "$profile" --target "$RXE_ADDR_A:3260" --iqn "$IQN" \
    --seconds "$SECS" --target-nop-interval "$NOP_INTERVAL"; then
    :
  else
    echo "iser-initiator-check --profile $profile FAILED (exit $?)"
    fail=1
  fi
  kill -0 "$TARGET_PID" 2>/dev/null || { echo "ramslog-target died"; fail=1; break; }
done

closed_count() { grep -c "iSER connection closed" "$LOG" || true; }

# Start a linux-profile check in the background and wait until it logged in
# and is 3 s into its write/read-verify loop; its pid in $SUBJECT.
start_subject() {
  "$CHECK" --profile linux --target "$RXE_ADDR_A:3260" --iqn "$IQN" --seconds "$1" >"$2" 2>&1 &
  SUBJECT=$!
  for _ in $(seq 1 100); do grep -q "login" "$2" 2>/dev/null && break; sleep 0.2; done
  sleep 3
}

# Wait up to $2 seconds for more closed connections than $1; 0 when one came.
wait_closed() {
  local _
  for _ in $(seq 1 $(($2 * 5))); do
    [ "$(closed_count)" -gt "$1" ] && return 0
    sleep 0.2
  done
  return 1
}

# After an initiator went away: the target lives and a new session works.
new_session_works() {
  kill -0 "$TARGET_PID" 2>/dev/null || { echo "ramslog-target died with its initiator"; return 1; }
  if timeout 600 "$CHECK" --profile illumos --target "$RXE_ADDR_A:3260" --iqn "$IQN" --seconds 2; then
    echo "a new session works after $1"
  else
    echo "no working session after $1"; return 1
  fi
}

if [ "$fail" = 0 ]; then
  step "an initiator killed mid-transfer: its connection ends, the target keeps serving"
  before=$(closed_count)
  # Into the write/read-verify loop, then SIGKILL: no logout, I/O in flight.
  start_subject 60 /tmp/victim.log
  kill -9 "$SUBJECT"; wait "$SUBJECT" 2>/dev/null || true
  wait_closed "$before" 20 || { echo "the target did not close the killed initiator's connection"; fail=1; }
  grep -A3 "iSER connection accepted" "$LOG" | tail -4
  [ "$fail" = 0 ] && { new_session_works "the crash" || fail=1; }
fi

if [ "$fail" = 0 ]; then
  # A frozen initiator (SIGSTOP: its QP lives on in the kernel, but it
  # polls, answers and reposts nothing) sends no RST and no disconnect. The
  # target must drop it by itself — NOP-In unanswered, or its sends making
  # no progress — within NOP interval + NOP timeout, and keep serving.
  step "a frozen initiator is dropped within NopInterval + NopTimeout ($NOP_INTERVAL + $NOP_TIMEOUT s)"
  before=$(closed_count)
  nop_closes() { grep -c "did not answer the NOP-In ping" "$LOG" || true; }
  stall_closes() { grep -c "no send completed" "$LOG" || true; }
  nops_before=$(nop_closes) stalls_before=$(stall_closes)
  start_subject 120 /tmp/frozen.log
  kill -STOP "$SUBJECT"
  t_stop=$(date +%s)
  closed=0
  wait_closed "$before" $((NOP_INTERVAL + NOP_TIMEOUT + 20)) && closed=1
  took=$(($(date +%s) - t_stop))
  echo "frozen initiator: connection closed=$closed after $took s"
  kill -9 "$SUBJECT" 2>/dev/null; kill -CONT "$SUBJECT" 2>/dev/null; wait "$SUBJECT" 2>/dev/null || true
  [ "$closed" = 1 ] || { echo "the target kept a frozen initiator's connection"; fail=1; }
  # The NOP timeout, and nothing else, ended it: its log line, no output
  # stall, and not before a ping could have gone unanswered that long.
  if [ "$closed" = 1 ]; then
    [ "$(nop_closes)" -gt "$nops_before" ] ||
      { echo "the frozen initiator was not dropped by the NOP timeout"; fail=1; }
    [ "$(stall_closes)" = "$stalls_before" ] || { echo "the output stall, not the NOP timeout, fired"; fail=1; }
    [ "$took" -ge "$NOP_TIMEOUT" ] || { echo "closed after $took s, before the $NOP_TIMEOUT s NOP timeout"; fail=1; }
  fi
  [ "$fail" = 0 ] && { new_session_works "a frozen initiator" || fail=1; }
fi

if [ "$fail" = 0 ]; then
  # A peer that takes nothing: it floods immediate NOP-Out pings (each asks
  # for a NOP-In) and never reposts a receive buffer, so the target's SENDs
  # wait in RNR retry (7 = for ever) and its send slots run out. The target
  # must stop consuming that peer's messages and end the connection when no
  # send completes for its output stall timeout (--output-stall-timeout, 10 s
  # here rather than the default 30). A second target with a 300 s NOP
  # interval, so that only the stall can end it.
  step "a peer that posts no receives: the connection ends after its 10 s output stall"
  LOG2=$RESULTS/ramslog-target-iser-stall.log
  rc=0
  target_start "$LOG2" "iSER listening on $RXE_ADDR_A:3261" \
    --size 64M --listen "$RXE_ADDR_A:3261" --target-name "$IQN" --ephemeral --control-socket /run/ramslog/stall.sock \
    --allow "iqn.2026-11.org.ramslog:check-linux" --nop-interval 300 --iser-spin 0 \
    --output-stall-timeout 10 || rc=$?
  STALL_PID=$TARGET_STARTED
  [ "$rc" = 0 ] || { stop_pid "$STALL_PID"; echo "the stall target did not start"; exit 1; }
  "$CHECK" --profile linux --target "$RXE_ADDR_A:3261" --iqn "$IQN" --flood-pings 450 >/tmp/flood.log 2>&1 &
  SUBJECT=$!
  for _ in $(seq 1 300); do grep -q "now silent" /tmp/flood.log 2>/dev/null && break; sleep 0.2; done
  grep "sent .* pings" /tmp/flood.log || { echo "the flood client did not get going"; cat /tmp/flood.log; fail=1; }
  t_flood=$(date +%s)
  closed=0
  for _ in $(seq 1 $((60 * 5))); do
    grep -q "iSER connection closed" "$LOG2" && { closed=1; break; }
    sleep 0.2
  done
  took=$(($(date +%s) - t_flood))
  echo "peer taking nothing: connection closed=$closed after $took s"
  grep -q "no send completed for 10s" "$LOG2" || { echo "the 10 s output stall did not end the connection"; fail=1; }
  # date +%s counts whole seconds, and the stall begins when the client
  # stops taking, a moment before it says so: 9 s on this clock can be the
  # full 10 s (seen: "closed after 9 s" in a standalone run).
  [ "$took" -ge 9 ] || { echo "closed after $took s, before the 10 s output stall"; fail=1; }
  [ "$closed" = 1 ] || { echo "the target kept a peer that takes nothing"; fail=1; }
  kill -9 "$SUBJECT" 2>/dev/null; wait "$SUBJECT" 2>/dev/null || true
  kill -0 "$STALL_PID" 2>/dev/null || { echo "the second target died"; fail=1; }
  stop_pid "$STALL_PID"
fi

ADMISSION=${ISER_ADMISSION_BIN:-$(pick_bin iser-admission-check)} ||
  { echo "build the check first: cargo build -p ramslog-tests --bin iser-admission-check"; exit 1; }

if [ "$fail" = 0 ]; then
  # Host A (illumos profile: 4 RDMA READ credits, so the target holds READs
  # beyond them) reserves and has 32 writes of 0xAA in flight; host B
  # PREEMPT AND ABORTs it, writes 0xBB over the region and must read back
  # 0xBB everywhere: nothing of A's may land after the preempt is answered.
  step "PREEMPT AND ABORT with the preempted host's RDMA READs in flight"
  if timeout 300 "$ADMISSION" preempt --target "$RXE_ADDR_A:3260" --iqn "$IQN" \
    --a iqn.2026-11.org.ramslog:check-illumos --b iqn.2026-11.org.ramslog:check-linux; then
    :
  else
    echo "iser-admission-check preempt FAILED"; fail=1
  fi
  grep -E "aborted transfers|preempt|abort" "$LOG" | tail -3 || true
fi

if [ "$fail" = 0 ]; then
  # --max-iser-connections 2 on a target of its own: two logged-in iSER
  # sessions, a third login refused with Out of Resources and counted,
  # and the place back once one logs out.
  step "--max-iser-connections 2: the third iSER login is refused, the place comes back"
  CAP_LOG=$RESULTS/ramslog-target-iser-cap.log
  rc=0
  target_start "$CAP_LOG" "iSER listening on $RXE_ADDR_A:3264" \
    --size 16M --listen "$RXE_ADDR_A:3264" --target-name "$IQN" --ephemeral \
    --control-socket /run/ramslog/cap.sock --allow iqn.2026-11.org.ramslog:check-linux \
    --max-iser-connections 2 --iser-spin 0 || rc=$?
  CAP_PID=$TARGET_STARTED
  if [ "$rc" != 0 ]; then echo "the capped target did not start"; fail=1; else
    if timeout 300 "$ADMISSION" cap --target "$RXE_ADDR_A:3264" --iqn "$IQN" \
      --name iqn.2026-11.org.ramslog:check-linux --count 2; then
      hits=$("$TARGET_BIN" status --json --control-socket /run/ramslog/cap.sock |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["portal"]["limit_hits"].get("iser_connections", 0))')
      [ "$hits" -ge 1 ] || { echo "the refusal was not counted as iser_connections ($hits)"; fail=1; }
    else
      echo "iser-admission-check cap FAILED"; fail=1
    fi
    stop_pid "$CAP_PID"
  fi
fi

# iSER floods: discovery sessions from three more addresses of the rxe
# netdev, 16 per address, answering pings and reconnecting at once when
# ended, against a target with short NOP and discovery lifetimes; the
# allowed initiator logs in every second for FLOOD_SECONDS, without CHAP on
# one target and with CHAP on another, both at once. Locked plus pinned
# memory, sampled every second from `status --json`, stays within the
# baseline (the LUN locked and registered) plus the RDMA pending cap (8) times
# one connection's login slots, plus the allowed session's own buffers.
# Three discovery lifetimes (--discovery-lifetime 5) and more than three
# NOP-In interval-and-timeouts (2 + 2 s): every pool turns over several times.
FLOOD_SECONDS=${FLOOD_SECONDS:-15}
flood_target() { # port log socket [chap args...]
  local port=$1 log=$2 sock=$3
  shift 3
  RUST_LOG=info,ramslog_target::admission=debug target_start "$log" "iSER listening on $RXE_ADDR_A:$port" \
    --size 64M --listen "$RXE_ADDR_A:$port" --target-name "$IQN" --ephemeral --control-socket "$sock" \
    --allow iqn.2026-11.org.ramslog:flood-allowed --nop-interval 2 --nop-timeout 2 \
    --discovery-lifetime 5 --iser-spin 0 "$@"
}
# Memory no one may make the daemon pin: mlock'ed (the LUN) plus pinned by
# RDMA registrations (the LUN once more, and every connection's buffers).
# Nothing (not 0) when status cannot be read: a failed sample must not
# pass for a small one.
locked_of() { timeout 20 "$TARGET_BIN" status --json --control-socket "$1" 2>/dev/null |
  python3 -c 'import json,sys; p=json.load(sys.stdin)["process"]; print(p["locked_bytes"] + p["pinned_bytes"])' 2>/dev/null || true; }
if [ "$fail" = 0 ]; then
  step "iSER floods from 3 addresses x 16 for $FLOOD_SECONDS s: the allowed initiator logs in every second"
  for n in 11 12 13; do ip addr add "10.99.0.$n/24" dev rsl-a; done
  sleep 1
  printf 'flood-chap-secret-1' >/tmp/flood-chap
  chmod 600 /tmp/flood-chap
  F1=$RESULTS/ramslog-target-iser-flood.log F2=$RESULTS/ramslog-target-iser-flood-chap.log
  rc=0
  flood_target 3262 "$F1" /run/ramslog/flood.sock || rc=$?
  FLOOD_PID=$TARGET_STARTED
  flood_target 3263 "$F2" /run/ramslog/flood-chap.sock \
    --chap-user slog-host --chap-secret-file /tmp/flood-chap || rc=$?
  FLOOD_CHAP_PID=$TARGET_STARTED
  # The LUN is registered with the device once the target listens: the
  # baseline counts it.
  for f in "$F1" "$F2"; do
    if [ "$rc" = 0 ]; then wait_for_log "$f" "LUN memory registered with the RDMA device" "" 30 || rc=1; fi
  done
  if [ "$rc" != 0 ]; then echo "the flood targets did not start"; fail=1; else
    base1=$(locked_of /run/ramslog/flood.sock) base2=$(locked_of /run/ramslog/flood-chap.sock)
    if [ -z "$base1" ] || [ -z "$base2" ]; then
      echo "the flood targets' status could not be read before the flood"; fail=1
      base1=0 base2=0
    fi
    samples1=0 samples2=0
    "$ADMISSION" flood --target "$RXE_ADDR_A:3262" --iqn "$IQN" --name iqn.2026-11.org.ramslog:flood-allowed \
      --from 10.99.0.11,10.99.0.12,10.99.0.13 --per-source 16 --seconds "$FLOOD_SECONDS" >/tmp/flood1.log 2>&1 &
    P1=$!
    "$ADMISSION" flood --target "$RXE_ADDR_A:3263" --iqn "$IQN" --name iqn.2026-11.org.ramslog:flood-allowed \
      --from 10.99.0.11,10.99.0.12,10.99.0.13 --per-source 16 --seconds "$FLOOD_SECONDS" \
      --chap slog-host:flood-chap-secret-1 >/tmp/flood2.log 2>&1 &
    P2=$!
    max1=0 max2=0 hung=
    # A flood client that outlives its time by far is a failure with a
    # picture of where its threads wait, not a silent suite timeout.
    give_up=$(($(date +%s) + FLOOD_SECONDS + 180))
    while kill -0 "$P1" 2>/dev/null || kill -0 "$P2" 2>/dev/null; do
      if [ "$(date +%s)" -gt "$give_up" ]; then
        hung=yes
        echo "an iSER flood client still runs $((FLOOD_SECONDS + 180)) s after it started; where its threads wait:"
        for p in "$P1" "$P2"; do
          kill -0 "$p" 2>/dev/null || continue
          for t in /proc/"$p"/task/*; do
            echo "  $t: $(cat "$t/wchan" 2>/dev/null) $(head -4 "$t/stack" 2>/dev/null | tr '\n' ' ')"
          done
        done
        kill -9 "$P1" "$P2" 2>/dev/null
        fail=1
        break
      fi
      l1=$(locked_of /run/ramslog/flood.sock) l2=$(locked_of /run/ramslog/flood-chap.sock)
      if [ -n "$l1" ]; then samples1=$((samples1 + 1)); [ "$l1" -gt "$max1" ] && max1=$l1; fi
      if [ -n "$l2" ]; then samples2=$((samples2 + 1)); [ "$l2" -gt "$max2" ] && max2=$l2; fi
      sleep 1
    done
    # Not a bare `wait`: under set -e a failed client would end the script
    # here, before its log is shown.
    r1=0 r2=0
    wait "$P1" || r1=$?
    wait "$P2" || r2=$?
    cat /tmp/flood1.log /tmp/flood2.log
    # A connection nobody admitted pins its login slots alone: 8 receives
    # of 10 KiB and 4 sends of 16 KiB; at most the RDMA pending cap (8) of
    # them at once, counting evicted ones still tearing down. The allowed
    # session adds its full rings (320 x 10 KiB, 256 x 16 KiB) and its
    # 9 MiB of Data-In and bounce buffers, twice: one login's teardown may
    # overlap the next. The LUN's registration is in the baseline.
    login_slots=$(( (8 * 10 + 4 * 16) * 1024 ))
    session=$(( login_slots + (320 * 10 + 256 * 16) * 1024 + (9 << 20) ))
    bound1=$(( base1 + 8 * login_slots + 2 * session ))
    bound2=$(( base2 + 8 * login_slots + 2 * session ))
    echo "locked + pinned memory: no CHAP peak $max1 (baseline $base1, bound $bound1, $samples1 samples); CHAP peak $max2 (baseline $base2, bound $bound2, $samples2 samples)"
    # The bound is checked against samples really read during the flood,
    # at least one from each target (a sample costs two program starts,
    # which take seconds on a loaded, emulated host: a CI run read one each).
    if [ "$samples1" -lt 1 ] || [ "$samples2" -lt 1 ]; then
      echo "too few memory samples were read during the flood"; fail=1
    fi
    if [ -z "$hung" ] && { [ "$r1" != 0 ] || [ "$r2" != 0 ]; }; then
      echo "an iSER flood kept the allowed initiator out"; fail=1
    fi
    if [ "$max1" -gt "$bound1" ] || [ "$max2" -gt "$bound2" ]; then
      echo "pinned memory grew past the RDMA pending cap"; fail=1
    fi
    grep -c "iser_login_slots\|hold every login slot" "$F1" "$F2" || true
    grep -c "evicted the oldest" "$F1" "$F2" || true
  fi
  stop_pid "$FLOOD_PID"
  stop_pid "$FLOOD_CHAP_PID"
fi

step "target log (iSER lines)"
grep -E "iSER|session|WARN|ERROR" "$LOG" | tail -60 || true
if [ "$fail" != 0 ]; then
  echo
  echo "full target log: $LOG"
  tail -40 "$LOG"
  exit 1
fi
echo "ISER INITIATORS PASSED"
