#!/usr/bin/env bash
# Recipe of the zfs-modules cache entry (tests/lib/cache.sh): OpenZFS kernel
# modules for the guest kernel, built out of tree from the zfs-dkms source
# (only unpacked, never installed), stripped, vermagic checked. Its content
# is part of the entry's key, with the kernel, ZFS, gcc and binutils versions.
#   zfs/modules.sh WORK KREL HPKG ZVERSION DEST   (apt options in ZFS_APT_OPTS)
set -euo pipefail
WORK=$1 KREL=$2 HPKG=$3 ZVERSION=$4 DEST=$5
read -r -a APT <<<"${ZFS_APT_OPTS:-}"
say() { echo "[zfs-modules] $(date +%T) $*" >&2; }
die() { say "$*"; exit 1; }
# Scratch space on the cache's file system, beside the entry being built.
B=$DEST/.build
mkdir -p "$B/dl" "$WORK/logs"
say "apt-get download zfs-dkms=$ZVERSION (source carrier only, never installed)"
(cd "$B/dl" && apt-get "${APT[@]}" download "zfs-dkms=$ZVERSION" >"$WORK/logs/download.txt" 2>&1) ||
  { cat "$WORK/logs/download.txt" >&2; die "apt-get download zfs-dkms=$ZVERSION failed"; }
dpkg-deb -x "$B"/dl/zfs-dkms_*.deb "$B/src"
src=$(ls -d "$B"/src/usr/src/zfs-* | head -1)
[ -x "$src/configure" ] || die "no configure script in the zfs-dkms package ($src)"
t0=$(date +%s)
say "configure against /usr/src/$HPKG (kernel modules only)"
(cd "$src" && ./configure --with-config=kernel \
  --with-linux="/usr/src/linux-headers-${KREL%-amd64}-common" \
  --with-linux-obj="/usr/src/$HPKG") >"$WORK/logs/configure.txt" 2>&1 ||
  { tail -30 "$WORK/logs/configure.txt" >&2; die "configure failed (log: $WORK/logs/configure.txt)"; }
t1=$(date +%s)
say "configure took $((t1 - t0)) s; make -j$(nproc)"
make -C "$src" -j"$(nproc)" >"$WORK/logs/make.txt" 2>&1 ||
  { tail -30 "$WORK/logs/make.txt" >&2; die "make failed (log: $WORK/logs/make.txt)"; }
t2=$(date +%s)
find "$src/module" -name '*.ko' -exec cp {} "$DEST/" \;
ls "$DEST"/zfs.ko >/dev/null || die "no zfs.ko after the build"
# Debug info makes them 90 MB; stripped they load over 9p in seconds.
strip --strip-debug "$DEST"/*.ko
for ko in "$DEST"/*.ko; do
  magic=$(modinfo -F vermagic "$ko" | cut -d' ' -f1)
  [ "$magic" = "$KREL" ] || die "$(basename "$ko") is built for $magic, not $KREL"
done
rm -rf "$B"
printf 'configure_s=%s make_s=%s total_s=%s cores=%s\n' $((t1 - t0)) $((t2 - t1)) $((t2 - t0)) "$(nproc)" >"$DEST/build-time.txt"
say "modules built in $((t2 - t0)) s"
