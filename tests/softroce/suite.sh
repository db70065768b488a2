#!/usr/bin/env bash
# The short lab scripts in one guest boot, one after the other:
#
#   tests/softroce/run tests/softroce/suite.sh LIST_FILE
#
# LIST_FILE holds one script per line ("SCRIPT [ARGS]", relative to
# tests/softroce/, optionally prefixed "TIMEOUT_SECONDS:", then "xfail:" for a
# regression test committed before its fix: its failure counts as a pass and
# its passing as a failure, so the mark goes with the fix). Each runs with its
# own timeout; a failed script does not stop the others. Between two scripts
# the baseline must hold: no rxe link and no lab veth, an empty LIO configfs,
# no iSCSI session, no ramslog-target process, the mounts and the kernel
# modules the guest booted with (modules a script loaded are unloaded first).
# When it does not hold, the scripts not yet run are written to
# LIST_FILE.rest and the suite stops, so that the caller runs them in a fresh
# guest (tests/softroce/check.sh does).
#
# Results, one line per script, go to $RESULTS/suite.tsv (script, exit code,
# seconds, its output in $RESULTS/script-logs/) and, when RAMSLOG_TIMES is set, to that file as "lab" lines. The
# exit code is 64 + the number of failed scripts (a baseline break counts as
# one more), so the caller also proves the harness hands the guest's exit
# code back: it compares the code with the results.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS=${RESULTS:-$(cd "$HERE/../.." && pwd)/build/softroce/results}
LIST=${1:?usage: suite.sh LIST_FILE}
mkdir -p "$RESULTS"
: >"$RESULTS/suite.tsv"
rm -f "$LIST.rest"

mounts_now() { awk '{print $2}' /proc/mounts | sort; }
modules_now() { awk '{print $1}' /proc/modules | sort; }
boot_mounts=$(mounts_now)
boot_modules=$(modules_now)

# Unload what the last script loaded, dependents first (a few passes: a
# module goes once nothing uses it).
unload_new_modules() {
  local pass m d
  # LIO's configfs groups hold its modules: an emptied target's groups go
  # first (rmdir fails on a group that still has children, by design).
  for d in /sys/kernel/config/target/iscsi /sys/kernel/config/target/core/*_*; do
    [ -d "$d" ] && rmdir "$d" 2>/dev/null
  done
  for pass in 1 2 3 4 5 6; do
    local extra
    extra=$(comm -13 <(echo "$boot_modules") <(modules_now))
    [ -z "$extra" ] && return 0
    for m in $extra; do
      [ "$(awk -v m="$m" '$1 == m {print $3}' /proc/modules)" = 0 ] && rmmod "$m" 2>/dev/null
    done
  done
}

# Prints what breaks the baseline; nothing when it holds.
baseline_breaks() {
  rdma link show 2>/dev/null | grep -q . && echo "an rxe link is left: $(rdma link show | head -2 | tr '\n' ' ')"
  ip -o link show 2>/dev/null | grep -q ' rsl-' && echo "a lab veth is left"
  if [ -d /sys/kernel/config/target ]; then
    ls /sys/kernel/config/target/iscsi 2>/dev/null | grep -q '^iqn' && echo "LIO still has an iSCSI target"
    for hba in /sys/kernel/config/target/core/*_*; do
      [ -d "$hba" ] || continue
      find "$hba" -mindepth 1 -maxdepth 1 -type d | grep -q . && echo "LIO still has a backstore in $hba"
    done
  fi
  ls /sys/class/iscsi_session 2>/dev/null | grep -q . && echo "an iSCSI session is left"
  pgrep -x ramslog-target >/dev/null && echo "a ramslog-target process is left"
  unload_new_modules
  local m
  m=$(comm -3 <(echo "$boot_modules") <(modules_now) | tr -d '\t' | tr '\n' ' ')
  [ -n "${m// /}" ] && echo "modules differ from the boot's: $m"
  m=$(comm -3 <(echo "$boot_mounts") <(mounts_now) | tr -d '\t' | tr '\n' ' ')
  [ -n "${m// /}" ] && echo "mounts differ from the boot's: $m"
  return 0
}

mapfile -t entries < <(grep -v '^[[:space:]]*\(#\|$\)' "$LIST")
failed=0
for i in "${!entries[@]}"; do
  entry=${entries[i]}
  timeout=1200
  if [[ $entry =~ ^([0-9]+):(.*)$ ]]; then timeout=${BASH_REMATCH[1]} entry=${BASH_REMATCH[2]}; fi
  xfail=
  if [[ $entry =~ ^xfail:(.*)$ ]]; then xfail=yes entry=${BASH_REMATCH[1]}; fi
  read -r -a cmd <<<"$entry"
  echo
  echo "##### suite: $entry (timeout ${timeout} s)"
  t0=$(date +%s)
  log=$RESULTS/script-logs/$(tr -c 'A-Za-z0-9.\n-' _ <<<"$entry").log
  mkdir -p "$(dirname "$log")"
  # timeout signals its whole process group: the script and its children.
  # Its output goes to a file that is streamed (not piped: a daemon the
  # script leaves behind would hold a pipe open), so that the caller can
  # show a failed script's end after the summary.
  timeout -k 10 "$timeout" bash "$HERE/${cmd[0]}" "${cmd[@]:1}" </dev/null >"$log" 2>&1 &
  pid=$!
  # Shortly before the timeout, a picture of what still runs and where it
  # waits, so that a hang names itself.
  (
    sleep $((timeout > 60 ? timeout - 20 : timeout))
    echo "##### suite: $entry still runs after $((timeout > 60 ? timeout - 20 : timeout)) s; the processes and where they wait:"
    ps -eo pid,ppid,stat,etimes,wchan:28,args --forest | grep -v ' \[.*\]$'
  ) >>"$log" 2>&1 &
  watchdog=$!
  tail -n +1 -f --pid="$pid" "$log"
  wait "$pid"
  rc=$?
  kill "$watchdog" 2>/dev/null
  wait "$watchdog" 2>/dev/null
  secs=$(($(date +%s) - t0))
  status=passed
  [ "$rc" = 0 ] || status=FAILED
  [ "$rc" = 124 ] && status="TIMED OUT"
  if [ -n "$xfail" ]; then
    if [ "$rc" = 0 ]; then
      status="UNEXPECTEDLY PASSED (drop its xfail mark)" rc=1
    else
      status="failed as expected (exit $rc)" rc=0
    fi
  fi
  [ "$rc" = 0 ] || failed=$((failed + 1))
  printf '%s\t%s\t%s\t%s\n' "$entry" "$rc" "$secs" "$log" >>"$RESULTS/suite.tsv"
  [ -n "${RAMSLOG_TIMES:-}" ] && printf 'lab\t%s\t%s\t%s\n' "$entry" "$status" "$secs" >>"$RAMSLOG_TIMES"
  echo "##### suite: $entry $status (exit $rc) in $secs s"
  if ((i + 1 < ${#entries[@]})); then
    breaks=$(baseline_breaks)
    if [ -n "$breaks" ]; then
      echo "##### suite: the baseline does not hold after $entry; the rest run in a fresh guest:"
      echo "$breaks" | sed 's/^/#####   /'
      printf '%s\n' "${entries[@]:i+1}" >"$LIST.rest"
      failed=$((failed + 1))
      printf '%s\t%s\t%s\n' "(baseline after $entry)" 1 0 >>"$RESULTS/suite.tsv"
      break
    fi
  fi
done
exit $((64 + failed))
