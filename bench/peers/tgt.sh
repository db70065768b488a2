#!/usr/bin/env bash
# A Debian tgt (user-space iSCSI target) to compare against, on loopback:
#   bench/peers/tgt.sh start [PORT]   -> LUN 1 backed by a 1 GiB file in /dev/shm
#   bench/peers/tgt.sh stop
# Uses its own management port (-C 57), so it never touches another tgtd.
# Installs the `tgt` package when it is missing (needs root).
set -euo pipefail
CP=57
IQN=iqn.2026-11.org.ramslog.peers:tgt
IMG=/dev/shm/ramslog-bench-tgt.img
PIDFILE=/run/ramslog-bench-tgtd.pid
cmd=${1:-}; PORT=${2:-3261}
case $cmd in
start)
  command -v tgtd >/dev/null || {
    [ "$(id -u)" = 0 ] || { echo "tgt is not installed: apt-get install tgt (as root)" >&2; exit 1; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tgt >/dev/null
  }
  [ -f "$IMG" ] || dd if=/dev/zero of="$IMG" bs=1M count=1024 status=none
  mkdir -p /var/run/tgtd
  tgtd -f -C "$CP" --iscsi portal=127.0.0.1:"$PORT" >/tmp/ramslog-bench-tgtd.log 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 50); do tgtadm -C "$CP" --lld iscsi --op show --mode target >/dev/null 2>&1 && break; sleep 0.1; done
  T="tgtadm -C $CP --lld iscsi"
  $T --op new --mode target --tid 1 -T "$IQN"
  $T --op new --mode logicalunit --tid 1 --lun 1 --bstype rdwr -b "$IMG"
  $T --op bind --mode target --tid 1 -I ALL
  echo "iscsi://127.0.0.1:$PORT/$IQN/1"
  ;;
stop)
  if [ -f "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE")
    tgtadm -C "$CP" --op update --mode sys --name State -v offline >/dev/null 2>&1 || true
    tgtadm -C "$CP" --op delete --mode system >/dev/null 2>&1 || true
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
  fi
  rm -f "$IMG"
  ;;
*) echo "usage: $0 start [PORT] | stop" >&2; exit 2 ;;
esac
