#!/usr/bin/env bash
# Instructions per 4 KiB command through the engine, exactly, for the eight
# cases of the `engine` bench: callgrind's inclusive count of the bench's
# `tcp_command` / `iser_command` divided by the number of calls to it.
# Deterministic, unlike time on a shared two-core machine, so it is what a
# cost limit ("within 2 % of commit X") is checked with.
#
#   tests/bench/instructions.sh             # this tree
#   tests/bench/instructions.sh COMMIT      # COMMIT, built in a scratch worktree
#
# Prints one line per case: "<case>\t<instructions per command>".
# The iSER cases repeat to the instruction; the TCP ones move by up to about
# 2 % between runs of one build (the 4 KiB copies into the output buffer),
# so compare TCP over two or three runs. The release profile builds with one
# codegen unit (Cargo.toml); to compare with a commit from before that, run
# it with CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 CARGO_PROFILE_BENCH_CODEGEN_UNITS=1.
# Needs valgrind (installed if missing) and a build; nothing is left in the tree.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=../lib/packages.sh
. "$repo/tests/lib/packages.sh"
command -v valgrind >/dev/null || apt_install valgrind

scratch=$(mktemp -d)
cleanup() {
    if [[ -n "${worktree:-}" ]]; then git -C "$repo" worktree remove --force "$worktree" || true; fi
    rm -rf "$scratch"
}
trap cleanup EXIT

src=$repo
if [[ $# -ge 1 ]]; then
    worktree=$scratch/tree
    git -C "$repo" worktree add --detach --quiet "$worktree" "$1"
    src=$worktree
fi

# One build directory for every tree, so a second commit costs an
# incremental build, not a cold one.
build_dir=$(cd "$repo" && cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
bench=$(cd "$src" && CARGO_TARGET_DIR=$build_dir cargo bench -j2 -p ramslog-target --bench engine --no-run \
    --message-format json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "engine" and m.get("executable"):
        print(m["executable"])')
[[ -x "$bench" ]] || { echo "instructions.sh: the engine bench did not build" >&2; exit 1; }

per_call() { # short.out long.out function-substring -> inclusive Ir per call
    python3 - "$1" "$2" "$3" <<'PY'
import re, sys

def totals(path, want):
    names, calls, cost = {}, 0, 0
    pending = None  # call count of the call line just read, if its callee matches
    callee_matches = False
    with open(path) as f:
        for line in f:
            if line.startswith("cfn="):
                m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.strip())
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                callee_matches = want in names.get(m.group(1), "")
            elif line.startswith("calls="):
                pending = int(line.split()[0][6:]) if callee_matches else None
            elif pending is not None:
                # The line after "calls=" is the call's inclusive cost.
                parts = line.split()
                calls += pending
                cost += int(parts[1])
                pending = None
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.strip())
                if m and m.group(2):
                    names[m.group(1)] = m.group(2)
    return calls, cost

short, long, want = sys.argv[1], sys.argv[2], sys.argv[3]
(c1, i1), (c2, i2) = totals(short, want), totals(long, want)
if c2 <= c1:
    sys.exit(f"the longer run made no more calls to {want} ({c1} vs {c2})")
print(round((i2 - i1) / (c2 - c1)))
PY
}

# Every case's setup (login, the warm-up commands, the metrics clock's
# calibration) runs whatever the filter selects, so one run's count is not
# per command. Two runs that differ only in how long they measure differ
# only in measured commands: their difference, divided by the difference in
# calls, is the cost of one command.
for transport in tcp iser; do
    for case in write read "write +metrics" "read +metrics"; do
        filter="^4KiB command/$transport ${case//+/\\+}\$"
        for seconds in 1 3; do
            valgrind --tool=callgrind --callgrind-out-file="$scratch/$seconds.out" \
                "$bench" --bench --profile-time "$seconds" "$filter" >/dev/null 2>&1
        done
        printf '%s %s\t%s\n' "$transport" "$case" \
            "$(per_call "$scratch/1.out" "$scratch/3.out" "engine::${transport}_command")"
        rm -f "$scratch"/*.out
    done
done
