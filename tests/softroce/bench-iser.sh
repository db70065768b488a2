#!/usr/bin/env bash
# rdma-bench over SoftRoCE, one guest boot:
#   1. (the RDMA transport floor: measured inside the compare below, in
#      the same run, against floor-server; bench-floor.sh measures it alone)
#   2. rdma-bench compare: ramslog-target vs LIO (kernel target, RAM LUN),
#      both over iSER, 4 KiB writes at QD1 interleaved in rounds (plain
#      WRITE: what Linux sends to a write-through LUN, and LIO refuses FUA
#      unless its write cache is on), with the floor
#      measured in the same run: table, JSON and the SVG percentile plot,
#   3. lat over iSER at QD8 (pipelining through registered buffers),
#   4. rdma-bench report: a second ramslog-target with --metrics, attached by
#      the kernel initiator over iSER; the report of this (emulated) machine
#      with LIO for comparison, the floor, fio on the attached LUN and the
#      target's own service times: JSON, SVG and markdown, marked emulated,
#      IQNs and addresses redacted,
#   5. the one-command demo: rdma-bench lat --softroce NETDEV on a fresh veth
#      pair (rxe device + ramslog-target created and torn down by rdma-bench).
# Everything on one rxe address (rxe cannot connect across its two devices
# in one namespace); LIO on port 3261. Results: $RESULTS/bench-iser-*.
#
#   tests/softroce/run tests/softroce/bench-iser.sh [SECONDS]
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"
# Reported, not asserted: five alternating rounds of 4 s each (thousands
# of I/Os per round under emulation) keep the ratio stable.
BENCH_SECS=${1:-4}
. "$HERE/lib/lio.sh"
. "$HERE/lib/iscsi.sh"
BENCH=$(pick_bin rdma-bench) || { echo "build rdma-bench first"; exit 1; }
# shellcheck disable=SC2034 # read by target_start
TARGET_BIN=$(pick_bin ramslog-target) || { echo "build ramslog-target first"; exit 1; }
IQN=iqn.2026-11.org.ramslog:bench
LIO_IQN=iqn.2026-11.org.ramslog.lab:lio-bench
INI=iqn.2026-11.org.ramslog:rdma-bench
PIDS=()
cleanup() {
  local p
  iscsid_stop
  for p in "${PIDS[@]}"; do stop_pid "$p"; done
  # LIO is left configured: the guest is thrown away.
  ip link del rsb-x 2>/dev/null || true
  rxe_down
}
mkdir -p "$RESULTS"

step "rxe up; floor-server, ramslog-target and LIO on $RXE_ADDR_A (bench $BENCH)"
rxe_up
trap cleanup EXIT
"$BENCH" floor-server --listen "$RXE_ADDR_A:7470" --spin 0 2>"$RESULTS/bench-floor-server.log" &
FLOOR_PID=$!
PIDS+=("$FLOOR_PID")
target_start "$RESULTS/bench-ramslog-target.log" "iSER listening on $RXE_ADDR_A:3260" \
  --size 256M --ephemeral --listen "$RXE_ADDR_A:3260" --target-name "$IQN" --allow "$INI" --iser-spin 0
PIDS+=("$TARGET_STARTED")
lio_export "$LIO_IQN" "$RXE_ADDR_A" rdbench iser 3261
wait_for_log "$RESULTS/bench-floor-server.log" "listening on" "$FLOOR_PID"

step "compare over iSER: ramslog-target vs LIO, 4 KiB write QD1, ${BENCH_SECS} s each in 5 rounds, floor in the same run"
"$BENCH" compare "iser://$RXE_ADDR_A:3260/$IQN/0" "iser://$RXE_ADDR_A:3261/$LIO_IQN/0" \
  --pattern write --qd 1 --time "$BENCH_SECS" --rounds 5 --warmup 1 --spin 0 --initiator-name "$INI" \
  --floor "$RXE_ADDR_A:7470" --quiet --plot "$RESULTS/bench-iser-write-qd1.svg" --json \
  >"$RESULTS/bench-iser-write-qd1.json"
python3 - "$RESULTS/bench-iser-write-qd1.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"{'target':<58} {'IOPS':>7} {'p50 us':>8} {'p99 us':>8} {'ratio':>6} {'adds us':>8}")
for r in j["results"]:
    s = r["summary"]; l = s["lat_us"]
    print(f"{r['target']['url'] + ' (' + r['target']['product'] + ')':<58} {s['iops']:>7.0f} {l['p50']:>8.1f} {l['p99']:>8.1f} "
          f"{r.get('p50_ratio') or 1.0:>6.2f} {r.get('target_adds_us', float('nan')):>8.1f}")
for f in j["floors"]:
    l = f["summary"]["lat_us"]
    print(f"{'floor: ' + f['shape']:<58} {f['summary']['iops']:>7.0f} {l['p50']:>8.1f} {l['p99']:>8.1f}")
assert len(j["results"]) == 2 and all(r["summary"]["ios"] > 0 for r in j["results"])
assert j["floors"] and j["floors"][0]["summary"]["ios"] > 0
PY
[ -s "$RESULTS/bench-iser-write-qd1.svg" ]

step "lat over iSER, 64 KiB writes at QD8 (RDMA READ of the rest after 8 KiB immediate data)"
"$BENCH" lat "iser://$RXE_ADDR_A:3260/$IQN/0" --bs 64K --qd 8 --pattern write --time 3 --warmup 0.5 \
  --spin 0 --initiator-name "$INI" --quiet

step "rdma-bench report: ramslog (with --metrics) vs LIO over iSER, floor, fio via the kernel initiator"
REPORT_IQN=iqn.2026-11.org.ramslog:report
iscsid_start
HOST_INI=$(initiator_name)
# Its own daemon: service times cost clock reads, which the compare above
# must not pay.
target_start "$RESULTS/bench-report-target.log" "iSER listening on $RXE_ADDR_A:3262" \
  --size 128M --ephemeral --listen "$RXE_ADDR_A:3262" --target-name "$REPORT_IQN" \
  --allow "$INI" --allow "$HOST_INI" --iser-spin 0 --metrics 127.0.0.1:9105 \
  --control-socket /run/ramslog-report.sock
PIDS+=("$TARGET_STARTED")
iscsiadm -m discovery -t sendtargets -p "$RXE_ADDR_A:3262" -I iser >/dev/null
timeout 60 iscsiadm -m node -T "$REPORT_IQN" -p "$RXE_ADDR_A:3262" -I iser --login
disk=$(iscsi_disk "$REPORT_IQN")
echo "kernel initiator: $REPORT_IQN is $disk"
rm -rf "$RESULTS/report"
# LIO's LUN holds the compare run's data: without --overwrite the report refuses it.
if "$BENCH" report "iser://$RXE_ADDR_A:3262/$REPORT_IQN/0" --compare "iser://$RXE_ADDR_A:3261/$LIO_IQN/0" \
  --time 1 --spin 0 --initiator-name "$INI" --out /tmp/report-refused 2>/tmp/report-refused.err; then
  echo "rdma-bench report wrote over a LUN that holds data"; exit 1
fi
grep "holds data" /tmp/report-refused.err
"$BENCH" report "iser://$RXE_ADDR_A:3262/$REPORT_IQN/0" --compare "iser://$RXE_ADDR_A:3261/$LIO_IQN/0" \
  --floor "$RXE_ADDR_A:7470" --metrics 127.0.0.1:9105 --device "$disk" --time 2 --spin 0 --overwrite \
  --initiator-name "$INI" --out "$RESULTS/report"
timeout 60 iscsiadm -m node -T "$REPORT_IQN" -p "$RXE_ADDR_A:3262" --logout
sed -n '1,40p' "$RESULTS/report/report.md"
python3 - "$RESULTS/report/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["emulated"] is True and r["machine"]["emulated"], "the lab's report is not marked emulated"
assert any(d["software"] for d in r["machine"]["rdma_devices"]), r["machine"]["rdma_devices"]
assert r["redacted"] and r["machine"]["hostname"] == "redacted"
assert len(r["runs"]) == 8 and len({(x["workload"], x["url"]) for x in r["runs"]}) == 8, r["runs"]
ours = [x for x in r["runs"] if "iqn.redacted:target-1" in x["url"]]
assert len(ours) == 4 and all(x["summary"]["ios"] > 0 for x in ours), ours
# LIO refuses FUA with its write cache off: those runs are recorded as failed.
lio = [x for x in r["runs"] if "iqn.redacted:target-2" in x["url"]]
assert all(x["summary"]["ios"] > 0 for x in lio if "zil" in x["workload"]), lio
assert all(x.get("error") for x in lio if "Fua" in x["workload"]), lio
assert r["floors"] and r["floors"][0]["summary"]["ios"] > 0
assert r["fio"]["ios"] > 0, r["fio"]
kinds = {k["kind"]: k for k in r["target_side"]["kinds"]}
assert kinds["write"]["commands"] > 0 and kinds["flush"]["commands"] > 0, kinds
assert kinds["write"]["p99_us_at_most"], kinds
print("report: emulated, 8 runs, floor, fio %.0f IOPS, target-side writes %d" % (r["fio"]["iops"], kinds["write"]["commands"]))
PY
grep -q EMULATED "$RESULTS/report/report.md"
[ -s "$RESULTS/report/latency.svg" ]
if grep -l -e "$REPORT_IQN" -e "$LIO_IQN" -e "$INI" -e "$RXE_ADDR_A" -e "$HOST_INI" "$RESULTS"/report/*; then
  echo "the report names an IQN or an address"; exit 1
fi

step "rdma-bench lat --softroce: its own rxe device and ramslog-target on a fresh veth"
ip link add rsb-x type veth peer name rsb-y
ip addr add 10.98.0.1/24 dev rsb-x
ip link set rsb-x up; ip link set rsb-y up
"$BENCH" lat --softroce rsb-x --time 2 --warmup 0.5 --spin 0 --pattern fua --quiet
if rdma link show | grep -q "rsb-rsb-x"; then echo "the demo left its rxe device behind"; exit 1; fi
if pgrep -f "softroce-demo" >/dev/null; then echo "the demo left its target running"; exit 1; fi
echo "BENCH ISER PASSED"
