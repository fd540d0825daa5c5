#!/usr/bin/env bash
# Builds the Hyperlight example: the guest (guest/, a bare-metal ELF) and the host program (host/,
# one static executable), from their committed Cargo.lock files with rustup's 1.95.0 toolchain,
# into OUTDIR/hyperlight-guest and OUTDIR/hyperlight-example. Each file appears whole (built
# elsewhere, then renamed into place) or not at all.
#
# Caches, outside the checkout so a later clone builds warm: cargo's target directories and the
# standard library's source for the guest, under $HYPERLIGHT_EXAMPLE_CACHE (default
# ~/.cache/hyperlight-agent/hyperlight-example); downloaded crates stay in cargo's own registry.
# Prints one line per step with its time; cargo's output goes to a log, shown only if it fails.
#
# Needs: rustup with the 1.95.0 toolchain, a C compiler and glibc's static libraries (libc6-dev:
# the host links glibc in; a dependency compiles some C), apt-get, dpkg-deb and gpgv (Debian's).
#
# Usage: build.sh OUTDIR
set -euo pipefail

me=build.sh
fail() { echo "$me: $*" >&2; exit 1; }
[ $# -eq 1 ] && [ -n "$1" ] || { echo "usage: $me OUTDIR" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1" 2>/dev/null || fail "cannot create output directory $1"
out=$(cd "$1" && pwd)
cache=${HYPERLIGHT_EXAMPLE_CACHE:-$HOME/.cache/hyperlight-agent/hyperlight-example}
mkdir -p "$cache" 2>/dev/null || fail "cannot create cache directory $cache"
cache=$(cd "$cache" && pwd)
cargo_home=${CARGO_HOME:-$HOME/.cargo}

# The toolchain, named explicitly: the guest's standard library source must match it exactly.
TOOLCHAIN=1.95.0
# Rust's standard library source for that compiler (rustup's rust-src is not reachable here):
# Debian's package of the same upstream release, from trixie-backports. Only its library/ tree is
# used. Its SHA-256 is pinned, so the bytes are known whichever mirror serves them; apt also
# checks the archive's signature with the host's Debian keyring.
RUST_SRC_VERSION=1.95.0+dfsg1-2~bpo13+1
RUST_SRC_SHA256=7b76db5b880a77f9e52975d2baa6209d2f76d2c9c2789515c3088cb960e2c83b
RUST_SRC_SUITE=trixie-backports
DEBIAN_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

# Nothing from the caller's environment may change how cargo builds (RUSTFLAGS, for one, would
# replace the configs' flags); cargo runs the rustup proxy's 1.95.0 toolchain.
unset RUSTFLAGS CARGO_ENCODED_RUSTFLAGS CARGO_BUILD_RUSTFLAGS CARGO_BUILD_TARGET CARGO_TARGET_DIR \
  CARGO_BUILD_TARGET_DIR RUSTC RUSTC_WRAPPER RUSTC_WORKSPACE_WRAPPER CARGO_BUILD_RUSTC \
  CARGO_BUILD_RUSTC_WRAPPER RUSTC_BOOTSTRAP
export RUSTUP_TOOLCHAIN=$TOOLCHAIN
# Nothing built here stamps a date, but cc (used by a dependency's build script) reads this and
# cargo reruns that script whenever it changes: a constant keeps every clone and commit warm.
export SOURCE_DATE_EPOCH=1700000000
jobs=$(nproc)

command -v cargo >/dev/null || fail "cargo not found (rustup's proxy, with the $TOOLCHAIN toolchain)"
rustc_vv=$(rustc -vV 2>/dev/null) || fail "rustup toolchain $TOOLCHAIN is not installed (rustup toolchain install $TOOLCHAIN)"
rustc_commit=$(sed -n 's/^commit-hash: //p' <<<"$rustc_vv")
toolchain_sysroot=$(rustc --print sysroot) || fail "rustc --print sysroot failed"
command -v cc >/dev/null || fail "no C compiler (cc): install gcc and libc6-dev"

# Every temporary thing of this run in one directory beside OUTDIR (the same filesystem, so the
# outputs' final rename is atomic); removed at exit, whatever happens.
work=$(mktemp -d "$out/.build.XXXXXX") || fail "cannot write into $out"
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM HUP  # through the EXIT trap, so nothing of this run is left behind

now() { echo "${EPOCHREALTIME/[.,]/}"; }  # microseconds
since() { local d=$(($(now) - $1)); printf '%d.%d' $((d / 1000000)) $((d % 1000000 / 100000)); }

# run LOG WHAT COMMAND...: the command's output to LOG; on failure, its end and one line saying
# what failed.
run() {
  local log=$1 what=$2 status=0; shift 2
  "$@" >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    tail -n 25 "$log" | sed 's/^/  | /' >&2
    fail "$what failed (exit status $status)"
  fi
}

# built LOG: what cargo did, by its log.
built() { if grep -q '^ *Compiling ' "$1"; then echo built; else echo up to date; fi; }

# --- 1. The standard library's source, fetched once into the cache -------------------------------
rust_src=$cache/rust-src/$RUST_SRC_VERSION
started=$(now)
if [ -f "$rust_src/.complete" ]; then
  echo "$me: rust-src $RUST_SRC_VERSION: cached ($(since "$started") s)"
else
  # One fetch at a time per cache: another build (a second clone) may be doing it right now.
  exec {lock}>"$cache/rust-src.lock"
  flock "$lock"
  if [ ! -f "$rust_src/.complete" ]; then
    for tool in apt-get dpkg-deb gpgv; do
      command -v "$tool" >/dev/null || fail "$tool not found: it is needed to fetch Debian's rust-src"
    done
    [ -r "$DEBIAN_KEYRING" ] || fail "$DEBIAN_KEYRING missing: install debian-archive-keyring"
    # The mirror: HYPERLIGHT_EXAMPLE_DEBIAN_MIRROR, else the Debian archive this host's own apt
    # sources use (deb822 .sources or one-line .list entries).
    mirror=${HYPERLIGHT_EXAMPLE_DEBIAN_MIRROR:-$(
      cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        sed -n -E -e 's/^URIs:[[:space:]]*//p' -e 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' |
        tr -s ' \t' '\n' | grep -m1 -E '^https?://.*/debian/?$' || true)}
    [ -n "$mirror" ] || fail "no Debian archive in /etc/apt sources: set HYPERLIGHT_EXAMPLE_DEBIAN_MIRROR"
    # A private apt: its own sources, lists, cache and (empty) status, and none of the host's
    # configuration; nothing of the host's apt state is read or written, nothing is installed.
    apt=$cache/apt
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc/parts" "$apt/state"
    : >"$apt/state/status"
    echo "deb [signed-by=$DEBIAN_KEYRING check-valid-until=no] $mirror $RUST_SRC_SUITE main" >"$apt/etc/sources.list"
    cat >"$apt/etc/apt.conf" <<EOF
Dir::Etc::SourceList "$apt/etc/sources.list";
Dir::Etc::SourceParts "$apt/etc/parts";
Dir::Etc::Parts "$apt/etc/parts";
Dir::Etc::Preferences "$apt/etc/preferences";
Dir::Etc::PreferencesParts "$apt/etc/parts";
Dir::Etc::Trusted "$apt/etc/trusted.gpg";
Dir::Etc::TrustedParts "$apt/etc/parts";
Dir::State "$apt/state";
Dir::State::Lists "$apt/lists";
Dir::State::status "$apt/state/status";
Dir::Cache "$apt/cache";
Acquire::Languages "none";
// The files live in the user's cache, which apt's unprivileged _apt user may not reach.
APT::Sandbox::User "$(id -un)";
EOF
    export APT_CONFIG=$apt/etc/apt.conf
    run "$work/apt-update.log" "apt-get update (private, $mirror $RUST_SRC_SUITE)" apt-get -q update
    mkdir -p "$work/deb"
    (cd "$work/deb" && run "$work/apt-download.log" "apt-get download rust-src=$RUST_SRC_VERSION" \
      apt-get -q download "rust-src=$RUST_SRC_VERSION")
    unset APT_CONFIG
    deb=$(echo "$work"/deb/rust-src_*.deb)
    [ -f "$deb" ] || fail "apt-get download left no rust-src .deb"
    [ "$(sha256sum "$deb" | cut -d' ' -f1)" = "$RUST_SRC_SHA256" ] \
      || fail "rust-src $RUST_SRC_VERSION: SHA-256 is not the pinned $RUST_SRC_SHA256"
    # Unpacked beside the cache's copy, then renamed: a half-unpacked tree is never used.
    rm -rf "$rust_src.new" && mkdir -p "$rust_src.new"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$rust_src.new" "./usr/src/rustc-$TOOLCHAIN/library" \
      || fail "unpacking $deb failed"
    rm -f "$deb"
    touch "$rust_src.new/.complete"
    rm -rf "$rust_src" && mv "$rust_src.new" "$rust_src"
    echo "$me: rust-src $RUST_SRC_VERSION: fetched ($(since "$started") s)"
  else
    echo "$me: rust-src $RUST_SRC_VERSION: cached ($(since "$started") s)"
  fi
  exec {lock}>&-
fi

# --- 2. The guest ---------------------------------------------------------------------------------
# Cargo's -Z build-std looks for the library source in the compiler's sysroot, at
# lib/rustlib/src/rust/library, which is where rustup's rust-src component puts it. Rather than add
# it to the shared rustup toolchain, a private sysroot in the cache holds links: the host's
# prebuilt libraries and tools (the toolchain's own) and the fetched source. Cargo finds the
# source through the sysroot it asks rustc about for the host, so the host flags (-Z host-config,
# documented in cargo's unstable book) name it; cargo's undocumented __CARGO_TESTS_ONLY_SRC_ROOT
# would do too, but is a test hook.
sysroot=$cache/sysroot-$TOOLCHAIN
host_triple=$(sed -n 's/^host: //p' <<<"$rustc_vv")
# link TARGET NAME: made only if it differs, so a build running beside this one never finds it gone.
link() { [ "$(readlink "$2")" = "$1" ] || ln -sfn "$1" "$2"; }
mkdir -p "$sysroot/lib/rustlib/src"
link "$toolchain_sysroot/lib/rustlib/$host_triple" "$sysroot/lib/rustlib/$host_triple"
link "$rust_src/usr/src/rustc-$TOOLCHAIN" "$sysroot/lib/rustlib/src/rust"
[ -f "$sysroot/lib/rustlib/src/rust/library/Cargo.lock" ] || fail "no library source under $sysroot"
# Paths the binaries would otherwise carry (in panic messages): the crates' and the library's
# sources, mapped to fixed names (the library's to /rustc/COMMIT, as in rustup's own builds).
remap_registry="--remap-path-prefix=$cargo_home/registry/src=/cargo/registry/src"
remap_library="--remap-path-prefix=$sysroot/lib/rustlib/src/rust=/rustc/$rustc_commit"

started=$(now)
# The stable compiler and cargo accept -Z flags with RUSTC_BOOTSTRAP=1: for this build only.
(
  cd "$here/guest"
  export RUSTC_BOOTSTRAP=1
  run "$work/guest.log" "guest build (cargo build in $here/guest; log above)" \
    cargo build --locked --release -j "$jobs" --target-dir "$cache/target/guest" \
    -Z host-config -Z target-applies-to-host \
    --config 'target-applies-to-host = false' \
    --config "host.rustflags = [\"--sysroot=$sysroot\"]" \
    --config "target.x86_64-unknown-none.rustflags = [\"$remap_registry\", \"$remap_library\"]"
)
guest=$cache/target/guest/x86_64-unknown-none/release/hyperlight-guest
[ -f "$guest" ] || fail "guest build left no $guest"
echo "$me: guest (x86_64-unknown-none, soft-float): $(built "$work/guest.log") ($(since "$started") s)"

# --- 3. The host program --------------------------------------------------------------------------
started=$(now)
(
  cd "$here/host"
  run "$work/host.log" "host build (cargo build in $here/host; log above)" \
    cargo build --locked --release -j "$jobs" --target-dir "$cache/target/host" \
    --config "target.x86_64-unknown-linux-gnu.rustflags = [\"$remap_registry\"]"
)
host=$cache/target/host/x86_64-unknown-linux-gnu/release/hyperlight-example
[ -f "$host" ] || fail "host build left no $host"
echo "$me: host (x86_64-unknown-linux-gnu, static): $(built "$work/host.log") ($(since "$started") s)"

# --- 4. Into OUTDIR: each copied beside its final name, then renamed over it --------------------
cp "$guest" "$work/hyperlight-guest"
cp "$host" "$work/hyperlight-example"
chmod 0755 "$work/hyperlight-guest" "$work/hyperlight-example"
mv -f "$work/hyperlight-guest" "$out/hyperlight-guest"
mv -f "$work/hyperlight-example" "$out/hyperlight-example"
echo "$me: wrote $out/hyperlight-example ($(stat -c %s "$out/hyperlight-example") bytes)" \
  "and $out/hyperlight-guest ($(stat -c %s "$out/hyperlight-guest") bytes)"
