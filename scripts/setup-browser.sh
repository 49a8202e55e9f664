#!/usr/bin/env bash
# Install Debian's chromium (and a font) when missing: the tests render the run report
# in a real headless browser and keep a screenshot of it. Needs root (or password-less
# sudo) and apt-get; exits 1 without them (scripts/test.sh then skips that one test).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "fedciuic: the report test needs chromium, and there is no apt-get here to install it; install chromium yourself" >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "fedciuic: the report test needs chromium; install it with: sudo apt-get install chromium" >&2
  exit 1
fi
echo "fedciuic: installing chromium for the report test (headless browser)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null
