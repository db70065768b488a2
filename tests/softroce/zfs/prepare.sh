#!/usr/bin/env bash
# tests/softroce/zfs/prepare.sh — host side of the ZFS end-to-end lab: OpenZFS
# kernel modules for exactly the kernel the SoftRoCE guest boots, and the ZFS
# userland the guest uses through the host's read-only root.
#
#   tests/softroce/zfs/prepare.sh        (idempotent; FORCE_REBUILD=1 rebuilds)
#
# * The guest kernel is whatever tests/softroce/run cached (build/softroce/cache/
#   kernel.release + kernel.key = package and version). Its headers are
#   installed at that exact package version in the same run, so a Debian point
#   release cannot make headers and kernel drift: if the archive no longer has
#   that version, this stops and says how to refresh the kernel cache.
# * zfsutils-linux and the zfs-dkms source come from Debian's `contrib`
#   component through a private apt configuration (build/softroce/zfs/apt);
#   the system's sources stay untouched. zfs-dkms is only unpacked as a source
#   carrier (never installed, no dkms): the modules are built out of tree and
#   kept in build/softroce/zfs/modules/<kernel release>/, stripped.
# * The module cache is keyed by kernel package + version and ZFS version; a
#   mismatch is detected and the modules are rebuilt, never silently reused.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SOFTROCE=$(cd "$HERE/.." && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
CACHE=${RAMSLOG_SOFTROCE_CACHE:-$REPO/build/softroce/cache}
WORK=${RAMSLOG_ZFS_CACHE:-$REPO/build/softroce/zfs}
say() { echo "[zfs-prepare] $(date +%T) $*" >&2; }
die() { say "$*"; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (apt-get install of headers and zfsutils-linux)"

# The guest kernel first: this (re)fetches it when Debian's candidate changed.
"$SOFTROCE/run" --prepare-only
KREL=$(cat "$CACHE/kernel.release")
read -r KPKG KVERSION <"$CACHE/kernel.key"
[ -n "$KREL" ] && [ -n "$KVERSION" ] || die "no guest kernel in $CACHE (tests/softroce/run --prepare-only)"

mkdir -p "$WORK"/{apt/etc,apt/lists/partial,dl,logs}
# Debian's own sources, with contrib added to each suite.
python3 - >"$WORK/apt/etc/contrib.list" <<'PY'
import glob, re
out = []
for f in glob.glob('/etc/apt/sources.list.d/*.sources'):
    for stanza in open(f).read().split('\n\n'):
        kv = dict(re.findall(r'^(\w[\w-]*):\s*(.*)$', stanza, re.M))
        if kv.get('Types', '').split()[:1] != ['deb'] or 'debian' not in kv.get('URIs', ''):
            continue
        comps = sorted(set(kv.get('Components', 'main').split()) | {'contrib'})
        for uri in kv['URIs'].split():
            for suite in kv.get('Suites', '').split():
                out.append(f"deb {uri} {suite} {' '.join(comps)}")
for path in glob.glob('/etc/apt/sources.list'):
    for line in open(path):
        if line.startswith('deb ') and 'debian' in line:
            out.append(line.strip() + ('' if ' contrib' in line else ' contrib'))
print('\n'.join(dict.fromkeys(out)))
PY
[ -s "$WORK/apt/etc/contrib.list" ] || die "no Debian sources found in /etc/apt"
APT=(-o Dir::Etc::sourcelist="$WORK/apt/etc/contrib.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$WORK/apt/lists")
if [ -z "$(find "$WORK/apt/lists" -name '*contrib*Packages*' -mmin -720 2>/dev/null | head -1)" ]; then
  say "apt-get update (private lists, with contrib)"
  apt-get "${APT[@]}" update -qq >"$WORK/logs/apt-update.txt" 2>&1 || { cat "$WORK/logs/apt-update.txt"; die "apt-get update failed"; }
fi

HPKG=linux-headers-$KREL
if ! apt-cache "${APT[@]}" show "$HPKG=$KVERSION" >/dev/null 2>&1; then
  die "$HPKG $KVERSION (matching the cached guest kernel $KPKG $KVERSION) is not in the archive any more: remove $CACHE/kernel.key and rerun to fetch the current kernel"
fi
# What the guest scenario runs, from the host's root (udev for by-path names
# and zpool labelling, dmsetup for the slow pool disk).
PKGS=("$HPKG=$KVERSION" zfsutils-linux build-essential fio python3 udev dmsetup)
missing=()
for p in "${PKGS[@]}"; do
  name=${p%%=*} want=${p#*=}
  have=$(dpkg-query -W -f='${Status} ${Version}' "$name" 2>/dev/null || true)
  case $have in
    "install ok installed "*) [ "$name" = "$p" ] || [ "${have##* }" = "$want" ] || missing+=("$p") ;;
    *) missing+=("$p") ;;
  esac
done
if ((${#missing[@]})); then
  # zfsutils-linux's postinst tries `modprobe zfs` for the host kernel and fails: harmless, its services stay down.
  say "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y -q -o DPkg::Lock::Timeout=600 \
    --no-install-recommends "${missing[@]}" >"$WORK/logs/apt-install.txt" 2>&1 ||
    { tail -20 "$WORK/logs/apt-install.txt"; die "apt-get install failed"; }
fi
ZVERSION=$(dpkg-query -W -f='${Version}' zfsutils-linux)
KEY="$KPKG $KVERSION zfs $ZVERSION"
MODS=$WORK/modules/$KREL
if [ "${FORCE_REBUILD:-0}" != 1 ] && [ "$(cat "$MODS/.key" 2>/dev/null)" = "$KEY" ]; then
  say "modules cached for $KEY"
  exit 0
fi
[ -f "$MODS/.key" ] && say "module cache is for '$(cat "$MODS/.key")', need '$KEY': rebuilding"

rm -f "$WORK"/dl/zfs-dkms_*.deb
say "apt-get download zfs-dkms=$ZVERSION (source carrier only, never installed)"
(cd "$WORK/dl" && apt-get "${APT[@]}" download "zfs-dkms=$ZVERSION" >"$WORK/logs/download.txt" 2>&1) ||
  { cat "$WORK/logs/download.txt"; die "apt-get download zfs-dkms=$ZVERSION failed"; }
rm -rf "$WORK/src" "$WORK/build"
dpkg-deb -x "$WORK"/dl/zfs-dkms_*.deb "$WORK/src"
src=$(ls -d "$WORK"/src/usr/src/zfs-* | head -1)
[ -x "$src/configure" ] || die "no configure script in the zfs-dkms package ($src)"
mv "$src" "$WORK/build"
t0=$(date +%s)
say "configure against /usr/src/$HPKG (kernel modules only)"
(cd "$WORK/build" && ./configure --with-config=kernel \
  --with-linux="/usr/src/linux-headers-${KREL%-amd64}-common" \
  --with-linux-obj="/usr/src/$HPKG") >"$WORK/logs/configure.txt" 2>&1 ||
  { tail -30 "$WORK/logs/configure.txt"; die "configure failed (log: $WORK/logs/configure.txt)"; }
t1=$(date +%s)
say "configure took $((t1 - t0)) s; make -j$(nproc)"
make -C "$WORK/build" -j"$(nproc)" >"$WORK/logs/make.txt" 2>&1 ||
  { tail -30 "$WORK/logs/make.txt"; die "make failed (log: $WORK/logs/make.txt)"; }
t2=$(date +%s)
rm -rf "$MODS"
mkdir -p "$MODS"
find "$WORK/build/module" -name '*.ko' -exec cp {} "$MODS/" \;
ls "$MODS"/zfs.ko >/dev/null || die "no zfs.ko after the build"
# Debug info makes them 90 MB; stripped they load over 9p in seconds.
strip --strip-debug "$MODS"/*.ko
for ko in "$MODS"/*.ko; do
  magic=$(modinfo -F vermagic "$ko" | cut -d' ' -f1)
  [ "$magic" = "$KREL" ] || die "$(basename "$ko") is built for $magic, not $KREL"
done
rm -rf "$WORK/build" "$WORK/src"
printf 'configure_s=%s make_s=%s total_s=%s cores=%s\n' $((t1 - t0)) $((t2 - t1)) $((t2 - t0)) "$(nproc)" >"$MODS/build-time.txt"
echo "$KEY" >"$MODS/.key"
say "modules for $KEY built in $((t2 - t0)) s"
