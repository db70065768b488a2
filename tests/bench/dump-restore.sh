#!/usr/bin/env bash
# Dump and restore throughput against the disk's own, side by side in one run.
#
#   tests/bench/dump-restore.sh [DIR] [SIZE]
#
# DIR (default /var/tmp/ramslog-bench) is on the filesystem to measure; SIZE
# (default 4G) is the LUN. Starts a release ramslog-target with its state and
# images in DIR, fills the LUN over iSCSI/TCP (lun-fill), stops it (the dump),
# starts it again (the restore), checks every byte, then runs fio sequential
# write and read of the same size with --direct=1 in DIR. Prints GiB/s, the
# seconds per 4 GiB and the ratios; writes build/bench/dump-restore.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-/var/tmp/ramslog-bench}
SIZE=${2:-4G}
PORT=${PORT:-3301}
IQN=iqn.2026-11.org.ramslog:bench

if ! command -v fio >/dev/null; then
  [[ $(id -u) == 0 ]] || { echo "fio is needed: apt-get install fio" >&2; exit 2; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null
fi
cargo build -j2 --release -q -p ramslog-target -p ramslog-tests
BIN=build/release/ramslog-target
FILL=build/release/lun-fill
rm -rf "$DIR"; mkdir -p "$DIR"
LOG="$DIR/target.log"
pid=

start() {
  : >"$LOG"
  "$BIN" --size "$SIZE" --listen "127.0.0.1:$PORT" --target-name "$IQN" \
    --state-dir "$DIR/state" --image-dir "$DIR/images" --hugepages off >>"$LOG" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do
    grep -q "listening on" "$LOG" && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 0.1
  done
  echo "target did not start"; cat "$LOG"; exit 1
}
stop() {
  kill -TERM "$pid"
  wait "$pid" || { echo "target exited non-zero"; cat "$LOG"; exit 1; }
}
trap '[[ -n $pid ]] && kill -9 $pid 2>/dev/null; rm -f "$DIR/fio.dat"' EXIT

# The disk through fio: one stream of 8 MiB O_DIRECT writes (the dump's and
# the restore's I/O size), fsync at the end; then read back.
fio_json() {
  fio --name="$1" --filename="$DIR/fio.dat" --size="$SIZE" --bs=8M --rw="$1" --direct=1 \
    --ioengine=psync --end_fsync=1 --output-format=json 2>/dev/null
}

# Rounds interleave the daemon and fio, so a drift of the disk (a virtual
# one drifts a lot) hits both alike; the medians and per-round ratios count.
ROUNDS=${ROUNDS:-3}
results=()
for round in $(seq 1 "$ROUNDS"); do
  start
  "$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed "$round" >/dev/null
  stop
  dump_line=$(grep "dumped to" "$LOG")
  start
  restore_line=$(grep "restored and verified" "$LOG")
  [[ $round == 1 ]] && "$FILL" --target "127.0.0.1:$PORT" --iqn "$IQN" --seed "$round" --check
  stop
  fio_w=$(fio_json write)
  fio_r=$(fio_json read)
  rm -f "$DIR/fio.dat"
  results+=("$dump_line" "$restore_line" "$fio_w" "$fio_r")
  echo "round $round: $(echo "$dump_line" | grep -o 'in [0-9.]* s ([0-9]* MiB/s') | restore $(echo "$restore_line" | grep -o 'in [0-9.]* s ([0-9]* MiB/s')"
done

mkdir -p build/bench
python3 - "${results[@]}" <<'PY' | tee build/bench/dump-restore.json
import json, re, statistics, sys
args = sys.argv[1:]
gib = 1 << 30
def rate(line):
    b = int(re.search(r"(\d+) bytes", line).group(1))
    s = float(re.search(r"in ([0-9.]+) s", line).group(1))
    return b / s / gib
rounds = []
for i in range(0, len(args), 4):
    d, r, fw, fr = args[i:i + 4]
    rounds.append({
        "dump_gib_s": rate(d), "restore_gib_s": rate(r),
        "fio_write_gib_s": json.loads(fw)["jobs"][0]["write"]["bw_bytes"] / gib,
        "fio_read_gib_s": json.loads(fr)["jobs"][0]["read"]["bw_bytes"] / gib,
    })
for x in rounds:
    x["dump_vs_fio_write"] = x["dump_gib_s"] / x["fio_write_gib_s"]
    x["restore_vs_fio_read"] = x["restore_gib_s"] / x["fio_read_gib_s"]
med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
med["dump_s_per_4gib"] = 4 / med["dump_gib_s"]
med["restore_s_per_4gib"] = 4 / med["restore_gib_s"]
r3 = lambda d: {k: round(v, 3) for k, v in d.items()}
print(json.dumps({"median": r3(med), "rounds": [r3(x) for x in rounds]}, indent=1))
PY
