# Sourced by tests/run-all.sh: Debian's own prometheus and promtool for the
# metrics tests, unpacked into build/tools (the package's service is never
# installed or started).

# prometheus_tools: print the directory holding prometheus and promtool,
# fetching bookworm's package the first time.
prometheus_tools() {
  local dir="$PWD/build/tools/prometheus"
  if [ ! -x "$dir/usr/bin/promtool" ] || [ ! -x "$dir/usr/bin/prometheus" ]; then
    rm -rf "$dir" && mkdir -p "$dir/deb"
    # apt-get download warns that _apt cannot write there when run as root.
    (cd "$dir/deb" && { apt-get download -qq prometheus 2>/dev/null ||
      { apt-get update -qq && apt-get download -qq prometheus 2>/dev/null; }; }) || {
      echo "cannot download Debian's prometheus package (apt-get download prometheus)" >&2
      return 1
    }
    dpkg-deb -x "$dir"/deb/prometheus_*.deb "$dir"
    rm -rf "$dir/deb"
  fi
  echo "$dir/usr/bin"
}
