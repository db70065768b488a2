#!/usr/bin/env bash
# The full test command: installs what the tests need, then runs every tier.
#   tests/run-all.sh            everything (what CI runs)
#   tests/run-all.sh --fast     unit + integration + conformance only (a developer's loop)
#   tests/run-all.sh --prepare  install every package and tool the tiers need, check
#                               each is there, and build every target; run nothing
#                               (what the chroot check proves on a fresh machine)
# Needs root for apt-get; on a machine that already has the packages it only uses cargo.
# With RAMSLOG_TIMES=FILE each tier records "tier NAME passed|FAILED SECONDS"
# there (and "start NAME" when it begins); .ci/run prints them as a table.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=full
case ${1:-} in
  --fast) MODE=fast ;;
  --prepare) MODE=prepare ;;
  "") ;;
  *) echo "usage: $0 [--fast|--prepare]" >&2; exit 2 ;;
esac

step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
record() { if [ -n "${RAMSLOG_TIMES:-}" ]; then printf '%s\n' "$1" >>"$RAMSLOG_TIMES"; fi; }
# tier NAME COMMAND...: one recorded tier; a failure ends the run (set -e).
tier() {
  local name=$1 t0 rc
  shift
  step "$name"
  record "start	$name"
  t0=$(date +%s)
  # Not `"$@" || rc=$?`: that would switch set -e off inside the command.
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  record "tier	$name	$([ "$rc" = 0 ] && echo passed || echo FAILED)	$(($(date +%s) - t0))"
  return "$rc"
}

# shellcheck source=lib/cache.sh
. tests/lib/cache.sh
cache_begin_run

# shellcheck source=lib/packages.sh
. tests/lib/packages.sh
# Every command the tiers call that a fresh Debian may lack, and its package.
TOOLS="iscsi-test-cu:libiscsi-bin setpriv:util-linux mkfs.ext4:e2fsprogs systemd-analyze:systemd python3:python3"
packages() {
  local need_pkgs t
  read -r -a need_pkgs <<<"$(missing_build_packages)"
  for t in $TOOLS; do command -v "${t%%:*}" >/dev/null || need_pkgs+=("${t#*:}"); done
  if ((${#need_pkgs[@]})); then
    echo "installing ${need_pkgs[*]}"
    apt_install "${need_pkgs[@]}"
  fi
  command -v cargo-nextest >/dev/null || cargo nextest --version >/dev/null 2>&1 || {
    echo "installing cargo-nextest"; cargo install cargo-nextest --locked -j2; }
  # The fuzz tier's; installed here so that the compiled crates' cache key
  # (tests/lib/cargo-deps.sh) sees the version the run builds with.
  if [ "$MODE" = full ] || [ "$MODE" = prepare ]; then
    command -v cargo-fuzz >/dev/null || { echo "installing cargo-fuzz"; cargo install cargo-fuzz --locked -j2; }
  fi
}
tier "packages" packages

# Debian's prometheus and promtool for the metrics tests, unpacked into build/tools.
# shellcheck source=lib/prometheus.sh
. tests/lib/prometheus.sh
tier "prometheus and promtool (Debian's package, unpacked)" prometheus_tools

if [ "$MODE" = prepare ]; then
  tools_present() {
    local t missing=()
    [ -z "$(missing_build_packages)" ] || missing+=("build packages: $(missing_build_packages)")
    for t in $TOOLS; do command -v "${t%%:*}" >/dev/null || missing+=("${t%%:*}"); done
    cargo nextest --version >/dev/null 2>&1 || missing+=(cargo-nextest)
    command -v cargo-fuzz >/dev/null || missing+=(cargo-fuzz)
    prometheus_tools >/dev/null || missing+=(prometheus)
    ((${#missing[@]} == 0)) || { echo "still missing after the install: ${missing[*]}" >&2; return 1; }
    echo "every package and tool the tiers need is here"
  }
  tier "tools present" tools_present
  tier "build" cargo build -j2 --workspace --all-targets
  # The test binaries nextest would run, built and listed (not run).
  tier "test binaries" cargo nextest list --build-jobs 2 --workspace
  exit 0
fi

# shellcheck source=lib/cargo-deps.sh
. tests/lib/cargo-deps.sh
tier "cargo deps: build/ seeded from the cache (when this key has an entry)" cargo_deps_restore

lint() {
  cargo fmt --all -- --check
  cargo clippy -j2 --workspace --all-targets -- -D warnings
  # The API docs build clean: a broken link or a stray <placeholder> fails here.
  RUSTDOCFLAGS="-D warnings" cargo doc -j2 --no-deps --workspace
  # And so do the README and the guide: every relative link and anchor.
  python3 tests/docs/check-links.py --self-test
  python3 tests/docs/check-links.py
  # The guide's blocks the lab runs as written (tests/softroce/zfs/scenario.sh) are where it finds them.
  tests/docs/block.sh --check README.md docs/*.md
}
tier "format and lint" lint
tier "build" cargo build -j2 --workspace --all-targets

# nextest runs no doctests (some are compile-fail checks of the verbs API);
# they go first, so nextest's summary is the tier's closing line.
unit_tests() {
  cargo test -j2 --doc --workspace
  # .config/nextest.toml: a hung test ends after 5 minutes; CI also writes
  # each test's duration to build/nextest/ci/junit.xml.
  local profile=default
  [ "${CI:-}" = true ] && profile=ci
  cargo nextest run -j2 --workspace --no-fail-fast --profile "$profile"
}
tier "upgrade base: the release's starting binary, built once (cached)" tests/upgrade/base-binary.sh
tier "tests: unit, integration, conformance" unit_tests
tier "cache: keys, SIGKILL, size bound (a fake recipe)" tests/cache-test.sh

if [ "$MODE" = fast ]; then exit 0; fi

tier "fuzz: every decoder for a bounded time" tests/fuzz.sh "${FUZZ_SECONDS:-20}"

# Lab measurements compare targets side by side, so the daemon runs optimised.
tier "release build (lab)" cargo build -j2 --release -p ramslog-target -p rdma-bench
# Every profile is built by now: store the compiled crates for the next run.
tier "cargo deps: stored in the cache (when this key has no entry)" cargo_deps_save
tier "SoftRoCE lab: real rxe RDMA (a qemu guest unless this kernel has rdma_rxe)" tests/softroce/check.sh

chroot_check() {
  if [ "$(id -u)" = 0 ]; then
    tests/chroot/check.sh
  elif [ "${CI:-}" = true ]; then
    # CI runs as root: a CI that cannot run the check must not pass it.
    echo "chroot check: needs root (debootstrap, bind mounts), and CI=true: failing" >&2
    return 1
  else
    echo "SKIPPED chroot check: needs root (debootstrap, bind mounts)"
  fi
}
tier "chroot: a fresh Debian 12 (quick start, the install, build, package)" chroot_check
