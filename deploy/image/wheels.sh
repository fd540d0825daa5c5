#!/bin/sh
# Every wheel the image installs, prepared on the host so that nothing inside the build needs the
# network: the agent's own wheel, its dependencies resolved for the image's Python and CPU(s)
# (as packaging/stage.sh resolves them for the .deb and .rpm), and pip's own wheel, which the
# build runs straight from the file (`python3 pip-*.whl/pip install --no-index ...`), so the
# base needs no pip.
#   usage: deploy/image/wheels.sh OUTDIR [PYTHON_VERSION] [ARCHES]   (defaults: 3.11, this CPU)
#   ARCHES: comma-separated, e.g. x86_64,aarch64
set -eu
out=$1
pyver=${2:-3.11}
arches=${3:-$(uname -m)}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$python" -m pip --version >/dev/null 2>&1 || { echo "make image: needs $python with pip (apt-get install python3-pip)" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
PYTHON=$python "$here/packaging/wheel.sh" "$out"
# pip evaluates environment markers against the Python running pip, not --python-version.
extra=""
if [ "$(printf '%s\n%s\n' "$pyver" 3.11 | sort -V | head -n1)" != 3.11 ]; then
    extra="tomli>=1.1 exceptiongroup>=1.0.2"  # ours (tomllib), and anyio's (lightkube, DRA)
fi
for arch in $(echo "$arches" | tr , ' '); do
    "$python" -m pip download --quiet --disable-pip-version-check --dest "$out" --find-links "$out" \
        --python-version "$pyver" --implementation cp --only-binary=:all: \
        --platform "manylinux2014_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux_2_28_$arch" \
        "$out"/hyperlight_agent-*.whl pip $extra
done
