# shellcheck shell=bash
# The compiled third-party crates as a cache entry (tests/lib/cache.sh):
# what cargo builds from crates.io for every profile the test command uses
# (clippy's check, debug, release, the fuzz builds) depends only on
# Cargo.lock, the manifests, the toolchain and the system packages that build
# scripts read (rdma-sys runs bindgen against rdma-core's headers), so a
# fresh clone can start from them. The workspace's own crates are never in
# the entry: they are always compiled from the clone.
#
#   cargo_deps_restore   before the first cargo command: seeds build/ from
#                        the entry of this key, if there is one
#   cargo_deps_save      after the last build of a full run: stores this
#                        key's entry, if there is none yet
# Both do nothing in a cold run (RAMSLOG_CACHE=off) and when build/ already
# has compiled crates (a developer's checkout: it is its own cache).
_cd_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=cache.sh
. "$_cd_repo/tests/lib/cache.sh"

# The workspace's crates (every manifest of this repository), as rustc
# names their files: dashes become underscores.
_cargo_own_crates() {
  find "$_cd_repo" -name Cargo.toml -not -path "$_cd_repo/build/*" -exec \
    sed -n '/^\[package\]/,/^\[/s/^name *= *"\([^"]*\)".*/\1/p' {} + | tr '-' '_' | sort -u
}

# Everything the compiled crates depend on, as text: lock files and
# manifests (versions, features, profiles), cargo's configuration, the
# toolchain, cargo-fuzz, and the packages build scripts and the linker use.
cargo_deps_key() {
  local files
  files=$(cd "$_cd_repo" && find . -name Cargo.lock -o -name Cargo.toml -o -path ./.cargo/config.toml |
    grep -v '^./build/' | sort)
  printf 'files: %s\n' "$(cd "$_cd_repo" && cache_files_key $files)"
  rustc -vV
  cargo -V
  cargo fuzz --version 2>/dev/null || echo "no cargo-fuzz"
  printf 'env: RUSTFLAGS=%s CARGO_PROFILE=%s\n' "${RUSTFLAGS:-}" "$(env | grep '^CARGO_PROFILE_' | sort | tr '\n' ' ')"
  dpkg-query -W -f '${Package}=${Version}\n' gcc libc6-dev binutils pkg-config libibverbs-dev \
    librdmacm-dev 'libclang-*-dev' 'libclang1-*' 2>/dev/null | grep -v '=$' | sort
}

_cargo_deps_enabled() {
  [ "${RAMSLOG_CACHE:-}" != off ]
}

# Prints the directories of compiled artefacts under build/ (one per
# profile and target: debug, release, x86_64-unknown-linux-gnu/release...).
_cargo_profile_dirs() { # ROOT
  find "$1" -mindepth 1 -maxdepth 3 -type d -name .fingerprint -printf '%h\n' 2>/dev/null | sort
}

cargo_deps_restore() {
  _cargo_deps_enabled || return 0
  local build=$_cd_repo/build entry
  if [ -n "$(_cargo_profile_dirs "$build")" ]; then
    echo "cargo deps: build/ already has compiled crates; not seeding it"
    return 0
  fi
  # The key as the run began: the entry stored at its end is this key's,
  # whatever was installed in between.
  CARGO_DEPS_KEY=$(cargo_deps_key)
  export CARGO_DEPS_KEY
  entry=$(cache_peek cargo-deps "$CARGO_DEPS_KEY") || { echo "cargo deps: no entry for this key (built here, stored at the end)"; return 0; }
  mkdir -p "$build"
  cp -a "$entry/build/." "$build/"
  echo "cargo deps: build/ seeded from $entry ($(du -sh "$entry" | cut -f1))"
}

# The entry's builder: a copy of build/'s compiled crates, the workspace's
# own removed (they are rebuilt from the clone anyway, and must never be
# taken from anywhere else), as are incremental state and final binaries.
_cargo_deps_copy() { # DEST
  local dest=$1 dir rel own pattern
  own=$(_cargo_own_crates)
  while read -r dir; do
    rel=${dir#"$_cd_repo/build/"}
    mkdir -p "$dest/build/$rel"
    for sub in deps build .fingerprint; do
      [ -d "$dir/$sub" ] && cp -a "$dir/$sub" "$dest/build/$rel/"
    done
    for pattern in $own; do
      rm -rf "$dest/build/$rel"/{deps,build,.fingerprint}/{"$pattern",lib"$pattern"}[-.]*
      rm -rf "$dest/build/$rel"/{deps,build,.fingerprint}/"${pattern//_/-}"-*
    done
  done < <(_cargo_profile_dirs "$_cd_repo/build")
  # A test binary or doctest of the workspace that kept another name.
  find "$dest/build" -path '*/deps/*' -type f -perm -u+x ! -name '*.so' -delete
}

cargo_deps_save() {
  _cargo_deps_enabled || return 0
  [ -n "$(_cargo_profile_dirs "$_cd_repo/build")" ] || return 0
  local entry
  entry=$(cache_entry cargo-deps "${CARGO_DEPS_KEY:-$(cargo_deps_key)}" _cargo_deps_copy) || return 1
  echo "cargo deps: $entry ($(du -sh "$entry" | cut -f1))"
}
