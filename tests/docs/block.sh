#!/usr/bin/env bash
# tests/docs/block.sh FILE NAME — the commands of the guide's block NAME, as
# written, for a test to run: the indented code block that follows the line
# `<!-- walk: NAME -->` in FILE (Markdown hides the marker), un-indented, with
# comment lines dropped, trailing comments cut and `\` continuations joined:
# one command a line. Exits 1 naming the problem when FILE has no such marker,
# has it twice, or no indented block follows it, so a guide edit that breaks
# a walked block fails the test instead of running something else.
#   tests/docs/block.sh --check FILE...   every marker in FILE is followed by a block
set -euo pipefail

# extract FILE NAME: the block's commands on stdout; a diagnostic and exit 1
# when the marker is missing, repeated or not followed by a block.
extract() {
  awk -v name="$2" -v file="$1" '
    function flush() { if (cmd != "") { print cmd; cmd = "" } }
    $0 == "<!-- walk: " name " -->" {
      if (seen++) { printf "%s:%d: a second <!-- walk: %s -->\n", file, NR, name > "/dev/stderr"; bad = 1; exit }
      state = "before"; marker = NR; next
    }
    state == "before" && /^[ \t]*$/ { next }
    state == "before" && !/^    / { state = "done"; empty = 1; exit }
    (state == "before" || state == "in") && /^    / {
      state = "in"
      line = substr($0, 5)
      if (line ~ /^[ \t]*#/) next
      sub(/[ \t]+#[^'"'"'"]*$/, "", line)
      cont = sub(/[ \t]*\\$/, "", line)
      if (cmd != "") { sub(/^[ \t]+/, "", line); cmd = cmd " " line } else cmd = line
      if (!cont) flush()
      next
    }
    state == "in" && /^[ \t]*$/ { flush(); next }
    state == "in" { flush(); state = "done"; exit }
    END {
      if (bad) exit 1
      flush()
      if (!seen) { printf "%s: no <!-- walk: %s --> marker\n", file, name > "/dev/stderr"; exit 1 }
      if (empty || state != "in" && state != "done") {
        printf "%s:%d: <!-- walk: %s --> is not followed by an indented code block\n", file, marker, name > "/dev/stderr"; exit 1
      }
    }' "$1"
}

if [ "${1:-}" = --check ]; then
  shift
  rc=0
  for f in "$@"; do
    while read -r name; do
      extract "$f" "$name" >/dev/null || rc=1
    done < <(sed -n 's/^<!-- walk: \(.*\) -->$/\1/p' "$f" | sort -u)
  done
  exit "$rc"
fi
[ "$#" = 2 ] || { echo "usage: $0 FILE NAME | --check FILE..." >&2; exit 2; }
extract "$1" "$2"
