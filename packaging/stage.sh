#!/bin/sh
# Stage the installed file tree of hyperlight-agent into DESTDIR: the layout the .deb and .rpm
# ship and the system tests boot. Dependencies are wheels for the *target* Python, fetched at
# build time, so nothing is downloaded at install time.
#   usage: packaging/stage.sh DESTDIR [TARGET_PYTHON_VERSION] [ARCH]   (defaults: 3.11 x86_64)
set -eu
dest=$1
pyver=${2:-3.11}
arch=${3:-x86_64}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
lib="$dest/usr/lib/hyperlight-agent"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT

rm -rf "$lib"
PYTHON=$python "$here/packaging/wheel.sh" "$wheels"
# pip evaluates environment markers against the Python running pip, not --python-version, so
# marker-selected dependencies for an older target are named here (tests/test_rpm.py checks).
extra=""
if [ "$(printf '%s\n%s\n' "$pyver" 3.11 | sort -V | head -n1)" != 3.11 ]; then
    extra="tomli>=1.1 exceptiongroup>=1.0.2"  # ours (tomllib), and anyio's (lightkube, DRA)
fi
"$python" -m pip install --quiet --no-compile --target "$lib" --find-links "$wheels" \
    --python-version "$pyver" --implementation cp --only-binary=:all: \
    --platform "manylinux2014_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux_2_28_$arch" \
    "$wheels"/hyperlight_agent-*.whl $extra
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
