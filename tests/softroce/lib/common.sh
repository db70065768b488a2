# shellcheck shell=bash
# Sourced first by every lab script: strict mode, the repository's paths, the
# rxe and binary helpers, and what every script needs besides: step headings,
# waiting for a daemon's log line, starting ramslog-target, stopping a process.
#
#   REPO, RESULTS          the checkout (shared into the guest) and where runs write
#   step TEXT              a heading, with the guest's uptime
#   wait_for_log FILE TEXT [PID] [SECONDS]
#                          until FILE holds TEXT (a fixed string); fails, showing
#                          FILE, when PID exits first or after SECONDS (30)
#   target_start LOG READY ARG...
#                          ramslog-target ARG... ($TARGET_BIN, else the newest
#                          build) logging to LOG, until it logs READY (its listen
#                          line, e.g. "iSER listening on ADDR"); PID in TARGET_STARTED;
#                          a daemon that does not get there is stopped
#   wait_rdma_listener PORT PID [SECONDS]
#                          until an rdma_cm ID listens on PORT (the kernel's own
#                          list, `rdma resource show cm_id`); fails when PID exits
#                          first or after SECONDS (30)
#   stop_pid PID [SECONDS] kill and reap; fails (after SIGKILL and a picture of
#                          its threads) when PID outlives SIGTERM by SECONDS (120)
set -euo pipefail
LAB_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$LAB_LIB/../../.." && pwd)
RESULTS=${RESULTS:-$REPO/build/softroce/results}
# shellcheck source=rxe.sh
. "$LAB_LIB/rxe.sh"
# shellcheck source=bin.sh
. "$LAB_LIB/bin.sh"

step() { echo; echo "== [$(cut -d' ' -f1 /proc/uptime) s] $*"; }

wait_for_log() {
  local file=$1 text=$2 pid=${3:-} secs=${4:-30} i
  for ((i = 0; i < secs * 5; i++)); do
    grep -qF -- "$text" "$file" 2>/dev/null && return 0
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      echo "the process writing $file ended before it logged '$text':"
      cat "$file" 2>/dev/null || true
      return 1
    fi
    sleep 0.2
  done
  echo "no '$text' in $file after ${secs} s:"
  cat "$file" 2>/dev/null || true
  return 1
}

# A fixed sleep before a client connects is a race the lab loses when its two
# guests share two slow cores: ask the kernel whether the listener is there.
wait_rdma_listener() {
  local port=$1 pid=$2 secs=${3:-30} i ids
  for ((i = 0; i < secs * 5; i++)); do
    # Not a pipe into grep -q: under pipefail its early exit would fail the check.
    ids=$(rdma resource show cm_id 2>/dev/null || true)
    grep -qE "state LISTEN .*:$port( |$)" <<<"$ids" && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "the server ended before it listened on rdma_cm port $port"
      return 1
    fi
    sleep 0.2
  done
  echo "nothing listens on rdma_cm port $port after ${secs} s:"
  rdma resource show cm_id || true
  return 1
}

target_start() {
  local log=$1 ready=$2 bin
  shift 2
  bin=${TARGET_BIN:-$(pick_bin ramslog-target)} || { echo "build ramslog-target first (cargo build --release)"; return 1; }
  mkdir -p "$(dirname "$log")"
  "$bin" "$@" >"$log" 2>&1 &
  TARGET_STARTED=$!
  # A restore of a large LUN under emulation takes seconds before the listen line.
  if ! wait_for_log "$log" "$ready" "$TARGET_STARTED" 60; then
    # Never leave a half-started daemon behind for the caller's cleanup to miss.
    stop_pid "$TARGET_STARTED"
    return 1
  fi
}

# Kill a background process by PID and reap it (a bare `wait` would also wait
# for daemons such as iscsid and hang the guest). One that outlives SIGTERM by
# SECONDS (120) is a failure with a picture of where its threads wait, then
# SIGKILLed: never a silent suite timeout.
stop_pid() {
  local pid=$1 secs=${2:-120} i state t
  kill "$pid" 2>/dev/null || true
  for ((i = 0; i < secs * 5; i++)); do
    # kill -0 succeeds on a zombie: an unreaped child that has ended.
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = Z ] && break
    sleep 0.2
  done
  if [ -n "$state" ] && [ "$state" != Z ]; then
    echo "process $pid ($(cat "/proc/$pid/comm" 2>/dev/null)) still runs $secs s after SIGTERM; where its threads wait:"
    for t in /proc/"$pid"/task/*; do
      echo "  $(cat "$t/comm" 2>/dev/null) ${t##*/}: $(cat "$t/wchan" 2>/dev/null) $(head -6 "$t/stack" 2>/dev/null | tr '\n' ' ')"
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return 1
  fi
  wait "$pid" 2>/dev/null || true
}
