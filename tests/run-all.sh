#!/usr/bin/env bash
# The full test command: installs what the tests need, then runs every tier.
#   tests/run-all.sh            everything (what CI runs)
#   tests/run-all.sh --fast     unit + integration + conformance only (a developer's loop)
# Needs root for apt-get; on a machine that already has the packages it only uses cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
[ "${1:-}" = "--fast" ] && FAST=1

step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

# shellcheck source=lib/packages.sh
. tests/lib/packages.sh
read -r -a need_pkgs <<<"$(missing_build_packages)"
command -v iscsi-test-cu >/dev/null || need_pkgs+=(libiscsi-bin)
command -v setpriv >/dev/null || need_pkgs+=(util-linux)
command -v mkfs.ext4 >/dev/null || need_pkgs+=(e2fsprogs)
command -v systemd-analyze >/dev/null || need_pkgs+=(systemd)
command -v python3 >/dev/null || need_pkgs+=(python3)
if ((${#need_pkgs[@]})); then
  step "installing ${need_pkgs[*]}"
  apt_install "${need_pkgs[@]}"
fi
command -v cargo-nextest >/dev/null || cargo nextest --version >/dev/null 2>&1 || {
  step "installing cargo-nextest"; cargo install cargo-nextest --locked -j2; }

# Debian's prometheus and promtool for the metrics tests, unpacked into build/tools.
# shellcheck source=lib/prometheus.sh
. tests/lib/prometheus.sh
step "prometheus and promtool (Debian's package, unpacked)"
prometheus_tools

step "format and lint"
cargo fmt --all -- --check
cargo clippy -j2 --workspace --all-targets -- -D warnings
# The API docs build clean: a broken link or a stray <placeholder> fails here.
RUSTDOCFLAGS="-D warnings" cargo doc -j2 --no-deps --workspace

step "build"
cargo build -j2 --workspace --all-targets

step "tests: unit, integration, conformance"
# nextest runs no doctests (some are compile-fail checks of the verbs API);
# they go first, so nextest's summary is the tier's closing line.
cargo test -j2 --doc --workspace
cargo nextest run -j2 --workspace --no-fail-fast

if [ "$FAST" = 1 ]; then exit 0; fi

step "fuzz: every decoder for a bounded time"
tests/fuzz.sh "${FUZZ_SECONDS:-20}"

step "SoftRoCE lab: real rxe RDMA (in a qemu guest unless this kernel has rdma_rxe)"
# Lab measurements compare targets side by side, so the daemon runs optimised.
cargo build -j2 --release -p ramslog-target -p rdma-bench
tests/softroce/check.sh

step "a newcomer's first run on a fresh Debian 12 (debootstrap chroot): the quick start and the test command"
if [ "$(id -u)" = 0 ]; then
  tests/chroot/check.sh
else
  echo "SKIPPED chroot check: needs root (debootstrap, bind mounts)"
fi
