#!/bin/sh
# `make image`: build the image from the wheels in build/image-wheels, for this CPU (default) or
# PLATFORMS (e.g. linux/amd64,linux/arm64: a manifest list), with podman or docker, and print
# the ID or digest that docs/deploy.md tells operators to use. Any failure is one line saying
# what is missing. Settings (environment): IMAGE, BASE_IMAGE, PLATFORMS, GIT_COMMIT, VERSION,
# ENGINE (the engine command, e.g. `podman --root DIR` for private storage).
# Why: docs/decisions/the-image.md
set -eu
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
fail() { echo "make image: $*" >&2; exit 1; }

image=${IMAGE:-ghcr.io/hyperlight-dev/hyperlight-agent:dev}
base=${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' Containerfile)}
engine=${ENGINE:-}
if [ -z "$engine" ]; then
    if command -v podman >/dev/null 2>&1; then engine=podman
    elif command -v docker >/dev/null 2>&1; then engine=docker
    else fail "needs podman or docker (e.g. apt-get install podman)"; fi
fi
case "$engine" in *docker*) kind=docker ;; *) kind=podman ;; esac
ls build/image-wheels/hyperlight_agent-*.whl >/dev/null 2>&1 || fail "no wheels in build/image-wheels (make image-wheels)"

# The base: present, or pulled now; one line if neither.
if ! $engine image inspect "$base" >/dev/null 2>&1; then
    $engine pull -q "$base" >/dev/null 2>&1 \
        || fail "cannot get the base image $base (no registry?); make image-base builds one here: make image BASE_IMAGE=localhost/hyperlight-agent-base:trixie"
fi

args="--build-arg BASE_IMAGE=$base --build-arg GIT_COMMIT=${GIT_COMMIT:-unknown} --build-arg VERSION=${VERSION:-0.1.0} -f Containerfile"
log=build/image.log
rm -f build/image.id build/image.digest build/image.json
if [ -z "${PLATFORMS:-}" ]; then
    # shellcheck disable=SC2086 # args is a list of words
    $engine build $args --iidfile build/image.id -t "$image" . >"$log" 2>&1 \
        || { tail -n 20 "$log" >&2; fail "build failed, see $log"; }
    id=$(cat build/image.id)
    size=$($engine image inspect --format '{{.Size}}' "$id")
    # For `make bench` (bench/__main__.py): what was built, on which base, how big.
    printf '{"image": "%s", "id": "%s", "base": "%s", "engine": "%s", "size": %s}\n' \
        "$image" "$id" "$base" "$kind" "$size" >build/image.json
    echo "image: $image"
    echo "id: $id ($(( size / 1000000 )) MB)"
    if [ "$kind" = podman ]; then
        echo "to pin it: podman push --digestfile build/image.digest $image, then use REPOSITORY@<that digest> (docs/deploy.md)"
    else
        echo "to pin it: docker push $image, then use REPOSITORY@<the digest it prints> (docs/deploy.md)"
    fi
elif [ "$kind" = podman ]; then
    $engine manifest rm "$image" >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    $engine build $args --platform "$PLATFORMS" --manifest "$image" . >"$log" 2>&1 \
        || { tail -n 20 "$log" >&2; fail "build failed for $PLATFORMS (other CPUs need qemu-user-static), see $log"; }
    # The manifest list's digest is the one to pin: written as the list is pushed.
    echo "manifest list: $image ($PLATFORMS)"
    echo "push it, then pin the list's digest: podman manifest push --all --digestfile build/image.digest $image docker://$image"
else
    # shellcheck disable=SC2086
    docker buildx build $args --platform "$PLATFORMS" --metadata-file build/image.metadata.json --push -t "$image" . \
        >"$log" 2>&1 || { tail -n 20 "$log" >&2; fail "buildx failed for $PLATFORMS, see $log"; }
    digest=$(sed -n 's/.*"containerimage.digest": *"\(sha256:[0-9a-f]*\)".*/\1/p' build/image.metadata.json)
    echo "$digest" >build/image.digest
    echo "manifest list: $image@$digest (pushed)"
fi
