#!/usr/bin/env bash
# Builds from the pinned modules beside this script into OUT/<name>/<version>/, once: a directory
# that is complete (its .complete stamp) is reused. Go's module and build caches (GOMODCACHE,
# GOCACHE) make a rebuild after a version bump incremental. Prints the time each took.
#   components: the e2e clusters (etcd, containerd, and each Kubernetes row's commands);
#   tools: what the tests and `make release`/`make publish` drive (helm, kubectl, the CNCF
#          distribution registry, cosign, promtool), into OUT/versions/<name>/<version>/, each
#          linked as OUT/<name>. Never shipped.
# NAME…: only these (a tool; etcd, containerd or a Kubernetes minor such as 1.35). Without them,
# every one, in the order the tests first need them: make test starts that in the background and
# each test asks for what it needs just before it starts, finding it built or waiting for it.
# Usage: build.sh OUT [components|tools] [NAME...]   (default: components, all)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd)
set_=${2:-components}
case $set_ in components | tools) ;; *) echo "build.sh: want components or tools, got '$set_'" >&2; exit 2 ;; esac
shift $(($# < 2 ? $# : 2))
wanted=" $* "
# Where each build goes: the tools' under versions/, so that OUT/<tool> can be its link.
into=$out; [ "$set_" != tools ] || into=$out/versions
# Started in the background (`make test`): BUILD_STOPS_WITH names the process whose end ends this
# build (make), so a run that stops early leaves no build behind. This script leads its own
# process group there (setsid), which the watcher ends whole. Its pid in OUT/.background tells a
# test that waits for it whose priority to raise (build()).
if [ -n "${BUILD_STOPS_WITH:-}" ]; then
  (while kill -0 "$BUILD_STOPS_WITH" 2>/dev/null; do sleep 1; done; kill -- -$$) &
  watcher=$!
  echo $$ >"$out/.background"
  trap 'kill $watcher 2>/dev/null; rm -f "$out/.background"' EXIT
fi
# No DWARF from the compiler either (the linker's -w drops it anyway): 7–11 % less CPU for a cold
# build (containerd, measured twice each way), and a cold run is CPU-bound on 2 cores.
export PATH=/usr/local/go/bin:$PATH CGO_ENABLED=0 GOFLAGS="-mod=readonly -gcflags=all=-dwarf=false"
go=${GO:-go}  # the go command (the tests' stand-in records what it was asked)
command -v "$go" >/dev/null || { echo "build.sh: $go: not found (Go 1.26 is expected at /usr/local/go)" >&2; exit 2; }

# version MODULE_DIR PATH: the version go.mod pins for PATH.
version() { awk -v p="$2" '$1 == p && $2 ~ /^v/ {print $2; exit} $1 == "require" && $2 == p {print $3; exit}' "$1/go.mod"; }

# raise_background: the background build (make test's), started at a low priority so that the
# tests beside it keep the cores, runs from now on at this process's priority: a test waits for
# it. Lowering a nice value needs root (make test runs as root); elsewhere it stays as it was.
raise_background() {
  local pid; pid=$(cat "$out/.background" 2>/dev/null) || return 0
  [ "$pid" != $$ ] && grep -qs build.sh "/proc/$pid/cmdline" || return 0
  renice -n "$(nice)" -g "$pid" >/dev/null 2>&1 || true
}

# build NAME MODULE_DIR VERSION LDFLAGS TAGS PKG...: one at a time per OUT/NAME/VERSION (its
# lock): a second asker waits there for the first (the background build or a test) and finds it done.
build() {
  local name=$1 dir=$2 ver=$3 ldflags=$4 tags=$5; shift 5
  local out_name; out_name=$(basename "$1"); [ "$1" != go.etcd.io/etcd/server/v3 ] || out_name=etcd
  local dest=$into/$name/$ver lock
  mkdir -p "$into/$name"
  exec {lock}>"$into/$name/.$ver.lock"
  flock -n "$lock" || { raise_background; flock "$lock"; }
  # Reused when built from the same packages (a row that gains a component is built again).
  if [ "$(cat "$dest/.complete" 2>/dev/null)" = "$*" ]; then
    echo "e2e components: $name $ver cached"
  else
    rm -rf "$dest" && mkdir -p "$dest"
    local start=$SECONDS
    # One package is named for its path (go would name go.etcd.io/etcd/server/v3 "server").
    local target=$dest/; [ $# -gt 1 ] || target=$dest/$out_name
    (cd "$here/$dir" && "$go" build -tags "$tags" -ldflags "$ldflags" -o "$target" "$@")
    echo "$*" >"$dest/.complete"
    echo "e2e components: $name $ver built in $((SECONDS - start)) s"
  fi
  # A tool is reached by its link, made under its lock.
  [ "$set_" != tools ] || ln -sfn "versions/$name/$ver/$out_name" "$out/$name"
  exec {lock}>&-
}

# wants NAME: whether this run builds NAME (every one when none was named).
wants() { [ "$wanted" = "  " ] || [[ $wanted == *" $1 "* ]]; }

k8s_ldflags() {
  local v=$1 minor; minor=$(cut -d. -f2 <<<"$v")
  local f
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  echo "-s -w$f"
}

# The rows of ./kubernetes (minor, module directory, components), newest first.
rows() { awk 'NF >= 3 && substr($1, 1, 1) != "#"' "$here/kubernetes" | sort -t. -k2,2nr; }
total=$SECONDS
newest_dir=$(rows | awk 'NR == 1 {print $2}')
newest=$(version "$here/$newest_dir" k8s.io/kubernetes)
if [ "$set_" = tools ]; then
  known=" helm registry cosign kubectl promtool "
else
  known=" etcd containerd $(rows | awk '{printf "%s ", $1}')"
fi
for name in $wanted; do
  [[ $known == *" $name "* ]] || { echo "build.sh: $set_: no $name (known:$known)" >&2; exit 2; }
done
if [ "$set_" = tools ]; then
  # In the order the tests first need them: helm for `make release`, the registry and cosign to
  # publish it; the judges' kubectl and promtool after.
  helm=$(version "$here/helm" helm.sh/helm/v4)
  registry=$(version "$here/registry" github.com/distribution/distribution/v3)
  cosign=$(version "$here/cosign" github.com/sigstore/cosign/v3)
  prometheus=$(version "$here/promtool" github.com/prometheus/prometheus)
  ! wants helm || build helm helm "$helm" "-s -w -X helm.sh/helm/v4/internal/version.version=$helm \
    -X helm.sh/helm/v4/internal/version.gitTreeState=clean" "" helm.sh/helm/v4/cmd/helm
  ! wants registry || build registry registry "$registry" \
    "-s -w -X github.com/distribution/distribution/v3/version.version=$registry" "" \
    github.com/distribution/distribution/v3/cmd/registry
  ! wants cosign || build cosign cosign "$cosign" "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=$cosign" "" \
    github.com/sigstore/cosign/v3/cmd/cosign
  # kubectl from the newest row's module (its replaces, its build cache).
  ! wants kubectl || build kubectl "$newest_dir" "$newest" "$(k8s_ldflags "$newest")" providerless \
    k8s.io/kubernetes/cmd/kubectl
  # Prometheus tags its Go module v0.3XX.Y for its release 3.XX.Y: promtool reports the latter.
  # remove_all_sd leaves out every service discovery (cloud SDKs, client-go): the tests check rules
  # and queries only, and it more than halves the cold build.
  promver=$(sed -E 's/^v0\.3([0-9]{2})\./3.\1./; s/^3\.0([0-9])\./3.\1./' <<<"$prometheus")
  ! wants promtool || build promtool promtool "$prometheus" \
    "-s -w -X github.com/prometheus/common/version.Version=$promver" \
    remove_all_sd github.com/prometheus/prometheus/cmd/promtool
  echo "tools: ready in $((SECONDS - total)) s under $out"
  exit 0
fi
# In the order the clusters' lane first needs them (tests/conftest.py): etcd and containerd for
# every cluster; the oldest row's whole cluster first, whose last test moves its control plane to
# the newest row; then the other rows' whole clusters, newest first (the session's cluster last).
etcd=$(version "$here/etcd" go.etcd.io/etcd/server/v3)
ctrd=$(version "$here/containerd" github.com/containerd/containerd/v2)
! wants etcd || build etcd etcd "$etcd" "-s -w" "" go.etcd.io/etcd/server/v3
! wants containerd || build containerd containerd "$ctrd" "-s -w -X github.com/containerd/containerd/v2/version.Version=$ctrd" \
  no_btrfs github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr
while read -r minor dir commands; do
  wants "$minor" || continue
  ver=$(version "$here/$dir" k8s.io/kubernetes)
  # shellcheck disable=SC2086  # the commands are words
  build kubernetes "$dir" "$ver" "$(k8s_ldflags "$ver")" providerless $(printf 'k8s.io/kubernetes/cmd/%s ' $commands)
done < <(rows | awk '{row[NR] = $0} END {if (NR) print row[NR]; for (i = 1; i < NR; i++) print row[i]}')
echo "e2e components: ready in $((SECONDS - total)) s under $out"
