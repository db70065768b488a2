#!/usr/bin/env bash
# The ramslog-target binary of the commit this release's persisted-state
# promise is tested from ("install the new package, then systemctl reload"
# from it, and back): built once in a scratch worktree, cached by commit and
# compiler (tests/lib/cache.sh). A debug build, as the tests' own binary is.
# Prints the binary's path.
#
#   tests/upgrade/base-binary.sh            # the commit named below
#   RAMSLOG_UPGRADE_BASE=COMMIT tests/upgrade/base-binary.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
# The commit issue 45 (kept memory, round 4) started from: the last release
# whose kept record and handover this one must read and hand back.
base=${RAMSLOG_UPGRADE_BASE:-8252c6a092e9fcd4e6390d55adef8ada647b58c4}
# shellcheck source=../lib/cache.sh
. "$repo/tests/lib/cache.sh"

if ! commit=$(git -C "$repo" rev-parse --verify --quiet "$base^{commit}"); then
  echo "base-binary: commit $base is not in this clone (a shallow clone?): run" \
    "\`git fetch --unshallow\` (or set RAMSLOG_UPGRADE_BASE to a commit it has)" >&2
  exit 1
fi

build() {
  local out=$1 scratch
  scratch=$(mktemp -d)
  git -C "$repo" worktree add --detach --quiet "$scratch/tree" "$commit"
  # One build directory for every build of the base: a second is incremental.
  if (cd "$scratch/tree" && CARGO_TARGET_DIR="$repo/build/upgrade-base" \
    cargo build -j2 --quiet -p ramslog-target --bin ramslog-target); then
    cp "$repo/build/upgrade-base/debug/ramslog-target" "$out/ramslog-target"
  fi
  git -C "$repo" worktree remove --force "$scratch/tree"
  rm -rf "$scratch"
  [ -x "$out/ramslog-target" ]
}

dir=$(cache_entry upgrade-base "$commit $(rustc -V)" build)
echo "$dir/ramslog-target"
