# shellcheck shell=bash
# The guest's kernel and initramfs as cache entries (tests/lib/cache.sh),
# for tests/softroce/run and zfs/prepare.sh. Keys: the kernel package, its
# version and the SHA-256 apt knows for its .deb, plus the recipes' content
# (guest/kernel.sh; guest/initramfs.sh, guest/init and busybox).
_gk_here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../../lib/cache.sh
. "$_gk_here/../lib/cache.sh"

# "PACKAGE VERSION" of Debian's current kernel (or RAMSLOG_SOFTROCE_KPKG).
guest_kernel_package() {
  local kpkg=${RAMSLOG_SOFTROCE_KPKG:-}
  if [ -z "$kpkg" ]; then
    kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  [ -n "$kpkg" ] || { apt-get update -qq; kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); }
  [ -n "$kpkg" ] || { echo "cannot find Debian's kernel package (apt-cache depends linux-image-amd64)" >&2; return 1; }
  local ver; ver=$(apt-cache policy "$kpkg" | awk '/Candidate:/{print $2; exit}')
  echo "$kpkg $ver"
}

# Prints the kernel entry's directory (kernel/, kernel.release, kernel.key).
guest_kernel_entry() {
  local pkg kpkg ver sha
  pkg=$(guest_kernel_package) || return 1
  read -r kpkg ver <<<"$pkg"
  sha=$(apt-cache show "$kpkg=$ver" 2>/dev/null | awk '/^SHA256:/{print $2; exit}')
  cache_entry guest-kernel "$kpkg $ver sha256:$sha recipe:$(cache_files_key "$_gk_here/guest/kernel.sh")" \
    "$_gk_here/guest/kernel.sh" "$kpkg" "$ver"
}

# guest_initrd_entry KERNEL_ENTRY: prints the initramfs entry's directory.
guest_initrd_entry() {
  local kdir=$1
  cache_entry guest-initramfs "$(cat "$kdir/kernel.key") $(cat "$kdir/kernel.release") \
recipe:$(cache_files_key "$_gk_here/guest/initramfs.sh" "$_gk_here/guest/init" /bin/busybox)" \
    "$_gk_here/guest/initramfs.sh" "$kdir"
}
