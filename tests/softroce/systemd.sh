#!/usr/bin/env bash
# Lab: ramslog-target installed from its .deb and run by Debian's systemd 252
# as PID 1 (the guest boots it: RAMSLOG_SOFTROCE_INIT=systemd; check.sh runs
# this script that way), in the cases where systemd's own behaviour decides
# what survives. The LUN is 8 MiB over iSCSI/TCP on loopback; between cases
# lun-fill writes it whole with a new seed, and after each case it must read
# back the last seed written (every acknowledged write).
#   a. install: dpkg -i starts nothing; start; fill
#   b. systemctl reload: the same main PID, content from the kept memory
#   c. kill -9 of the main PID: systemd starts it again with the fd store
#      intact; content from the kept memory; kill -> READY timed
#   d. an OOM kill of the main PID (sysrq f, its oom_score_adj raised)
#   e. a crash loop past systemd's default start limit (6 kills in a row,
#      each shown to land in a start-up: waiting for a lock flock holds)
#   f. daemon-reload and daemon-reexec, then kill -9: the store survives both
#   g. a broken new binary (one that cannot run, one that fails its handover
#      check): reload is refused, the daemon serves on; a new program that
#      dies before READY: reload fails at once, the unit comes back from
#      the memory handed over
#   h. a dpkg -i upgrade: the package restarts nothing; reload runs the new file
#   i. systemctl kill (SIGTERM): the daemon dumps and ends; the store is
#      dropped (a clean exit); start restores the image
#   j. a stop during start-up (after a kill -9, while the next daemon waits
#      for the state directory's lock a straggler holds): once it has the
#      lock it takes the memory over, dumps it, ends; start restores the image
#   k. stop, start: the image path
#   l. a process left in the unit's cgroup (an ExecStartPre straggler) at a
#      crash: the kept memory NOT READY naming it, take-over refused; once
#      it ends, status offers take-over, which serves the memory; then
#      systemctl restart: the store survives it
#   tests/softroce/systemd.sh [DEB [UPGRADE]]
# DEB: default the newest build/deb/ramslog_*.deb; UPGRADE: the package
# installed over it in case h (default: DEB repacked here with a higher
# version; check.sh repacks it on the host, where that is quicker).
#   tests/softroce/systemd.sh --upgrade-package DEB OUT   (only that repacking)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib/common.sh"

# DEB repacked as OUT with the version "+lab1" higher (the same files: what
# matters to the case is dpkg replacing the running binary's file).
upgrade_package() {
  local tree
  tree=$(mktemp -d)
  dpkg-deb -R "$1" "$tree/pkg"
  sed -i "s/^Version: \(.*\)/Version: \1+lab1/" "$tree/pkg/DEBIAN/control"
  dpkg-deb --root-owner-group -Znone -b "$tree/pkg" "$2" >/dev/null
  rm -rf "$tree"
}
if [ "${1:-}" = --upgrade-package ]; then
  upgrade_package "$2" "$3"
  exit 0
fi

if [ "$(cat /proc/1/comm)" != systemd ]; then
  echo "this needs systemd as PID 1; run it as"
  echo "  RAMSLOG_SOFTROCE_MODE=guest RAMSLOG_SOFTROCE_INIT=systemd tests/softroce/run $0"
  exit 1
fi
DEB=${1:-$(ls -t "$REPO"/build/deb/ramslog_*.deb 2>/dev/null | head -1)}
[ -f "$DEB" ] || { echo "no .deb: build it first (target/debian/build-deb.sh)"; exit 1; }
UPGRADE=${2:-}
FILL=$(pick_bin lun-fill) || { echo "build lun-fill first (cargo build -p ramslog-tests)"; exit 1; }
UNIT=ramslog-target.service
IQN=iqn.2026-12.org.ramslog:lab
PORTAL=127.0.0.1:3260
SEED=0

fail() {
  echo "FAILED: $*"
  systemctl status --no-pager --lines=0 "$UNIT" || true
  ramslog-target status 2>&1 || true
  journalctl -u "$UNIT" --no-pager -n 80 -o short-monotonic || true
  exit 1
}
prop() { systemctl show -P "$1" "$UNIT"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# Until the unit is active and LUN 0 READY, under a main PID other than $1
# (when given).
wait_ready() {
  local not_pid=${1:-} i
  for ((i = 0; i < 1200; i++)); do
    if [ "$(prop ActiveState)" = active ] && [ "$(prop MainPID)" != "$not_pid" ] &&
      ramslog-target status 2>/dev/null | grep -qE '^  LUN 0 .*  ready$'; then
      return 0
    fi
    sleep 0.05
  done
  fail "not active and READY 60 s on (ActiveState $(prop ActiveState), MainPID $(prop MainPID))"
}
# The next seed over the whole LUN; then the content is that seed's.
fill() {
  SEED=$((SEED + 1))
  "$FILL" --target "$PORTAL" --iqn "$IQN" --seed "$SEED" >/dev/null || fail "writing the LUN with seed $SEED"
}
# The last seed written reads back, and status says where the content came from.
content_is_kept() {
  "$FILL" --target "$PORTAL" --iqn "$IQN" --seed "$SEED" --check >/dev/null ||
    fail "$1: the LUN does not hold what seed $SEED wrote"
  local st
  st=$(ramslog-target status)
  grep -q "$2" <<<"$st" || fail "$1: status does not say '$2'"
  echo "$1: every block written with seed $SEED is there; status: $(grep -m1 -E 'restored from' <<<"$st")"
}
FROM_MEMORY="restored from the memory kept from the previous run"
FROM_IMAGE="restored from /var/lib/ramslog/images"
# The guest's uptime in ms, the clock of the journal's monotonic stamps.
uptime_ms() { awk '{ printf "%d\n", $1 * 1000 }' /proc/uptime; }
# When systemd last logged the unit started (READY=1 received), in uptime ms.
started_ms() {
  journalctl -u "$UNIT" -o short-monotonic --no-pager |
    sed -n 's/^\[ *\([0-9]*\)\.\([0-9]\{3\}\)[0-9]*\].*Started ramslog-target.*/\1\2/p' | tail -1
}
# Kill the main PID (the kill command given), then wait for the next one to
# be READY; prints the time from the kill to systemd's "Started" (READY=1),
# read from the journal: polling here would add its own seconds.
crash() {
  local pid t0
  pid=$(prop MainPID)
  t0=$(uptime_ms)
  "$@" "$pid"
  wait_ready "$pid"
  echo "$* $pid -> READY=1 from $(prop MainPID) $(($(started_ms) - t0)) ms later (RestartSec=100ms included)"
}

step "a. install: dpkg -i $(basename "$DEB") starts nothing"
echo "PID 1: $(/lib/systemd/systemd --version | head -1); virtualization: $(systemd-detect-virt || true)"
if systemd-detect-virt --container >/dev/null; then fail "systemd takes this guest for a container"; fi
dpkg -i "$DEB" >/tmp/dpkg.log 2>&1 || { cat /tmp/dpkg.log; fail "dpkg -i"; }
[ "$(prop ActiveState)" = inactive ] || fail "the package started the service"
cat >/etc/ramslog/ramslog.toml <<EOF
listen = ["$PORTAL"]
state_dir = "/var/lib/ramslog"

[[target]]
name = "$IQN"

[[target.lun]]
lun = 0
size = "8M"
EOF
ramslog-target check-config /etc/ramslog/ramslog.toml
systemctl start "$UNIT" || fail "systemctl start"
wait_ready
echo "FileDescriptorStoreMax $(prop FileDescriptorStoreMax), Restart $(prop Restart), RestartUSec $(prop RestartUSec)"
fill

step "b. systemctl reload: a restart in place"
pid=$(prop MainPID)
t0=$(now_ms)
systemctl reload "$UNIT" || fail "systemctl reload"
echo "systemctl reload returned after $(($(now_ms) - t0)) ms"
wait_ready
[ "$(prop MainPID)" = "$pid" ] || fail "reload changed the main PID ($pid -> $(prop MainPID))"
content_is_kept "after reload" "$FROM_MEMORY"
fill

step "c. kill -9 of the main PID"
crash kill -KILL
content_is_kept "after kill -9" "$FROM_MEMORY"
[ "$(prop NRestarts)" -ge 1 ] || fail "systemd counted no restart"
fill

step "d. an OOM kill of the main PID"
oom_kill() { echo 1000 >"/proc/$1/oom_score_adj"; echo f >/proc/sysrq-trigger; }
pid=$(prop MainPID)
crash oom_kill
kernel_log=$(journalctl -k --no-pager)
grep -E "Killed process $pid|Out of memory" <<<"$kernel_log" | tail -2
grep -q "Killed process $pid " <<<"$kernel_log" || fail "the kernel's log names no OOM kill of $pid"
content_is_kept "after the OOM kill" "$FROM_MEMORY"
fill

# The journal's cursor now: what the unit logs after it is new.
cursor_now() { journalctl -u "$UNIT" -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'; }
# Until process $2 logged a line matching $3 after cursor $1 (30 s).
logged_by() {
  local w
  for ((w = 0; w < 300; w++)); do
    journalctl -u "$UNIT" -o cat --after-cursor "$1" --no-pager "_PID=$2" 2>/dev/null | grep -q "$3" && return 0
    sleep 0.1
  done
  return 1
}

step "e. a crash loop: six kills in a row, each during the next daemon's start-up"
# Each next daemon waits in its start-up for the state directory's lock,
# which flock(1) holds (a straggler of the old run), and says so: each kill
# is shown to land in a start-up, not after READY=1.
restarts0=$(prop NRestarts)
flock -x -F /var/lib/ramslog sleep 300 &
holder=$!
pid=$(prop MainPID)
for i in 0 1 2 3 4 5 6; do
  cursor=$(cursor_now)
  kill -KILL "$pid"
  for ((w = 0; w < 400; w++)); do
    new=$(prop MainPID)
    [ "$new" != 0 ] && [ "$new" != "$pid" ] && break
    sleep 0.025
  done
  logged_by "$cursor" "$new" "waiting for it" || fail "kill $i: the next daemon $new never waited for the lock"
  [ "$(prop ActiveState)" = activating ] || fail "kill $i: the next daemon $new is $(prop ActiveState), not starting"
  [ "$i" = 0 ] || echo "kill $i: $pid, in its start-up; the next, $new, waits for the lock"
  [ "$i" = 6 ] || pid=$new
done
kill "$holder"
wait "$holder" 2>/dev/null || true
wait_ready
[ "$(prop NRestarts)" -ge $((restarts0 + 7)) ] || fail "fewer than 7 restarts counted: $(prop NRestarts)"
[ "$(prop Result)" = success ] || echo "(Result is $(prop Result): systemd's last exit reason, not a failed unit)"
content_is_kept "after the crash loop" "$FROM_MEMORY"
fill

step "f. daemon-reload and daemon-reexec keep the store"
systemctl daemon-reload
systemctl daemon-reexec
crash kill -KILL
content_is_kept "after daemon-reload, daemon-reexec and kill -9" "$FROM_MEMORY"
fill

step "g. a broken new binary: reload is refused, nothing changes"
pid=$(prop MainPID)
cp /usr/bin/ramslog-target /tmp/ramslog-target.good
# Put FILE at /usr/bin/ramslog-target (a rename: the running file is busy).
install_binary() {
  cp "$1" /usr/bin/ramslog-target.new
  chmod 755 /usr/bin/ramslog-target.new
  mv -f /usr/bin/ramslog-target.new /usr/bin/ramslog-target
}
# g1. A file that cannot run at all: systemd's ExecReload (the file's own
# `restart --wait`) fails before it reaches the daemon.
head -c 4096 /tmp/ramslog-target.good >/tmp/ramslog-target.truncated
install_binary /tmp/ramslog-target.truncated
if systemctl reload "$UNIT"; then fail "reload with a truncated binary succeeded"; fi
# g2. A binary that runs but fails its handover check (what a missing
# library or a refused configuration looks like to the daemon).
printf '%s\n' '#!/bin/sh' 'for a in "$@"; do' \
  '  [ "$a" = --handover-check ] && { echo "lab: this build refuses every handover" >&2; exit 1; }' \
  'done' 'exec /tmp/ramslog-target.good "$@"' >/tmp/ramslog-target.fails-check
install_binary /tmp/ramslog-target.fails-check
cursor=$(journalctl -u "$UNIT" -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p')
if systemctl reload "$UNIT"; then fail "reload with a binary that fails its check succeeded"; fi
refusal=$(journalctl -u "$UNIT" --no-pager -o cat --after-cursor "$cursor")
grep -q "lab: this build refuses every handover" <<<"$refusal" ||
  { echo "$refusal"; fail "the refusal does not give the check's reason"; }
grep -m2 -E "refus|handover-check" <<<"$refusal" || true
[ "$(prop MainPID)" = "$pid" ] && [ "$(prop ActiveState)" = active ] || fail "the daemon did not serve on"
install_binary /tmp/ramslog-target.good
"$FILL" --target "$PORTAL" --iqn "$IQN" --seed "$SEED" --check >/dev/null || fail "the content changed"
echo "both refused; main PID $pid serves on with its content"
fill

# g3. A reload whose new program dies before it is READY (killed here while
# it takes its time): systemctl reload (the unit's ExecReload, restart
# --wait) fails at once, not after its 300 s bound; systemd starts the unit
# again and the memory handed over is served.
printf '%s\n' '#!/bin/sh' \
  '[ -n "$RAMSLOG_HANDOVER" ] && { echo "lab: the new program takes its time" >&2; sleep 300; }' \
  'exec /tmp/ramslog-target.good "$@"' >/tmp/ramslog-target.slow
install_binary /tmp/ramslog-target.slow
pid=$(prop MainPID)
cursor=$(cursor_now)
systemctl reload "$UNIT" >/tmp/reload.out 2>&1 &
reloading=$!
logged_by "$cursor" "$pid" "the new program takes its time" || fail "the reload never reached the new program"
t0=$(now_ms)
kill -KILL "$pid"
if wait "$reloading"; then fail "systemctl reload succeeded though its new program died"; fi
took=$(($(now_ms) - t0))
echo "systemctl reload failed $took ms after the new program died: $(tail -1 /tmp/reload.out)"
[ "$took" -lt 20000 ] || fail "systemctl reload took $took ms to notice the daemon died"
install_binary /tmp/ramslog-target.good
wait_ready "$pid"
content_is_kept "after a reload whose new program died" "$FROM_MEMORY"
fill

step "h. a dpkg -i upgrade, then systemctl reload"
[ -n "$UPGRADE" ] || { UPGRADE=/tmp/ramslog-upgrade.deb; upgrade_package "$DEB" "$UPGRADE"; }
pid=$(prop MainPID)
dpkg -i "$UPGRADE" >/tmp/dpkg.log 2>&1 || { cat /tmp/dpkg.log; fail "dpkg -i (upgrade)"; }
echo "installed $(dpkg-query -W -f='${Version}' ramslog); the daemon runs $(readlink "/proc/$pid/exe")"
[ "$(prop MainPID)" = "$pid" ] && [ "$(prop ActiveState)" = active ] || fail "the upgrade restarted the daemon"
systemctl reload "$UNIT" || fail "systemctl reload after the upgrade"
wait_ready
[ "$(prop MainPID)" = "$pid" ] || fail "reload changed the main PID"
case $(readlink "/proc/$pid/exe") in *deleted*) fail "the daemon still runs the replaced file" ;; esac
echo "after reload the daemon runs $(readlink "/proc/$pid/exe")"
content_is_kept "after the upgrade" "$FROM_MEMORY"
fill

step "i. systemctl kill: SIGTERM dumps, the unit ends cleanly, the store goes"
systemctl kill "$UNIT"
for ((w = 0; w < 1200; w++)); do [ "$(prop ActiveState)" = inactive ] && break; sleep 0.05; done
[ "$(prop ActiveState)" = inactive ] || fail "still $(prop ActiveState) 60 s after systemctl kill"
systemctl start "$UNIT" || fail "systemctl start"
wait_ready
content_is_kept "after systemctl kill and start" "$FROM_IMAGE"
fill

step "j. a stop during start-up"
# The next daemon waits for the state directory's lock, which flock(1) takes
# the moment the killed one lets it go (a straggler of the old run): a
# start-up step that lasts until the lock is released, so the stop lands in it.
# -F: flock holds the lock in the process it runs (no child to outlive it).
flock -x -F /var/lib/ramslog sleep 300 &
holder=$!
pid=$(prop MainPID)
cursor=$(cursor_now)
kill -KILL "$pid"
for ((w = 0; w < 600; w++)); do
  grep -q "waiting for it" <<<"$(journalctl -u "$UNIT" -o cat --after-cursor "$cursor" --no-pager)" && break
  sleep 0.1
done
waiting=$(prop MainPID)
echo "the next daemon $waiting is $(prop ActiveState): $(prop StatusText)"
[ "$(prop ActiveState)" = activating ] || fail "the next daemon is not waiting in its start-up"
systemctl stop --no-block "$UNIT"
# The stop is shown to reach the waiting daemon: its own line, not a delay.
logged_by "$cursor" "$waiting" "stopping once the state directory's lock is had" ||
  fail "the waiting daemon $waiting never read the stop"
echo "stop read by $waiting while it waits; the unit is $(prop ActiveState) ($(prop SubState)); now the lock is let go"
kill "$holder"
wait "$holder" 2>/dev/null || true
for ((w = 0; w < 1200; w++)); do [ "$(prop ActiveState)" = inactive ] && break; sleep 0.05; done
[ "$(prop ActiveState)" = inactive ] || fail "still $(prop ActiveState) 60 s after the stop"
[ "$(prop Result)" = success ] || fail "the stop ended $(prop Result)"
journalctl -u "$UNIT" --no-pager -o cat -n 6 | grep -E "dump|stopped|stop" || true
systemctl start "$UNIT" || fail "systemctl start"
wait_ready
content_is_kept "after a stop during start-up" "$FROM_IMAGE"
fill

step "k. stop and start: the image"
systemctl stop "$UNIT" || fail "systemctl stop"
[ "$(prop Result)" = success ] || fail "the stop ended $(prop Result)"
systemctl start "$UNIT" || fail "systemctl start"
wait_ready
content_is_kept "after stop and start" "$FROM_IMAGE"

step "l. a process left in the unit's cgroup holds kept memory back until it ends"
# A drop-in's ExecStartPre leaves a process in the unit's cgroup (as a
# straggler a kill could not reach would be) while /run/ramslog-lab-stray
# exists, and writes its pid there. The next daemon must not serve the kept
# memory while it runs, and must offer take-over once it ends.
dropin=/etc/systemd/system/$UNIT.d/lab-stray.conf
mkdir -p "$(dirname "$dropin")"
cat >"$dropin" <<'DROPIN'
[Service]
ExecStartPre=/bin/sh -c 'if [ -e /run/ramslog-lab-stray ]; then setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $! >/run/ramslog-lab-stray; fi'
DROPIN
systemctl daemon-reload
touch /run/ramslog-lab-stray
pid=$(prop MainPID)
kill -KILL "$pid"
for ((w = 0; w < 1200; w++)); do
  new=$(prop MainPID)
  if [ "$(prop ActiveState)" = active ] && [ "$new" != "$pid" ] && [ "$new" != 0 ] &&
    ramslog-target status 2>/dev/null | grep -qE '^  LUN 0 '; then
    break
  fi
  sleep 0.05
done
stray=$(cat /run/ramslog-lab-stray)
[ -n "$stray" ] && [ -d "/proc/$stray" ] || fail "the drop-in left no process in the unit's cgroup"
grep -qx "$stray" "/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$(prop MainPID)/cgroup")/cgroup.procs" ||
  fail "process $stray is not in the unit's cgroup"
st=$(ramslog-target status)
grep -qE '^  LUN 0 .*  ready$' <<<"$st" && fail "LUN 0 is READY while process $stray in the unit's cgroup may still write"
grep -q "still holds process(es) $stray" <<<"$st" || { echo "$st"; fail "status does not name process $stray in the unit's cgroup"; }
grep -q "has since ended" <<<"$st" && fail "status says the writer has ended while $stray runs"
grep -q "let it end or kill it" <<<"$st" || fail "status does not say to let process $stray end"
echo "with $stray in the unit's cgroup, status says: $(grep -m1 -o "the unit's cgroup.*" <<<"$st")"
ramslog-target take-over >/tmp/take-over.out 2>&1 && fail "take-over was not refused while $stray runs"
echo "take-over refused while $stray runs: $(head -1 /tmp/take-over.out)"
rm -f /run/ramslog-lab-stray
kill "$stray"
for ((w = 0; w < 100; w++)); do [ -d "/proc/$stray" ] || break; sleep 0.05; done
st=$(ramslog-target status)
{ grep -q "has since ended" <<<"$st" && grep -q "take-over" <<<"$st"; } ||
  { echo "$st"; fail "status does not offer take-over once $stray ended"; }
grep -q "accept-empty would" <<<"$st" || fail "status does not warn off accept-empty"
pid=$(prop MainPID)
ramslog-target take-over || fail "take-over once $stray ended"
wait_ready "$pid"
content_is_kept "after the process in the unit's cgroup ended and take-over" "$FROM_MEMORY"
# systemctl restart keeps the store (a job is queued for the unit while it
# is down): the memory serves again, though the SIGTERM dumped it too.
systemctl restart "$UNIT" || fail "systemctl restart"
wait_ready
content_is_kept "after systemctl restart" "$FROM_MEMORY"
rm -f "$dropin"
systemctl daemon-reload
fill

ramslog-target status
systemctl stop "$UNIT"
echo "SYSTEMD LAB PASSED"
