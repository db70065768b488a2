#!/usr/bin/env bash
# The quick start on Debian 12 or Ubuntu 24.04 with a Rust toolchain from rustup:
# installs the packages the build needs (apt-get, as root or through sudo),
# builds ramslog-target as you, then starts it with sudo (it pins memory).
#   target/quickstart.sh                        a 4 GiB in-memory LUN on 127.0.0.1:3260
#   target/quickstart.sh --size 1G --ephemeral --listen 127.0.0.1:3270
# Arguments, if any, replace the default "--size 4G --ephemeral".
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
# shellcheck source=../tests/lib/packages.sh
. tests/lib/packages.sh
say() { printf 'quickstart: %s\n' "$*" >&2; }

# cargo as root through sudo leaves a root-owned build/ and ~/.cargo behind.
if [ "$(id -u)" = 0 ] && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
  say "run this as yourself, without sudo: it builds as you and uses sudo itself to install packages and start the target"
  exit 1
fi
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    PATH="$HOME/.cargo/bin:$PATH"
  else
    say "no Rust toolchain: install one with rustup (https://rustup.rs: curl --proto '=https' -sSf https://sh.rustup.rs | sh), then run this again"
    exit 1
  fi
fi

read -r -a missing <<<"$(missing_build_packages)"
apt_install "${missing[@]}"

say "building ramslog-target (release) as $(id -un)"
cargo build --release --locked -p ramslog-target

args=("$@")
((${#args[@]})) || args=(--size 4G --ephemeral)
bin=$repo/build/release/ramslog-target
if [ "$#" = 0 ]; then
  say "NOTE: this LUN has no ACL and no CHAP: every local user can read and write it (see the README's quick start)"
fi
say "starting: $bin ${args[*]}  (status: sudo $bin status; stop: Ctrl-C or sudo $bin stop)"
if [ "$(id -u)" = 0 ]; then
  exec "$bin" "${args[@]}"
fi
command -v sudo >/dev/null || { say "sudo is missing: run as root: $bin ${args[*]}"; exit 1; }
exec sudo "$bin" "${args[@]}"
