# Sourced by target/quickstart.sh and tests/run-all.sh: which Debian packages
# are missing, and installing them (as root, or through sudo). No build script
# ever calls apt; these scripts do, before cargo runs.

# Packages building the workspace needs, printed if missing.
missing_build_packages() {
  local need=()
  command -v cc >/dev/null || need+=(gcc libc6-dev)
  command -v pkg-config >/dev/null || need+=(pkg-config)
  # The iSER transport: rdma-sys runs bindgen against the rdma-core headers.
  pkg-config --exists libibverbs librdmacm 2>/dev/null || need+=(libibverbs-dev librdmacm-dev)
  # bindgen loads libclang.so* or libclang-<N>.so*; libclang-cpp.so.<N> (which
  # other packages bring) is a different library and does not count.
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null ||
    compgen -G '/usr/lib/llvm-*/lib/libclang-[0-9]*.so*' >/dev/null ||
    need+=(libclang-dev)
  echo "${need[@]}"
}

# apt_install PKG...: as root directly, else through sudo; otherwise say what to run.
apt_install() {
  (($#)) || return 0
  local as=()
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "missing packages $*: install them as root (apt-get install $*) or install sudo" >&2
      return 1
    fi
    as=(sudo)
  fi
  echo "installing $* (apt-get)" >&2
  "${as[@]}" apt-get update -qq
  "${as[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
