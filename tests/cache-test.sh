#!/usr/bin/env bash
# The cache library (tests/lib/cache.sh) on a fake recipe, in a scratch cache:
# a hit reuses the entry, a changed key rebuilds, a build killed with SIGKILL
# leaves no usable entry (and the next lookup builds a good one), a failed
# build leaves nothing, "off" builds cold, and the size bound evicts the
# least recently used entries, and only as many as it must.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/cache.sh
. tests/lib/cache.sh
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export RAMSLOG_CACHE=$scratch/cache RAMSLOG_TIMES=$scratch/times
unset RAMSLOG_CACHE_COLD_BEGUN
fail() { echo "cache test FAILED: $*" >&2; exit 1; }

recipe=$scratch/recipe.sh
builds=$scratch/builds
cat >"$recipe" <<'EOF'
echo built >>"$BUILDS"
printf '%s' "$PAYLOAD" >"$1/payload"
EOF
build() { BUILDS=$builds PAYLOAD=${PAYLOAD:-one} bash "$recipe" "$1"; }
key() { echo "fake $(cache_files_key "$recipe")"; }

a=$(cache_entry fake "$(key)" build)
[ "$(cat "$a/payload")" = one ] || fail "the first lookup did not build"
b=$(cache_entry fake "$(key)" build)
[ "$a" = "$b" ] && [ "$(wc -l <"$builds")" = 1 ] || fail "a second lookup of the same key rebuilt"
grep -q $'cache\tfake\thit' "$RAMSLOG_TIMES" || fail "the hit was not recorded"

# A changed recipe is a changed key: it rebuilds, the old entry stays.
echo '# changed' >>"$recipe"
c=$(PAYLOAD=two cache_entry fake "$(key)" build)
[ "$c" != "$a" ] && [ "$(cat "$c/payload")" = two ] || fail "a changed recipe did not rebuild"
[ "$(wc -l <"$builds")" = 2 ] || fail "expected two builds"

# A build killed with SIGKILL halfway: no usable entry, then a clean rebuild.
slow() { printf 'partial' >"$1/payload"; sleep 30; printf 'whole' >"$1/payload"; }
(cache_entry killed "k1" slow >/dev/null) &
pid=$!
for _ in $(seq 1 100); do
  compgen -G "$RAMSLOG_CACHE/killed/*.tmp.*/payload" >/dev/null && break
  sleep 0.1
done
# The kill must land in the middle of the build, or it shows nothing.
compgen -G "$RAMSLOG_CACHE/killed/*.tmp.*/payload" >/dev/null ||
  fail "the slow build never started (no partial payload after 10 s)"
pkill -KILL -P "$pid" || true
kill -KILL "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
entry=$RAMSLOG_CACHE/killed/$(cache_hash k1)
[ ! -e "$entry/.complete" ] || fail "a killed build left an entry marked complete"
[ ! -e "$entry/payload" ] || fail "a killed build left an entry in place"
quick() { printf 'whole' >"$1/payload"; }
d=$(cache_entry killed "k1" quick)
[ "$(cat "$d/payload")" = whole ] || fail "the lookup after a killed build did not rebuild"
compgen -G "$RAMSLOG_CACHE/killed/*.tmp.*" >/dev/null && fail "the killed build's leftovers stayed"

# A failing build leaves nothing and fails the lookup.
broken() { printf 'half' >"$1/payload"; return 7; }
if cache_entry broken "k2" broken >/dev/null 2>&1; then fail "a failed build succeeded"; fi
[ ! -e "$RAMSLOG_CACHE/broken/$(cache_hash k2)" ] || fail "a failed build left an entry"

# An entry stored after the work that makes it (cache_peek, then
# cache_entry with a copying builder): a miss builds nothing, the stored
# entry is a hit, and a changed key misses again.
if cache_peek stored "s1" >/dev/null; then fail "cache_peek found an entry nobody stored"; fi
[ ! -e "$RAMSLOG_CACHE/stored/$(cache_hash s1)" ] || fail "cache_peek made an entry"
copy() { printf 'work' >"$1/payload"; }
s=$(cache_entry stored "s1" copy)
p=$(cache_peek stored "s1") || fail "cache_peek missed a stored entry"
[ "$p" = "$s" ] && [ "$(cat "$p/payload")" = work ] || fail "cache_peek returned $p, not $s"
if cache_peek stored "s2" >/dev/null; then fail "cache_peek hit on a changed key"; fi

# The size bound evicts the least recently used entries, and only as many
# as it must: three 400 KiB entries over a 1 MiB bound, the first used again
# after the second was made. The small older entries go, then the second;
# the first (used since) and the newest stay.
blob() { head -c $((400 << 10)) /dev/urandom >"$1/blob"; }
export RAMSLOG_CACHE_MAX_MB=1
old1=$(cache_entry lru "k-1" blob)
sleep 0.05
old2=$(cache_entry lru "k-2" blob)
sleep 0.05
[ "$(cache_entry lru "k-1" blob)" = "$old1" ] || fail "the used-again entry was rebuilt"
sleep 0.05
new3=$(cache_entry lru "k-3" blob)
unset RAMSLOG_CACHE_MAX_MB
[ -f "$new3/blob" ] || fail "the newest entry was evicted"
[ ! -e "$a/.complete" ] || fail "the oldest small entry was not evicted"
[ ! -e "$old2/.complete" ] || fail "the least recently used big entry was not evicted"
[ -f "$old1/blob" ] || fail "an entry used since was evicted before the least recently used one"

# off: a cold cache (build/cache-cold; here a scratch one, so that the
# run's own cold cache is left alone), wiped when a run begins.
export RAMSLOG_CACHE_COLD_DIR=$scratch/cold
mkdir -p "$RAMSLOG_CACHE_COLD_DIR/stale"
cold=$(RAMSLOG_CACHE=off cache_entry fake "$(key)" build)
case $cold in "$RAMSLOG_CACHE_COLD_DIR/"*) ;; *) fail "off built in $cold" ;; esac
[ ! -e "$RAMSLOG_CACHE_COLD_DIR/stale" ] || fail "a cold run did not wipe the cold cache"
[ "$(cat "$cold/payload")" = one ] || fail "the cold entry was not built"
echo "cache test passed: hit, rebuild on a changed key, SIGKILL, failure, size bound, off, peek"
