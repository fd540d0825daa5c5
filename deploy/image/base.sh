#!/bin/sh
# A Debian 13 (trixie) base image built without any registry: debootstrap a minimal root filesystem
# (cached under build/, about a minute the first time) and import it into the container engine.
#   usage: deploy/image/base.sh [IMAGE]        (default localhost/hyperlight-agent-base:trixie)
# ENGINE overrides the engine command (default: podman, else docker), e.g. with its own storage.
set -eu
image=${1:-localhost/hyperlight-agent-base:trixie}
# The suite, and the Python it brings (the Makefile's IMAGE_PYTHON): Debian 13's 3.13.
suite=trixie
here=$(cd "$(dirname "$0")/../.." && pwd)
root="$here/build/image-base/rootfs"
# Rebuilt whenever this list changes: python3 for the agent, ca-certificates for TLS (metrics
# scrapers never need it, but a base without CA roots surprises whoever extends the image).
packages=python3,ca-certificates
# Bump when the trimming below changes, to rebuild the cache.
recipe="$suite $packages trimmed-1"

if [ -z "${ENGINE:-}" ]; then
    if command -v podman >/dev/null 2>&1; then ENGINE=podman
    elif command -v docker >/dev/null 2>&1; then ENGINE=docker
    else echo "image-base: needs podman or docker (apt-get install podman)" >&2; exit 1; fi
fi
command -v debootstrap >/dev/null 2>&1 || { echo "image-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "image-base: debootstrap needs root" >&2; exit 1; }

mkdir -p "$here/build/image-base"
(
    flock 9
    if [ "$(cat "$root/.complete" 2>/dev/null || true)" != "$recipe" ]; then
        rm -rf "$root"
        debootstrap --variant=minbase --include="$packages" "$suite" "$root" >"$here/build/image-base/debootstrap.log" 2>&1 \
            || { echo "image-base: debootstrap failed, see build/image-base/debootstrap.log" >&2; exit 1; }
        # What a container never reads: the downloaded packages, apt's caches and lists, and
        # documentation, manuals and translations (about 100 MB of the 220).
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
               "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
        printf %s "$recipe" >"$root/.complete"
    fi
) 9>"$here/build/image-base/.lock"
# .complete is ours, not the image's.
tar -C "$root" --exclude=./.complete -c . \
    | $ENGINE import --change 'CMD ["python3"]' - "$image" >"$here/build/image-base/import.log" 2>&1 \
    || { echo "image-base: import into $ENGINE failed, see build/image-base/import.log" >&2; exit 1; }
echo "$image"
