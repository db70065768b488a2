#!/usr/bin/env bash
# Recipe of the guest-kernel cache entry (tests/lib/cache.sh): Debian's
# kernel package, extracted (never installed on the host), with its
# modules.dep. Its own content is part of the entry's key.
#   guest/kernel.sh KPKG VERSION DEST
set -euo pipefail
kpkg=$1 ver=$2 dst=$3
(cd "$dst" && apt-get download "$kpkg=$ver" >/dev/null 2>"$dst/download.log") ||
  { cat "$dst/download.log" >&2; exit 1; }
mkdir -p "$dst/kernel"
dpkg-deb -x "$dst"/linux-image-*.deb "$dst/kernel"
rm -f "$dst"/linux-image-*.deb "$dst/download.log"
rel=$(ls "$dst/kernel/lib/modules")
depmod -b "$dst/kernel" "$rel" # the .deb ships no modules.dep
echo "$rel" >"$dst/kernel.release"
echo "$kpkg $ver" >"$dst/kernel.key"
