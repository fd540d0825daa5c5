#!/bin/sh
# Every wheel the image installs, prepared on the host so that nothing inside the build needs the
# network: the locked set for the image's Python and CPU(s) with its hashed requirements file
# (packaging/wheels.sh, as for the .deb and .rpm), and pip's own wheel as pins/image-pip.txt
# locks it, which the build runs straight from the file (`python3 pip-*.whl/pip install
# --no-index --require-hashes ...`), so the base needs no pip.
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
PYTHON=$python "$here/packaging/wheels.sh" "$out" "$pyver" "$arches"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes --only-binary=:all: \
    --dest "$out" -r "$here/pins/image-pip.txt"
