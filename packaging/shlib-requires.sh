#!/bin/sh
# The shared libraries the vendored extension modules under STAGEDIR/usr/lib/hyperlight-agent
# need from the host, as RPM capabilities (`libstdc++.so.6()(64bit)`): the RPM declares them
# itself because AutoReqProv is off (automatic Python provides/requires would describe the
# private tree as if it were site-packages). Libraries bundled inside the tree are left out.
#   usage: packaging/shlib-requires.sh STAGEDIR
set -eu
lib="$1/usr/lib/hyperlight-agent"
bundled=$(find "$lib" -name '*.so*' -type f -exec basename {} \; | sort -u)
find "$lib" -name '*.so*' -type f -exec readelf -d {} + \
    | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p' | sort -u \
    | while read -r soname; do
        printf '%s\n' "$bundled" | grep -qxF "$soname" || printf '%s()(64bit)\n' "$soname"
    done
