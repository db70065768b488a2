#!/usr/bin/env bash
# tests/softroce/zfs/prepare.sh — host side of the ZFS end-to-end lab: OpenZFS
# kernel modules for exactly the kernel the SoftRoCE guest boots, and the ZFS
# userland the guest uses through the host's read-only root.
#
#   tests/softroce/zfs/prepare.sh        (prints the modules' directory)
#
# * The guest kernel is the cache entry tests/softroce/run boots (its
#   kernel.release and kernel.key = package and version). Its headers are
#   installed at that exact package version in the same run, so a Debian point
#   release cannot make headers and kernel drift: if the archive no longer has
#   that version, this stops and says how to refresh the kernel cache.
# * zfsutils-linux and the zfs-dkms source come from Debian's `contrib`
#   component through a private apt configuration (build/softroce/zfs/apt);
#   the system's sources stay untouched. zfs-dkms is only unpacked as a source
#   carrier (never installed, no dkms): zfs/modules.sh builds the modules out
#   of tree into the cache entry zfs-modules (tests/lib/cache.sh), stripped.
# * The entry is keyed by kernel package + version, ZFS version, gcc and
#   binutils versions and the recipe's content: any change builds a new one.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SOFTROCE=$(cd "$HERE/.." && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
WORK=$REPO/build/softroce/zfs
# shellcheck source=../lib/guest-kernel.sh
. "$SOFTROCE/lib/guest-kernel.sh"
say() { echo "[zfs-prepare] $(date +%T) $*" >&2; }
die() { say "$*"; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (apt-get install of headers and zfsutils-linux)"

# The guest kernel first: this fetches it when Debian's candidate changed.
"$SOFTROCE/run" --prepare-only >&2
KDIR=$(guest_kernel_entry) || die "no guest kernel"
KREL=$(cat "$KDIR/kernel.release")
read -r KPKG KVERSION <"$KDIR/kernel.key"
[ -n "$KREL" ] && [ -n "$KVERSION" ] || die "no guest kernel in $KDIR"

mkdir -p "$WORK"/{apt/etc,apt/lists/partial,logs}
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
  die "$HPKG $KVERSION (matching the cached guest kernel $KPKG $KVERSION) is not in the archive any more: apt-get update, then rerun to fetch the current kernel"
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
KEY="$KPKG $KVERSION zfs $ZVERSION gcc $(gcc -dumpfullversion) binutils $(ld --version | head -1) recipe:$(cache_files_key "$HERE/modules.sh")"
MODS=$(ZFS_APT_OPTS="${APT[*]}" cache_entry zfs-modules "$KEY" "$HERE/modules.sh" "$WORK" "$KREL" "$HPKG" "$ZVERSION") ||
  die "building the OpenZFS modules failed"
say "modules for $KPKG $KVERSION zfs $ZVERSION: $MODS"
echo "$MODS"
