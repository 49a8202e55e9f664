#!/usr/bin/env bash
# Install Debian's chromium (and a font) when missing: the tests render the run report
# in a real headless browser and keep a screenshot of it. Needs root (or sudo) and apt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo -n)
else
  echo "fedciuic: the report test needs chromium; install it with: apt-get install chromium" >&2
  exit 1
fi
echo "fedciuic: installing chromium for the report test (headless browser)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null
