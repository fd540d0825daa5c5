#!/bin/sh
# The agent's wheel (and sdnotify's), built from a fresh copy of the sources the wheel is made of:
# built in the work tree, setuptools reuses its build/lib, so a module deleted from the tree would
# still ship.
#   usage: packaging/wheel.sh OUTDIR
set -eu
out=$1
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r "$here/pyproject.toml" "$here/README.md" "$here/hyperlight_agent" "$src/"
find "$src" -name '__pycache__' -type d -prune -exec rm -rf {} +
# sdnotify is published as source only; it is pure Python, so a wheel built here fits any target.
"$python" -m pip wheel --no-deps --quiet --wheel-dir "$out" "$src" sdnotify
