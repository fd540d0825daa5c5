#!/usr/bin/env bash
# Writes k8s-v1.MINOR/go.mod for one Kubernetes release: k8s.io/kubernetes at that version, and every
# staging module it replaces with a path inside its own repository replaced by the published release
# of the same minor (v1.37.2 <-> v0.37.2); replaces of a dependency are ignored by Go, so we must.
# Then adds the commands we build as tool directives, records go.sum, and writes the minor's row in
# ./kubernetes (added, or replaced when the minor moves to another patch), which build.sh and the
# tests read. Usage: pin-kubernetes.sh v1.37.2 kube-apiserver kube-controller-manager kube-scheduler kubelet
set -euo pipefail
version=$1; shift
minor=$(cut -d. -f2 <<<"$version")
here=$(cd "$(dirname "$0")" && pwd)
dir=$here/k8s-v1.$minor
mkdir -p "$dir" && cd "$dir"
upstream=$(cd / && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$version" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])')
{
  echo "// Kubernetes $version for the e2e tests (written by ../pin-kubernetes.sh)."
  echo "module hyperlight.dev/e2e/k8s-v1.$minor"
  echo
  echo "go 1.26"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  # (A pre-release too: v1.38.0-beta.0 <-> v0.38.0-beta.0.)
  awk -v to="v0.${version#v1.}" '$2 == "=>" && $3 ~ /^\.\/staging\// {print "\t" $1 " => " $1 " " to}' "$upstream"
  echo ")"
} >go.mod
rm -f go.sum
go get -tool $(printf "k8s.io/kubernetes/cmd/%s@$version " "$@")
go mod tidy

table=$here/kubernetes
{
  awk 'NF == 0 || substr($1, 1, 1) == "#"' "$table"
  { awk -v m="1.$minor" 'NF > 0 && substr($1, 1, 1) != "#" && $1 != m' "$table"
    printf '%-8s %-10s %s\n' "1.$minor" "k8s-v1.$minor" "$*"; } | sort -t. -k2,2nr
} >"$table.new"
mv "$table.new" "$table"
