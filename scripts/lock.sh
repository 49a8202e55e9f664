#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions scripts/setup.sh installs: in a throwaway
# venv, torch per FEDCIUIC_TORCH_SPEC (as setup.sh), then fedciuic[dev] unconstrained
# (the newest of everything within pyproject.toml's ranges); its `pip freeze` is the
# new constraints.txt, less torch and its CUDA-only dependencies (nvidia-*, triton: a
# CUDA machine installs its own torch build) and fedciuic itself. Run the tests
# (bash scripts/test.sh) on the result before committing it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${FEDCIUIC_TORCH_SPEC:-torch==2.13.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fedciuic: locking in a throwaway venv with $($PYTHON --version)"
"$PYTHON" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "$TORCH_SPEC"
"${pip[@]}" install -q -e ".[dev]"
{
  echo "# Exact versions the tests passed with; scripts/setup.sh installs with -c constraints.txt."
  echo "# Made by scripts/lock.sh on $(date -u +%Y-%m-%d) with $("$tmp/venv/bin/python" --version)" \
    "on $(uname -sm) and $TORCH_SPEC:"
  echo "# the pip freeze of fedciuic[dev] installed unconstrained (the newest within pyproject.toml's"
  echo "# ranges), less torch, nvidia-*, triton and fedciuic itself."
  echo "# To refresh: bash scripts/lock.sh, then bash scripts/test.sh, then commit it."
  "${pip[@]}" freeze --exclude-editable | grep -viE '^(torch|triton|fedciuic)( *[=@]|$)|^nvidia-'
} > "$tmp/constraints.txt"
mv "$tmp/constraints.txt" constraints.txt
echo "fedciuic: wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
