# Sourced by lab test scripts: the one sync-write job every device is measured
# with (the ZFS log pattern: 4 KiB random writes, O_DIRECT + O_SYNC, QD1, fixed
# time), summarised as JSON so runs in one boot can be compared side by side.
#
#   fio_sync_qd1 NAME DEVICE SECONDS OUTDIR   -> OUTDIR/NAME.json, one line on stdout
#
# FIO_SYNC_FLAGS chooses how each write is made durable: O_DIRECT + O_SYNC on
# a block device (the default); a file on a `sync=always` ZFS dataset uses
# "--fsync=1 --size=128M" (every write is a ZIL commit, then an fsync).

fio_sync_qd1() {
  local name=$1 dev=$2 secs=$3 out=$4
  mkdir -p "$out"
  # shellcheck disable=SC2086 # FIO_SYNC_FLAGS is a list of options
  timeout $((secs + 120)) fio --name="$name" --filename="$dev" --rw=randwrite --bs=4k ${FIO_SYNC_FLAGS:---direct=1 --sync=1} \
    --ioengine=psync --iodepth=1 --runtime="$secs" --time_based --percentile_list=50:99:99.9 \
    --output-format=json --output="$out/$name.fio.json" >/dev/null 2>&1 || { echo "fio $name failed" >&2; return 1; }
  python3 - "$out/$name.fio.json" "$name" "$dev" "${FIO_SYNC_FLAGS:---direct=1 --sync=1}" >"$out/$name.json" <<'PY' || return 1
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]["write"]
pct = job["clat_ns"]["percentile"]
print(json.dumps({
    "name": sys.argv[2], "device": sys.argv[3], "workload": "4k randwrite QD1 " + sys.argv[4],
    "iops": round(job["iops"], 1), "ios": job["total_ios"],
    "p50_us": pct["50.000000"] / 1e3, "p99_us": pct["99.000000"] / 1e3, "p99_9_us": pct["99.900000"] / 1e3,
    "mean_us": round(job["clat_ns"]["mean"] / 1e3, 1),
    "max_us": round(job["clat_ns"]["max"] / 1e3, 1),
}))
PY
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("FIO %(name)-14s iops=%(iops)8.1f p50=%(p50_us)8.1f p99=%(p99_us)8.1f p99.9=%(p99_9_us)8.1f us" % r)' "$out/$name.json"
  [ "$(python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["ios"] > 0))' "$out/$name.json")" = 1 ]
}
