#!/usr/bin/env bash
# A newcomer's first run on a fresh Debian 12, proved: debootstrap a minimal
# bookworm (plus sudo) into build/chroot/rootfs, give it only what rustup would
# (the host's ~/.rustup and ~/.cargo/bin, bind-mounted read-only) and the host's
# cargo registry cache (shared, so no crate is downloaded twice), then
#   1. as a normal user with sudo, in a fresh clone: target/quickstart.sh, until
#      the target answers a SendTargets discovery; `status` without flags; `stop`;
#   2. as root, on this checkout: tests/run-all.sh --prepare: the test
#      command's own install brings every package and tool its tiers need
#      onto a fresh machine, and everything builds there (the tests
#      themselves run once per CI run, on the host: what the chroot adds is
#      the fresh machine, not a second run of the same tests);
#   3. with Debian's ifupdown, open-iscsi and zfsutils-linux installed: the
#      shipped ramslog-zpool-import.service verifies and adds no ordering
#      cycle to the boot (ordering the early import after open-iscsi does);
#   4. the Debian package (target/debian/build-deb.sh) installs there, leaves
#      the service disabled, and lintian finds no error.
# The guest starts with libclang-cpp but not libclang (the trap bindgen falls
# into), so the packages check must tell them apart.
# Step 2 reuses this checkout's build/ (the release build of step 1 starts from
# nothing, so every build script and the linker already ran against the guest's
# packages); that keeps the check inside its time budget.
# Needs root (debootstrap, mounts). Network: deb.debian.org only.
set -euo pipefail
# A private mount namespace: every mount below dies with this run, even when
# the run is killed, so nothing can stay bind-mounted into build/chroot.
if [ -z "${RAMSLOG_CHROOT_NS:-}" ] && [ "$(id -u)" = 0 ]; then
  export RAMSLOG_CHROOT_NS=1
  exec unshare --mount --propagation private "$0" "$@"
fi
# Physical path: /proc/mounts and /proc/PID/root show resolved paths.
repo=$(cd "$(dirname "$0")/../.." && pwd -P)
cd "$repo"
# shellcheck source=../lib/packages.sh
. tests/lib/packages.sh
WORK=$repo/build/chroot
ROOT=$WORK/rootfs
PORT=${CHROOT_PORT:-3270}
IQN=iqn.2026-11.org.ramslog:chroot-check
start=$(date +%s)
say() { printf '\n--- chroot: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }
die() { echo "chroot check FAILED: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap and bind mounts)"
host_home=$(getent passwd root | cut -d: -f6)
RUSTUP=${RUSTUP_HOME:-$host_home/.rustup}
CARGO_BIN=${CARGO_HOME:-$host_home/.cargo}/bin
REGISTRY=${CARGO_HOME:-$host_home/.cargo}/registry
[ -x "$CARGO_BIN/cargo" ] && [ -d "$RUSTUP" ] || die "no rustup toolchain in $CARGO_BIN and $RUSTUP"
mkdir -p "$REGISTRY"

need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v iscsi-ls >/dev/null || need+=(libiscsi-bin)
apt_install "${need[@]}"

mounted=()
# Mount points at or below $ROOT, deepest first.
mounts_inside() { awk -v r="$ROOT/" 'index($2 "/", r) == 1 {print $2}' /proc/mounts | sort -r; }
bind() { # bind SRC DST [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounted+=("$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}
cleanup() {
  set +e
  # Whatever the guest left running (the target, cargo) goes first.
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill -9 "$pid" 2>/dev/null
  done
  sleep 0.5
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}"; done
  # Anything a test mounted inside and did not get to unmount.
  mounts_inside | xargs -r umount -l
}
trap cleanup EXIT

say "debootstrap bookworm (minbase, sudo, ca-certificates)"
# An earlier run that died may have left its bind mounts (the host's cargo
# registry, this checkout) inside: removing the tree through them would
# delete the host's files. Unmount whatever is there, and touch nothing
# while anything still is.
mounts_inside | xargs -r umount -l
[ -z "$(mounts_inside)" ] || die "file systems are still mounted under $ROOT: $(mounts_inside | tr '\n' ' ')"
rm -rf --one-file-system "$ROOT"
mkdir -p "$WORK"
debootstrap --variant=minbase --include=sudo,ca-certificates bookworm "$ROOT" \
  http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
  { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }

mount -t proc proc "$ROOT/proc"; mounted+=("$ROOT/proc")
bind /sys "$ROOT/sys" ro
bind /dev "$ROOT/dev"
bind /dev/pts "$ROOT/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$ROOT/dev/shm"; mounted+=("$ROOT/dev/shm")
mount -t tmpfs -o mode=0755 tmpfs "$ROOT/run"; mounted+=("$ROOT/run")
cp /etc/resolv.conf /etc/hosts "$ROOT/etc/"
# A packaged tool that brings libclang-cpp (not libclang) is common; bindgen
# cannot use it.
chroot "$ROOT" bash -c 'apt-get update -qq && apt-get install -y -qq libclang-cpp14 >/dev/null' || die "installing libclang-cpp14"

say "a user with sudo and rustup's toolchain (the host's, read-only)"
chroot "$ROOT" useradd -m -s /bin/bash newcomer
echo 'newcomer ALL=(ALL) NOPASSWD: ALL' >"$ROOT/etc/sudoers.d/newcomer"
for home in "$ROOT/home/newcomer" "$ROOT/root"; do
  bind "$RUSTUP" "$home/.rustup" ro
  bind "$CARGO_BIN" "$home/.cargo/bin" ro
  bind "$REGISTRY" "$home/.cargo/registry"
done
# The shared registry belongs to root; the newcomer's cargo only reads it
# (every crate of Cargo.lock is already there) but takes its lock file.
chroot "$ROOT" chown newcomer: /home/newcomer/.cargo
nextest=$(command -v cargo-nextest || true)
[ -n "$nextest" ] && cp "$nextest" "$ROOT/usr/local/bin/"
git clone -q "$repo" "$ROOT/home/newcomer/ramslog"
chroot "$ROOT" chown -R newcomer: /home/newcomer/ramslog

say "1. the quick start as a newcomer: target/quickstart.sh"
as_newcomer() {
  chroot "$ROOT" runuser -u newcomer -- env -i HOME=/home/newcomer USER=newcomer \
    PATH=/usr/local/bin:/usr/bin:/bin TERM=dumb bash -c "cd ~/ramslog && $1"
}
as_newcomer "target/quickstart.sh --size 64M --ephemeral --listen 127.0.0.1:$PORT --target-name $IQN" \
  >"$WORK/quickstart.log" 2>&1 &
QS=$!
answered=0
for _ in $(seq 1 600); do
  if iscsi-ls -i iqn.2026-11.org.ramslog:chroot-host "iscsi://127.0.0.1:$PORT" 2>/dev/null | grep -q "$IQN"; then
    answered=1
    break
  fi
  kill -0 "$QS" 2>/dev/null || break
  sleep 1
done
[ "$answered" = 1 ] || { tail -30 "$WORK/quickstart.log"; die "the quick start's target never answered discovery"; }
say "the target answers discovery on 127.0.0.1:$PORT"
as_newcomer "sudo build/release/ramslog-target status" >"$WORK/status.txt" 2>&1 ||
  { cat "$WORK/status.txt"; die "status without flags failed"; }
grep -q "$IQN" "$WORK/status.txt" || { cat "$WORK/status.txt"; die "status does not list the target"; }
as_newcomer "sudo build/release/ramslog-target stop" >>"$WORK/status.txt" 2>&1 ||
  { cat "$WORK/status.txt"; die "stop failed"; }
wait "$QS" || { tail -30 "$WORK/quickstart.log"; die "the quick start exited non-zero"; }
uid=$(chroot "$ROOT" id -u newcomer)
owned=$(find "$ROOT/home/newcomer/ramslog" "$ROOT/home/newcomer/.cargo" -xdev ! -uid "$uid" \
  -not -path '*/.cargo/bin*' -not -path '*/.cargo/registry*' | head -3)
[ -z "$owned" ] || die "the quick start left files the newcomer does not own: $owned"
quick=$(($(date +%s) - start))

say "2. the test command's install and build: tests/run-all.sh --prepare (as root)"
bind "$repo" "$ROOT$repo"
chroot "$ROOT" env -i HOME=/root PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  TERM=dumb CARGO_TERM_COLOR=never bash -c "cd '$repo' && tests/run-all.sh --prepare" >"$WORK/run-all-prepare.log" 2>&1 ||
  { tail -40 "$WORK/run-all-prepare.log"; die "tests/run-all.sh --prepare failed in the chroot"; }
grep -E "every package and tool|tests? (binaries|listed)" "$WORK/run-all-prepare.log" | head -2 || true
tail -1 "$WORK/run-all-prepare.log"

say "3. boot order on a Debian host with ifupdown, open-iscsi and zfsutils-linux"
echo "deb http://deb.debian.org/debian bookworm main contrib" >"$ROOT/etc/apt/sources.list"
chroot "$ROOT" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
  --no-install-recommends systemd open-iscsi ifupdown zfsutils-linux' >"$WORK/boot-order-apt.log" 2>&1 ||
  { tail -20 "$WORK/boot-order-apt.log"; die "installing the host's packages"; }
# What systemd would do at boot: build the start transaction and report the
# ordering cycles it has to break by deleting jobs.
# systemd-analyze verify of one unit: no complaint and exit 0 (a verify
# that cannot run exits non-zero and says nothing about ramslog).
verify_unit() {
  local out rc=0
  out=$(chroot "$ROOT" systemd-analyze verify --man=no "$1" 2>&1) || rc=$?
  if echo "$out" | grep -q ramslog || [ "$rc" != 0 ]; then
    echo "$out"
    die "systemd-analyze verify $1 exited $rc or complains about it"
  fi
}
cycles() { chroot "$ROOT" systemd-analyze verify --man=no multi-user.target "$@" 2>&1 | grep -i "ordering cycle" || true; }
c=$(cycles); [ -z "$c" ] || die "Debian's own units already have an ordering cycle: $c"
dropin=$ROOT/etc/systemd/system/zfs-import-cache.service.d
mkdir -p "$dropin"
printf '[Unit]\nWants=iscsid.service open-iscsi.service\nAfter=iscsid.service open-iscsi.service\n' >"$dropin/naive.conf"
c=$(cycles)
[ -n "$c" ] || die "no cycle seen with zfs-import-cache ordered after open-iscsi: the check cannot see cycles"
echo "ordering the early import after open-iscsi (not shipped) makes systemd break a cycle:"
echo "$c" | sed 's/^/  /' | head -4
rm -r "$dropin"
install -m 644 "$repo/target/host/ramslog-zpool-import.service" "$ROOT/etc/systemd/system/"
chroot "$ROOT" systemctl enable ramslog-zpool-import.service
c=$(cycles ramslog-zpool-import.service)
[ -z "$c" ] || die "ramslog-zpool-import.service creates an ordering cycle: $c"
verify_unit ramslog-zpool-import.service
echo "ramslog-zpool-import.service: verified, enabled, no ordering cycle"

say "4. the Debian package: built here, installed in the chroot, lintian"
deb=$(target/debian/build-deb.sh 2>"$WORK/build-deb.log") || { tail -20 "$WORK/build-deb.log"; die "building the .deb"; }
cp "$deb" "$ROOT/tmp/"
chroot "$ROOT" bash -c "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lintian /tmp/$(basename "$deb")" \
  >"$WORK/deb-install.log" 2>&1 || { tail -20 "$WORK/deb-install.log"; die "installing $(basename "$deb")"; }
# lintian exits 0 (at most warnings), 1 (errors) or 2 (it could not check):
# only 0 passes, and a 1 must show its errors.
rc=0
chroot "$ROOT" lintian --info "/tmp/$(basename "$deb")" >"$WORK/lintian.txt" 2>&1 || rc=$?
cat "$WORK/lintian.txt"
! grep -q '^E: ' "$WORK/lintian.txt" || die "lintian reports errors"
[ "$rc" = 0 ] || die "lintian exited $rc without an error line: it could not check the package"
verify_unit /lib/systemd/system/ramslog-target.service
state=$(chroot "$ROOT" systemctl is-enabled ramslog-target.service 2>&1 || true)
[ "$state" = disabled ] || die "the package left ramslog-target.service '$state', not disabled"
chroot "$ROOT" ramslog-target check-config /etc/ramslog/ramslog.toml || die "the packaged config does not check"
[ "$(stat -c %a "$ROOT/var/lib/ramslog")" = 700 ] || die "/var/lib/ramslog is not mode 0700"
for f in /usr/share/man/man8/ramslog-target.8.gz /usr/share/bash-completion/completions/ramslog-target \
  /usr/bin/rdma-bench /usr/share/ramslog/host/ramslog-log-sessions /etc/needrestart/conf.d/ramslog.conf; do
  [ -e "$ROOT$f" ] || die "the package has no $f"
done
# needrestart evaluates its conf.d files as Perl: the exclusion must parse.
chroot "$ROOT" perl -c /etc/needrestart/conf.d/ramslog.conf || die "the needrestart exclusion does not parse"
chroot "$ROOT" dpkg -s ramslog | grep -E '^(Version|Depends):'
echo "$(basename "$deb"): installed, service disabled and not started, lintian without errors"
say "passed: quick start ${quick}s, total $(($(date +%s) - start))s (logs in $WORK)"
