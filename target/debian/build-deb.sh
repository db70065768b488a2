#!/usr/bin/env bash
# Builds the Debian package build/deb/ramslog_<version>_<arch>.deb from this
# checkout with dpkg-deb: the release binaries (stripped), the systemd unit,
# a loopback-only default config, the host-side files, the man page and shell
# completions generated from the CLI's own definitions, the docs. Depends is
# what dpkg-shlibdeps finds in the binaries, plus ibverbs-providers (libibverbs
# dlopens the RDMA drivers, so shlibdeps cannot see them).
# The package never enables, starts or restarts the service (see postinst).
#   target/debian/build-deb.sh            -> prints the .deb's path
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
# shellcheck source=../../tests/lib/packages.sh
. tests/lib/packages.sh
here=target/debian
read -r -a need <<<"$(missing_build_packages)"
command -v dpkg-shlibdeps >/dev/null || need+=(dpkg-dev)
apt_install "${need[@]}"

cargo build --release --locked -p ramslog-target -p rdma-bench >&2
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
arch=$(dpkg --print-architecture)
out=build/deb
# dpkg-shlibdeps reads debian/control and wants the binaries under debian/<package>/.
tree=$out/tree
stage=$tree/debian/ramslog
rm -rf "$tree"
mkdir -p "$stage/DEBIAN"
doc=$stage/usr/share/doc/ramslog

install -D -m 755 -s build/release/ramslog-target "$stage/usr/bin/ramslog-target"
install -D -m 755 -s build/release/rdma-bench "$stage/usr/bin/rdma-bench"
install -D -m 644 target/systemd/ramslog-target.service "$stage/lib/systemd/system/ramslog-target.service"
# 0640: a target's CHAP secret may be written inline.
install -D -m 640 "$here/ramslog.toml" "$stage/etc/ramslog/ramslog.toml"
install -D -m 755 target/host/ramslog-log-sessions "$stage/usr/share/ramslog/host/ramslog-log-sessions"
install -D -m 644 target/host/ramslog-zpool-import.service "$stage/usr/share/ramslog/host/ramslog-zpool-import.service"
install -D -m 644 target/prometheus/ramslog-alerts.yml "$stage/usr/share/ramslog/prometheus/ramslog-alerts.yml"
install -D -m 644 target/prometheus/ramslog-alerts.test.yml "$stage/usr/share/ramslog/prometheus/ramslog-alerts.test.yml"
install -D -m 644 "$here/needrestart.conf" "$stage/etc/needrestart/conf.d/ramslog.conf"
install -D -m 644 "$here/sysctl-hugepages.conf" "$doc/examples/60-ramslog-hugepages.conf"
install -D -m 644 "$here/copyright" "$doc/copyright"
for f in README.md docs/*.md; do
  install -D -m 644 "$f" "$doc/$f"
  gzip -9n "$doc/$f"
done
# A native package's changelog: the version, from the workspace (one place).
when=$(git log -1 --format=%aD 2>/dev/null || date -R)
printf 'ramslog (%s) unstable; urgency=medium\n\n  * Built from commit %s by target/debian/build-deb.sh.\n\n -- ramslog developers <dev@ramslog.org>  %s\n' \
  "$version" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$when" | gzip -9n >"$doc/changelog.gz"

gen=$out/generated
rm -rf "$gen"
build/release/ramslog-target generate-docs "$gen" >&2
install -D -m 644 "$gen/ramslog-target.8" "$stage/usr/share/man/man8/ramslog-target.8"
gzip -9n "$stage/usr/share/man/man8/ramslog-target.8"
install -D -m 644 "$gen/ramslog-target.bash" "$stage/usr/share/bash-completion/completions/ramslog-target"
install -D -m 644 "$gen/_ramslog-target" "$stage/usr/share/zsh/vendor-completions/_ramslog-target"
install -D -m 644 "$gen/ramslog-target.fish" "$stage/usr/share/fish/vendor_completions.d/ramslog-target.fish"

install -m 755 "$here/postinst" "$here/postrm" "$stage/DEBIAN/"
printf '%s\n' /etc/ramslog/ramslog.toml /etc/needrestart/conf.d/ramslog.conf >"$stage/DEBIAN/conffiles"
printf 'Source: ramslog\n\nPackage: ramslog\nArchitecture: any\n' >"$tree/debian/control"
depends=$(cd "$tree" && dpkg-shlibdeps -O -e debian/ramslog/usr/bin/ramslog-target -e debian/ramslog/usr/bin/rdma-bench |
  sed -n 's/^shlibs:Depends=//p')
[ -n "$depends" ] || { echo "dpkg-shlibdeps found no dependencies" >&2; exit 1; }
cat >"$stage/DEBIAN/control" <<CONTROL
Package: ramslog
Version: $version
Architecture: $arch
Maintainer: ramslog developers <dev@ramslog.org>
Installed-Size: $(du -sk --exclude=DEBIAN "$stage" | cut -f1)
Depends: $depends, ibverbs-providers
Section: admin
Priority: optional
Description: pinned RAM served as a SCSI disk for ZFS log mirrors
 ramslog-target locks a block of RAM and serves it as a SCSI LUN over iSER
 (RDMA: InfiniBand, RoCE) and iSCSI/TCP. Two of them, on two machines, make
 a mirrored ZFS separate intent log (SLOG). The content survives clean
 restarts and UPS-driven shutdowns (a verified image is dumped at stop and
 restored at start); a LUN whose content was lost comes back NOT READY
 under its old identity until the admin accepts it as empty.
 .
 The package installs the daemon, rdma-bench (the latency instrument), the
 systemd unit, and host-side files for Linux initiators. It never starts
 the service.
CONTROL
(cd "$stage" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum >DEBIAN/md5sums)
deb=$out/ramslog_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >&2
echo "$deb"
