# shellcheck shell=bash
# Caches that depend only on package versions and a recipe (the guest kernel
# and initramfs, the OpenZFS modules), kept outside the clone and keyed by
# their inputs: a changed package or recipe file is a different key, so a
# broken recipe cannot hide behind an old entry.
#
#   RAMSLOG_CACHE=DIR   the cache (default /var/cache/ramslog-ci as root,
#                       ${XDG_CACHE_HOME:-~/.cache}/ramslog otherwise)
#   RAMSLOG_CACHE=off   a cold run: every entry is built once for this run,
#                       in build/cache-cold (wiped when the run begins)
#   RAMSLOG_CACHE_MAX_MB  size bound (default 6144); least recently used
#                       entries go first
#
# An entry is DIR/NAME/KEYHASH: it is built in a temporary directory beside
# it and renamed into place only when its builder succeeded, under a lock per
# entry, so a build that is killed (even by SIGKILL) leaves no usable entry
# and two runs never build one entry at once. Each lookup is recorded as
# "cache NAME hit|miss SECONDS" in $RAMSLOG_TIMES when that is set.

_cache_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# The cache's directory (resolving "off").
cache_root() {
  case ${RAMSLOG_CACHE:-} in
    off) echo "${RAMSLOG_CACHE_COLD_DIR:-$_cache_repo/build/cache-cold}" ;;
    "") if [ "$(id -u)" = 0 ]; then echo /var/cache/ramslog-ci; else
      echo "${XDG_CACHE_HOME:-$HOME/.cache}/ramslog"; fi ;;
    *) echo "$RAMSLOG_CACHE" ;;
  esac
}

# Once per run, at its start: a cold run wipes what an earlier cold run
# built, and the scripts it calls see the same cold cache.
cache_begin_run() {
  if [ "${RAMSLOG_CACHE:-}" = off ] && [ -z "${RAMSLOG_CACHE_COLD_BEGUN:-}" ]; then
    rm -rf --one-file-system "$(cache_root)"
    export RAMSLOG_CACHE_COLD_BEGUN=1
  fi
  mkdir -p "$(cache_root)"
}

# A key's short name: its SHA-256.
cache_hash() { printf '%s' "$1" | sha256sum | cut -c1-32; }

# The content of files, for a key: their SHA-256 sums, so dates never count.
cache_files_key() { sha256sum "$@" | awk '{print $1}' | tr '\n' ' '; }

_cache_record() {
  if [ -n "${RAMSLOG_TIMES:-}" ]; then
    printf 'cache\t%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RAMSLOG_TIMES"
  fi
}

# cache_entry NAME KEY BUILDER [ARGS...]
# Prints the entry's directory. On a miss, runs `BUILDER ARGS... TMPDIR`
# (TMPDIR empty, on the cache's file system) and renames TMPDIR into place
# when it succeeds; its output goes to stderr. Fails when the builder does.
cache_entry() {
  local name=$1 key=$2
  shift 2
  cache_begin_run
  local root dir tmp hash t0 rc
  root=$(cache_root)
  hash=$(cache_hash "$key")
  dir=$root/$name/$hash
  mkdir -p "$root/$name"
  t0=$(date +%s)
  # The lock is a file beside the entry, held by this shell until done.
  exec {lockfd}>"$dir.lock"
  flock "$lockfd"
  if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.key" 2>/dev/null)" = "$key" ]; then
    touch "$dir/.complete"
    exec {lockfd}>&-
    _cache_record "$name" hit $(($(date +%s) - t0))
    echo "$dir"
    return 0
  fi
  # Whatever is here is not a finished entry of this key: a killed build's
  # leftovers, or (improbably) another key of the same hash.
  rm -rf --one-file-system "$dir" "$dir".tmp.*
  tmp=$dir.tmp.$$
  mkdir -p "$tmp"
  rc=0
  "$@" "$tmp" >&2 || rc=$?
  if [ "$rc" != 0 ]; then
    rm -rf --one-file-system "$tmp"
    exec {lockfd}>&-
    echo "cache: building $name failed ($rc)" >&2
    return "$rc"
  fi
  printf '%s' "$key" >"$tmp/.key"
  touch "$tmp/.complete"
  mv -T "$tmp" "$dir"
  exec {lockfd}>&-
  _cache_record "$name" miss $(($(date +%s) - t0))
  cache_evict "$dir"
  echo "$dir"
}

# cache_peek NAME KEY
# Prints the entry's directory when a finished entry of KEY is there (a
# hit), else fails (a miss); builds nothing. For entries stored after the
# work that makes them (cache_entry with a builder that copies), where a
# miss means "do the work here".
cache_peek() {
  local name=$1 key=$2 root dir
  cache_begin_run
  root=$(cache_root)
  dir=$root/$name/$(cache_hash "$key")
  mkdir -p "$root/$name"
  exec {lockfd}>"$dir.lock"
  flock "$lockfd"
  if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.key" 2>/dev/null)" = "$key" ]; then
    touch "$dir/.complete"
    exec {lockfd}>&-
    _cache_record "$name" hit 0
    echo "$dir"
    return 0
  fi
  exec {lockfd}>&-
  _cache_record "$name" miss 0
  return 1
}

# Keep the cache under its size bound: remove the least recently used
# entries (never KEEP, never one whose lock another run holds).
cache_evict() {
  local keep=${1:-} root max used entry lockfd
  root=$(cache_root)
  max=$((${RAMSLOG_CACHE_MAX_MB:-6144} * 1024))
  used=$(du -sk "$root" 2>/dev/null | cut -f1)
  [ "${used:-0}" -gt "$max" ] || return 0
  while read -r _ entry; do
    [ "$entry" = "$keep" ] && continue
    exec {lockfd}>"$entry.lock"
    if flock -n "$lockfd"; then
      echo "cache: evicting $entry (cache over ${RAMSLOG_CACHE_MAX_MB:-6144} MiB)" >&2
      rm -rf --one-file-system "$entry"
    fi
    exec {lockfd}>&-
    used=$(du -sk "$root" | cut -f1)
    [ "$used" -gt "$max" ] || break
  done < <(find "$root" -mindepth 3 -maxdepth 3 -name .complete -printf '%T@ %h\n' | sort -n)
}
