#!/usr/bin/env bash
# Recipe of the guest-initramfs cache entry (tests/lib/cache.sh): busybox,
# stage 1 (guest/init) and the modules that mount the host's root (virtio,
# 9p, overlay) of the cached kernel. Its inputs' content is the entry's key.
#   guest/initramfs.sh KERNEL_ENTRY DEST
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
kdir=$1 dst=$2
rel=$(cat "$kdir/kernel.release")
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
mkdir -p "$d"/{bin,mods,proc,sys,dev}
cp /bin/busybox "$d/bin/busybox"
cp "$HERE/init" "$d/init"
chmod +x "$d/init"
for m in virtio_pci 9pnet_virtio 9p overlay; do
  modprobe -d "$kdir/kernel" -S "$rel" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  cp "$ko" "$d/mods/"
  basename "$ko" >>"$d/modules.list"
done
(cd "$d" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 >"$dst/initrd.img")
