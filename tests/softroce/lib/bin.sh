# Sourced by lab test scripts: which build of a project binary to run.
#   pick_bin NAME   -> the newer of build/release/NAME and build/debug/NAME
# (the lab runs whatever the host built last; measurements want release).
pick_bin() {
  local repo b best=
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
  for b in "$repo/build/release/$1" "$repo/build/debug/$1"; do
    [ -x "$b" ] || continue
    if [ -z "$best" ] || [ "$b" -nt "$best" ]; then best=$b; fi
  done
  [ -n "$best" ] && echo "$best"
}
