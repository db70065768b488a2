#!/usr/bin/env bash
# A crash under a holder: kill -9 of the daemon, and the time until the one
# started again serves the LUN from the kept memory.
#
#   tests/bench/crash.sh [DIR] [SIZE]
#
# The daemon runs under `fd-holder DIR -- ...`, which does what the shipped
# unit asks of systemd: it holds the fd store and starts the daemon again
# 100 ms after it ends in failure (RestartSec=100ms). SIZE (default 4G) is
# filled completely over iSCSI/TCP (lun-fill). HUGEPAGES=off|require
# (default off). Each of ROUNDS (default 3) rounds: kill -9, then the split
# from the daemon's log: the kill to the new program's first line (the
# holder's restart delay and the exec), its first line to the LUN taken over
# (the rules checked, the memory mapped and locked), to listening (READY).
# The content is checked after the last round. Prints a table and writes
# build/bench/crash.json. SIGNAL=SEGV (default KILL) makes each end a fault,
# and VERIFY=on runs the daemon with --verify-kept-memory, so each start
# checks every page against its checksum before serving (the check's time
# is in the table); without VERIFY=on a fault leaves the LUN NOT READY.
# RAMSLOG_BIN=PATH runs another daemon binary (an older commit's release
# build) through the same steps, for a side-by-side comparison.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-/var/tmp/ramslog-crash-bench}
SIZE=${2:-4G}
PORT=${PORT:-3303}
HUGEPAGES=${HUGEPAGES:-off}
ROUNDS=${ROUNDS:-3}
SIGNAL=${SIGNAL:-KILL}
VERIFY=${VERIFY:-off}
IQN=iqn.2026-11.org.ramslog:crash-bench

# shellcheck source=lib.sh
source tests/bench/lib.sh
bench_init "$DIR" "$SIZE"
hpid=
cleanup() {
  if [[ -n $hpid ]]; then
    kill -9 "$hpid" 2>/dev/null || true
    [[ -s $DIR/holder/pid ]] && kill -9 "$(cat "$DIR/holder/pid")" 2>/dev/null || true
  fi
  bench_cleanup
}
trap cleanup EXIT

"$HOLDER_BIN" "$DIR/holder" -- env FDSTORE=512 "$BIN" --size "$SIZE" \
  --listen "127.0.0.1:$PORT" --target-name "$IQN" --state-dir "$DIR/state" \
  --image-dir "$DIR/images" --hugepages "$HUGEPAGES" --verify-kept-memory "$VERIFY" >>"$LOG" 2>&1 &
hpid=$!
wait_log "listening on" 1 "$hpid" 0.02
"$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed 7 >/dev/null
kills=()
for round in $(seq 1 "$ROUNDS"); do
  pid=$(cat "$DIR/holder/pid")
  listening=$(grep -c "listening on" "$LOG")
  kills+=("$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)")
  kill -"$SIGNAL" "$pid"
  wait_log "listening on" $((listening + 1)) "$hpid" 0.02
done
"$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed 7 --check
kill -TERM "$(cat "$DIR/holder/pid")"; wait "$hpid"; hpid=

mkdir -p build/bench
python3 - "$SIZE" "$HUGEPAGES" "$LOG" "$SIGNAL" "$VERIFY" "${kills[@]}" <<'PY' | tee build/bench/crash.json
import datetime, json, re, statistics, sys
size, huge, log, signal, verify, kills = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
ts = lambda s: datetime.datetime.fromisoformat(s[:26] + "+00:00").timestamp()
lines = [(ts(m.group(1)), l) for l in open(log) for m in [re.match(r"(\S+)Z", l)] if m]
def first(pattern, after):
    return next(t for t, l in lines if t >= after and re.search(pattern, l))
rounds = []
for k in map(ts, kills):
    start = first(r"systemd's fd store kept LUN memory|ramslog_target", k)
    kept = first(r"LUN content kept in memory", k)
    listen = first(r"listening on", kept)
    r = {"kill_to_listening_s": listen - k, "kill_to_new_program_s": start - k,
         "take_over_s": kept - start, "to_listening_s": listen - kept}
    checked = [re.search(r"every page matches its checksum \((\d+) pages in ([\d.]+) s", l)
               for t, l in lines if k <= t <= listen]
    checked = [m for m in checked if m]
    if checked:
        r["pages_checked"] = int(checked[0].group(1))
        r["check_s"] = float(checked[0].group(2))
    rounds.append(r)
r3 = lambda d: {f: round(v, 3) for f, v in d.items()}
med = {f: statistics.median(r[f] for r in rounds) for f in rounds[0]}
print(json.dumps({"size": size, "hugepages": huge, "signal": signal, "verify": verify,
                  "median": r3(med),
                  "rounds": [r3(r) for r in rounds]}, indent=1))
PY
