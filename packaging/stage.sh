#!/bin/sh
# Stage the installed file tree of hyperlight-agent into DESTDIR: the layout the .deb and .rpm
# ship and the system tests boot. Dependencies are the wheels pins/runtime-pyX.Y.txt locks for
# the *target* Python (packaging/wheels.sh), installed with --require-hashes at build time, so
# nothing is downloaded at install time. VERSION (environment), when set, is the agent's version.
#   usage: packaging/stage.sh DESTDIR [TARGET_PYTHON_VERSION] [ARCH]   (defaults: 3.11 x86_64)
# WHEELS (environment), when set: a directory packaging/wheels.sh already filled for this Python
# and VERSION (the Makefile builds one per Python and shares it between that Python's packages).
# Why: docs/decisions/a-private-vendored-tree.md
set -eu
dest=$1
pyver=${2:-3.11}
arch=${3:-x86_64}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
lib="$dest/usr/lib/hyperlight-agent"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

rm -rf "$lib"
wheels=${WHEELS:-$scratch}
[ -n "${WHEELS:-}" ] || PYTHON=$python "$here/packaging/wheels.sh" "$wheels" "$pyver" "$arch"
# Exactly the locked set for the target's Python: nothing resolved, every file's hash checked.
"$python" -m pip install --quiet --disable-pip-version-check --no-compile --target "$lib" \
    --no-index --find-links "$wheels" --require-hashes --no-deps \
    --python-version "$pyver" --implementation cp --only-binary=:all: \
    --platform "manylinux2014_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux_2_28_$arch" \
    -r "$wheels/requirements.txt"
# PyYAML's optional C accelerator carries its own copy of libyaml (lintian: embedded-library);
# the DRA mode parses one kubeconfig with it, for which the pure-Python loader is enough.
rm -f "$lib"/yaml/_yaml.cpython-*.so
# pip's own bookkeeping and console-script stubs are not part of the installed tree.
rm -rf "$lib"/bin "$lib"/*.dist-info/RECORD "$lib"/*.dist-info/INSTALLER "$lib"/*.dist-info/REQUESTED \
       "$lib"/*.dist-info/direct_url.json
find "$lib" -name '__pycache__' -type d -prune -exec rm -rf {} +
# Wheels carry arbitrary modes and stray #! lines on modules nobody executes; a library tree is
# 0644 files in 0755 directories, and a module is imported, never run.
find "$lib" -type d -exec chmod 0755 {} +
find "$lib" -type f -exec chmod 0644 {} +
find "$lib" -type f -name '*.py' -exec sed -i '1{/^#!/d}' {} +

install -D -m 0755 "$here/packaging/hyperlight-agent" "$dest/usr/bin/hyperlight-agent"
# Debian 12 keeps units in /lib/systemd/system; RPM distributions use /usr/lib/systemd/system.
unitdir=${UNITDIR:-/lib/systemd/system}
install -D -m 0644 "$here/systemd/hyperlight-agent.service" "$dest$unitdir/hyperlight-agent.service"
install -D -m 0644 "$here/packaging/tmpfiles.conf" "$dest/usr/lib/tmpfiles.d/hyperlight-agent.conf"
install -D -m 0644 "$here/packaging/agent.toml" "$dest/etc/hyperlight-agent/agent.toml"
mkdir -p "$dest/usr/share/man/man8"
"$python" "$here/packaging/manpage.py" | gzip -9n > "$dest/usr/share/man/man8/hyperlight-agent.8.gz"
