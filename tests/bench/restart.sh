#!/usr/bin/env bash
# A planned restart against a stop and a start, side by side in one run.
#
#   tests/bench/restart.sh [DIR] [SIZE]
#
# DIR (default /var/tmp/ramslog-restart-bench) holds the state and images;
# SIZE (default 4G) is the LUN, filled completely over iSCSI/TCP (lun-fill).
# HUGEPAGES=off|require (default off; require reserves the 2 MiB pages it
# needs for the run and gives them back). HOLDER=on runs the daemon under
# fd-holder (what systemd's fd store does for the shipped unit): a restart
# then skips the dump; each stop and start gets a fresh holder, as systemd 252
# empties the store at a stop. Each round: `restart --wait`
# (dump, exec, take the memory over), then SIGTERM and a start (dump, restore),
# each timed from the fence to the new program listening, split from the
# daemon's log (check: the binary on disk tried; fence and drain; dump; exec:
# the old program's last line to the new one's first; take-over or restore;
# listen); the content is checked after the last round. Prints a table and
# writes build/bench/restart.json.
# RAMSLOG_BIN=PATH runs another daemon binary (an older commit's release
# build) through the same steps, for a side-by-side comparison.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-/var/tmp/ramslog-restart-bench}
SIZE=${2:-4G}
PORT=${PORT:-3302}
HUGEPAGES=${HUGEPAGES:-off}
ROUNDS=${ROUNDS:-3}
HOLDER=${HOLDER:-off}
IQN=iqn.2026-11.org.ramslog:restart-bench

# shellcheck source=lib.sh
source tests/bench/lib.sh
bench_init "$DIR" "$SIZE"
pid=
hpid=
cleanup() {
  [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
  [[ -n $hpid ]] && kill -9 "$hpid" 2>/dev/null
  bench_cleanup
}
trap cleanup EXIT

start() {
  local env=()
  if [[ $HOLDER == on ]]; then
    [[ -n $hpid ]] && { kill "$hpid"; wait "$hpid" 2>/dev/null || true; }
    rm -rf "$DIR/holder"
    "$HOLDER_BIN" "$DIR/holder" >"$DIR/holder.path" &
    hpid=$!
    for _ in $(seq 1 100); do [[ -s $DIR/holder.path ]] && break; sleep 0.05; done
    env=(env "NOTIFY_SOCKET=$(cat "$DIR/holder.path")" FDSTORE=512)
  fi
  "${env[@]}" "$BIN" --size "$SIZE" --listen "127.0.0.1:$PORT" --target-name "$IQN" \
    --state-dir "$DIR/state" --image-dir "$DIR/images" --hugepages "$HUGEPAGES" >>"$LOG" 2>&1 &
  pid=$!
}

start
wait_log "listening on" 1 "$pid"
"$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed 7 >/dev/null
results=()
for round in $(seq 1 "$ROUNDS"); do
  mark=$(wc -l <"$LOG")
  t0=$(date +%s.%N)
  "$BIN" restart --wait --state-dir "$DIR/state" >"$DIR/restart.out"
  t1=$(date +%s.%N)
  results+=("restart" "$(tail -n +$((mark + 1)) "$LOG" | base64 -w0)" "$(awk "BEGIN { print $t1 - $t0 }")")
  "$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed $((round + 7)) >/dev/null
  mark=$(wc -l <"$LOG")
  t0=$(date +%s.%N)
  kill -TERM "$pid"
  wait "$pid" || { echo "target exited non-zero"; tail -20 "$LOG"; exit 1; }
  start
  wait_log "listening on" $(( $(grep -c "listening on" "$LOG") + 1 )) "$pid"
  t1=$(date +%s.%N)
  results+=("stop-start" "$(tail -n +$((mark + 1)) "$LOG" | base64 -w0)" "$(awk "BEGIN { print $t1 - $t0 }")")
  "$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed $((round + 100)) >/dev/null
done
"$BIN" restart --wait --state-dir "$DIR/state" >/dev/null
"$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed $((ROUNDS + 100)) --check
kill -TERM "$pid"; wait "$pid"; pid=

mkdir -p build/bench
python3 - "$SIZE" "$HUGEPAGES" "$HOLDER" "${results[@]}" <<'PY' | tee build/bench/restart.json
import base64, datetime, json, re, statistics, sys
size, huge, holder, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def at(line):
    m = re.match(r"(\S+Z)", line)
    return datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() if m else None
def first(lines, pattern, after=0.0):
    for l in lines:
        t = at(l)
        if t is not None and t >= after and re.search(pattern, l):
            return t
    raise SystemExit(f"no line matching {pattern!r}")
rounds = {"restart": [], "stop-start": []}
for i in range(0, len(args), 3):
    kind, text, wall = args[i], base64.b64decode(args[i + 1]).decode(), float(args[i + 2])
    lines = text.splitlines()
    fence = first(lines, "shutting down")
    dumped = first(lines, r"dumped to|nothing written since|restart: no dump", fence)
    if kind == "restart":
        asked = first(lines, "restart requested")
        new = first(lines, "started by a restart", dumped)
        ready = first(lines, "LUN content kept in memory", new)
        listen = first(lines, "listening on", ready)
        split = {"dump_s": dumped - fence, "exec_s": new - dumped, "take_over_s": ready - new,
                 "listen_s": listen - ready}
    else:
        new = first(lines, "restoring LUN content", dumped)
        ready = first(lines, "restored and verified", new)
        listen = first(lines, "listening on", ready)
        split = {"dump_s": dumped - fence, "exit_and_start_s": new - dumped,
                 "restore_s": ready - new, "listen_s": listen - ready}
    rounds[kind].append({"fence_to_listening_s": listen - fence, "command_wall_s": wall, **split})
med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rounds.items()}
med["ratio_restart_vs_stop_start"] = (med["restart"]["fence_to_listening_s"]
                                      / med["stop-start"]["fence_to_listening_s"])
r3 = lambda d: {k: (round(v, 3) if isinstance(v, float) else r3(v)) for k, v in d.items()}
print(json.dumps({"size": size, "hugepages": huge, "holder": holder, "median": r3(med),
                  "rounds": {k: [r3(x) for x in v] for k, v in rounds.items()}}, indent=1))
PY
