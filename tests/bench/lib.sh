# shellcheck shell=bash
# What restart.sh and crash.sh share: the build, the binaries, the bench
# directory and its log, huge pages reserved for the run and given back,
# and waiting for the daemon's log. Source it from the repository root.
#
# RAMSLOG_BIN=PATH runs another daemon binary than this tree's release
# build (an older commit's, to compare side by side: the helpers, lun-fill
# and fd-holder, stay this tree's).

# bench_init DIR SIZE: build, set BIN FILL HOLDER_BIN LOG, empty DIR, and
# reserve the huge pages SIZE needs when HUGEPAGES=require. The caller's
# EXIT trap calls bench_cleanup.
bench_init() {
  local dir=$1 size=$2
  cargo build -j2 --release -q -p ramslog-target -p ramslog-tests
  BIN=${RAMSLOG_BIN:-build/release/ramslog-target}
  FILL=build/release/lun-fill
  HOLDER_BIN=build/release/fd-holder
  rm -rf "$dir"; mkdir -p "$dir"
  LOG="$dir/target.log"
  : >"$LOG"
  HUGE_BEFORE=$(cat /proc/sys/vm/nr_hugepages)
  if [[ ${HUGEPAGES:-off} == require ]]; then
    local need=$(( $(numfmt --from=iec "$size") / (2 << 20) + 16 ))
    echo $((HUGE_BEFORE + need)) >/proc/sys/vm/nr_hugepages
  fi
}

# Give back the huge pages bench_init reserved.
bench_cleanup() {
  echo "$HUGE_BEFORE" >/proc/sys/vm/nr_hugepages 2>/dev/null || true
}

# wait_log PATTERN N PID [INTERVAL]: until the log has N lines matching
# PATTERN; fails (with the log's tail) if PID ends first or after 3000 looks.
wait_log() {
  local pattern=$1 n=$2 pid=$3 interval=${4:-0.1}
  for _ in $(seq 1 3000); do
    (( $(grep -c "$pattern" "$LOG") >= n )) && return 0
    kill -0 "$pid" 2>/dev/null || { tail -20 "$LOG"; exit 1; }
    sleep "$interval"
  done
  echo "timed out waiting for '$pattern'"; tail -20 "$LOG"; exit 1
}
