# Every target sets itself up: a fresh Debian 12 with root and package registries is enough.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Debian packages, split by who needs them. A packager running `make deb` or `make rpm` gets only
# what that build (and its judge, lintian or rpmlint) needs; `make test` gets everything.
#   build: python3-venv + python3-pip (the build venv, wheels for the target Python), debhelper +
#          lintian (.deb), rpm + rpmlint + binutils (.rpm; readelf derives its library Requires).
#   test:  protoc (generated-code check), podman + runc (a real CDI consumer, with gcc building its
#          one-binary test image), debootstrap + systemd-container (systemd as PID 1), cpio (RPM
#          contents), man-db (man page lint), dnf (a yum client reading our signed repositories);
#          for the real cluster (make e2e): containernetworking-plugins (pod networks), busybox-static
#          (the workload image's shell), openssl (per-run certificates), iproute2 (bridges).
#          The Hyperlight example (make hyperlight-example) needs gcc + libc6-dev and rustup's
#          1.95.0 toolchain, which these machines have (rustup is not a Debian package here).
DEB_BUILD_PACKAGES := python3-venv python3-pip debhelper lintian
RPM_BUILD_PACKAGES := python3-venv python3-pip rpm rpmlint binutils
#   release: both of those, plus reprepro (the apt repository), createrepo-c (the yum ones), gnupg
#          (signatures), podman + runc (the image), skopeo (pushing its archive unchanged: make publish).
# (gcc, libc6-dev and Debian's keyring: the Hyperlight example's build, whose image a release holds.)
RELEASE_PACKAGES := $(DEB_BUILD_PACKAGES) $(RPM_BUILD_PACKAGES) reprepro createrepo-c gnupg podman runc skopeo \
  gcc libc6-dev debian-archive-keyring
TEST_PACKAGES := protobuf-compiler podman runc gcc libc6-dev debootstrap systemd-container cpio man-db \
  containernetworking-plugins busybox-static openssl iproute2 dnf
APT_PACKAGES := $(sort $(RELEASE_PACKAGES) $(TEST_PACKAGES))
# Install those of $(1) that are missing.
apt_install = missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	fi

.PHONY: help hyperlight-example e2e e2e-components e2e-components-background tools-background run test check lint typecheck bench proto system-deps deb-deps rpm-deps clean deb rpm image image-base \
  image-wheels tools pin-tools lock release publish resign release-deps
# Package builds run in a copy of the sources under build/, never in the work tree.
PKG_SOURCES := pyproject.toml README.md hyperlight_agent proto packaging systemd pins
# The version everything is built as: hyperlight_agent/__init__.py is the one source of truth.
# VERSION=X.Y.Z builds another without editing the tree (the release tests build N-1 and N from
# one commit); a commit tagged vX.Y.Z is released only as X.Y.Z (packaging/release.py checks).
VERSION ?= $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' hyperlight_agent/__init__.py)
GIT_COMMIT := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
# The commit's time: the date of a changelog entry written for VERSION, and of the release.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || date +%s)

# The host targets, one row each in packaging/targets (its header says the columns); `make deb`,
# `make rpm`, `make lock` and `make release` read it. A format's rows, as TAG:PYTHON:UNITDIR:SUITE:
# DISTRIBUTION:REQUIRES words:
# TARGETS=TAG… builds those rows only (e.g. make deb TARGETS=deb13); unset: every row.
TARGETS_TABLE := packaging/targets
TARGETS ?=
all_rows = $(shell awk 'NF == 8 && substr($$1, 1, 1) != "\#" && $$2 == "$(1)" {print $$1 ":" $$6 ":" $$7 ":" $$5 ":" $$3 ":" $$8}' $(TARGETS_TABLE))
target_rows = $(if $(TARGETS),$(filter $(addsuffix :%,$(TARGETS)),$(call all_rows,$(1))),$(call all_rows,$(1)))
$(foreach t,$(TARGETS),$(if $(filter $(t):%,$(call all_rows,deb) $(call all_rows,rpm)),,$(error TARGETS: no row '$(t)' in $(TARGETS_TABLE))))
DEB_TARGETS := $(call target_rows,deb)
RPM_TARGETS := $(call target_rows,rpm)
# The image's Python: its base's python3 (Debian 13's), with a lock of its own like every target's.
IMAGE_PYTHON ?= 3.13

help:  ## the targets a contributor runs, and what each does
	@awk -F':.*## ' '/^[a-z][a-z0-9-]*:.*## / {printf "  %-11s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

run: $(VENV)/.installed  ## the agent against a local kubelet stand-in on this machine's /dev/kvm (README)
	$(PY) -m standin.demo

# Manifest judges (checkov, kubernetes-validate) pin their own dependencies: a venv of their own.
JUDGES := build/judges

# The judges of the code, written once: every target that lints or type-checks runs these.
RUFF := $(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
MYPY := $(VENV)/bin/mypy hyperlight_agent standin tests bench packaging/manpage.py packaging/targets.py packaging/chart_env.py packaging/settings_doc.py packaging/modules_doc.py \
  packaging/release.py packaging/publish.py packaging/resign.py packaging/cargo_sbom.py pins/update.py
# The module layers and boundaries (pyproject.toml's [tool.importlinter]).
IMPORTS := $(VENV)/bin/lint-imports --no-cache

# Everything, system tests included, beside a neighbour agent (tests observe only what they create).
# The Go builds (cold, the longest set-up steps) run in the background while the tests that need
# neither run: the tools (tests/e2e/tools.py) at a low priority, the real clusters' components (every
# Kubernetes minor, etcd and containerd) at the lowest. conftest.py runs the tests that need the
# tools after the others, and the cluster tests last; each waits only for what it drives (build.sh's
# lock on each), and a build that a test waits for runs at the tests' priority from then on.
# Both builds end with make at the latest. Two pytest-xdist workers: one takes the session's real
# cluster, the other the rest, the other minors' whole clusters among it (conftest.py's lanes), so
# the waits of one (boots, rollouts, pods) leave the cores to the other's tests.
# The session ends with its phases' times.
test: $(VENV)/.installed tools-background e2e-components-background $(JUDGES)/.installed system-deps  ## everything: lint, types, imports, and every test (system tests and the real cluster)
	$(RUFF)
	$(MYPY)
	$(IMPORTS)
	HYPERLIGHT_TEST_NEIGHBOUR=1 $(PY) -m pytest -q --durations=40 -n 2 --dist loadgroup

# Just the real-cluster tests (tests/test_e2e.py): Kubernetes, etcd and containerd built from the
# pinned Go modules under tests/e2e/components, once (build/e2e/bin, Go's caches).
e2e: $(VENV)/.installed system-deps tools e2e-components  ## only the real-cluster tests (Kubernetes built from pinned Go modules)
	$(PY) -m pytest -q -m e2e --durations=40

E2E_BIN := build/e2e/bin
e2e-components:
	@tests/e2e/components/build.sh $(E2E_BIN)

# The same build started in its own session (so that the whole of it can be stopped), its output
# in build/e2e/components.log, ended with make at the latest (BUILD_STOPS_WITH: make's pid); the
# e2e harness runs build.sh again before a cluster starts, which waits for it.
e2e-components-background:
	@mkdir -p $(E2E_BIN)
	@BUILD_STOPS_WITH=$$PPID setsid nice -n 19 tests/e2e/components/build.sh $(E2E_BIN) \
	  >build/e2e/components.log 2>&1 </dev/null &

# The fast inner loop: no system tests, nothing that needs root, no manifest judges; .ci/run
# runs it with every capability dropped. Ends with the line coverage of the core modules
# (pyproject.toml's [tool.coverage]), measured in-process, and fails below its floor.
# Its tests mostly wait on timers and sockets, so three workers per core (on 2 cores: 33 s with
# six, 41 s with four, 34 s with eight: each worker's start costs a core-second or two); each
# worker imports and collects the suite, so compiled code (and pytest's rewritten tests) are kept in
# build/pycache from one run to the next, even where PYTHONDONTWRITEBYTECODE is set.
CHECK_WORKERS := $(shell echo $$(( $$(nproc) * 3 )))
CHECK_ENV := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/build/pycache HYPERLIGHT_FUZZ_SCALE=0.1
check: $(VENV)/.installed  ## the fast loop: lint, types, imports and the tests needing neither root nor system tools
	$(RUFF)
	$(MYPY)
	$(IMPORTS)
	@mkdir -p build && rm -f build/check.coverage*
	$(CHECK_ENV) $(PY) -m coverage run -m pytest -q -n $(CHECK_WORKERS) --dist worksteal -m "not system and not root and not judge"
	@$(PY) -m coverage combine -q
	$(PY) -m coverage report

lint: $(VENV)/.installed  ## ruff and the import contracts
	$(RUFF)
	$(IMPORTS)

typecheck: $(VENV)/.installed  ## mypy --strict
	$(MYPY)

# The real client (deploy/examples/hyperlight): a Hyperlight host program and its guest, from their
# committed locks with rustup's 1.95.0 toolchain; the tests run it wherever the device is handed.
hyperlight-example:  ## build the Hyperlight example workload into build/hyperlight-example
	@deploy/examples/hyperlight/build.sh build/hyperlight-example

bench: $(VENV)/.installed  ## the speed and memory figures (BENCHMARKS.md)
	$(PY) -m bench

# Regenerate the committed message code with Debian 12's protoc (3.21): code from a newer protoc
# would not import under Debian's python3-protobuf 3.21.
proto: system-deps  ## regenerate the committed protobuf messages with Debian 12's protoc
	protoc -I proto --python_out=hyperlight_agent/deviceplugin --pyi_out=hyperlight_agent/deviceplugin proto/deviceplugin.proto
	protoc -I proto --python_out=hyperlight_agent/dra --pyi_out=hyperlight_agent/dra \
	  proto/dra_v1.proto proto/dra_v1beta1.proto proto/dra_health_v1.proto proto/dra_health_v1alpha1.proto \
	  proto/pluginregistration.proto

# The tools' build in the background, as the components' below: its output in build/tools.log.
tools-background:
	@mkdir -p $(TOOLS)
	@BUILD_STOPS_WITH=$$PPID setsid nice -n 10 tests/e2e/components/build.sh $(TOOLS) tools \
	  >build/tools.log 2>&1 </dev/null &

# Development tools and judges are pinned exactly in pins/ (dev.txt: the `test` extra; dra.txt: the
# DRA mode's API client and its dependencies, in the development venv; judges.txt),
# so an unchanged tree keeps its verdicts; `make pin-tools` moves the pins to the newest releases.
$(VENV)/.installed: pyproject.toml pins/dev.txt pins/dra.txt
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null \
	  || $(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -c pins/dev.txt -c pins/dra.txt
	touch $@

$(JUDGES)/.installed: pins/judges.txt
	$(PYTHON) -m venv $(JUDGES)
	$(JUDGES)/bin/pip install -q -r pins/judges.txt
	touch $@

# On purpose only: resolve the newest releases in fresh venvs (build/pin) and rewrite pins/; then
# `make check` and `make test` say whether the tree still passes under them, before committing.
PIN := build/pin
pin-tools:  ## move the pinned development tools to their newest releases
	rm -rf $(PIN)
	$(PYTHON) -m venv $(PIN)/dev
	$(PIN)/dev/bin/python -m pip install -q --upgrade pip
	$(PIN)/dev/bin/python -m pip install -q '.[test]'
	$(PYTHON) -m venv $(PIN)/judges
	$(PIN)/judges/bin/python -m pip install -q $$(sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' pins/judges.txt)
	$(PIN)/dev/bin/python pins/update.py $(PIN)/dev/bin/python $(PIN)/judges/bin/python
	rm -rf $(PIN)

# The tools the tests and the release drive, built from pinned Go modules beside the e2e
# components (tests/e2e/components: helm 4 with a 1.37 client, kubectl 1.37, the CNCF distribution
# registry, cosign), once, into build/tools; never shipped.
TOOLS := build/tools
tools:
	@tests/e2e/components/build.sh $(TOOLS) tools

# One of them (tool-helm, tool-cosign, …), for a target that drives only it: `make release` waits
# for helm alone, not for the rest of a build make test runs in the background.
tool-%:
	@tests/e2e/components/build.sh $(TOOLS) tools $*

system-deps:
	@$(call apt_install,$(APT_PACKAGES))

deb-deps:
	@$(call apt_install,$(DEB_BUILD_PACKAGES))

rpm-deps:
	@$(call apt_install,$(RPM_BUILD_PACKAGES))

release-deps:
	@$(call apt_install,$(RELEASE_PACKAGES))

# Package builds need pip and the build backend, not the test extra: a venv of their own, the
# build environment of every wheel we build (packaging/wheels.sh builds without isolation), installed
# from pins/build.txt by hash: nothing unpinned runs in a build.
BUILD_VENV := build/venv
$(BUILD_VENV)/.installed: pins/build.txt
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null \
	  || $(MAKE) --no-print-directory deb-deps
	rm -rf $(BUILD_VENV)
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q --disable-pip-version-check --require-hashes -r pins/build.txt
	touch $@

# The wheels of one target Python at one VERSION (packaging/wheels.sh: the lock's files, kept
# across builds by pip's cache; the agent's and sdnotify's built here), made once and shared by
# every package for that Python (Ubuntu 24.04, EL10 and Azure Linux 3 share 3.12's).
WHEELS := build/wheels/$(VERSION)
$(WHEELS)/py%/.complete: pyproject.toml README.md $(wildcard hyperlight_agent/*.py hyperlight_agent/*/*.py) pins/runtime-py%.txt \
  pins/build.txt packaging/wheels.sh $(BUILD_VENV)/.installed
	@rm -rf $(@D) && start=$$(date +%s) \
	  && VERSION=$(VERSION) PYTHON=$(abspath $(BUILD_VENV)/bin/python) packaging/wheels.sh $(@D) $* x86_64 \
	  && echo "wheels for Python $*: $$(( $$(date +%s) - start )) s" && touch $@
# One target's row as shell variables (tag py unitdir suite distribution requires), in a recipe.
read_row = set -- $$(echo "$$row" | tr : ' '); tag=$$1 py=$$2 unitdir=$$3 suite=$$4 distribution=$$5 requires=$$6

# A .deb per Debian and Ubuntu target (packaging/targets), for its python3: debhelper runs
# packaging/stage.sh, lintian judges with the distribution's profile. The version carries the
# target's tag (0.1.0+deb13): one apt pool holds them all, and a host moving to a newer release
# upgrades to its package.
deb: $(foreach row,$(DEB_TARGETS),deb-of-$(firstword $(subst :, ,$(row))))  ## a .deb per Debian/Ubuntu target, judged by lintian
	@ls -l $(foreach row,$(DEB_TARGETS),build/deb/hyperlight-agent_$(VERSION)+$(firstword $(subst :, ,$(row)))_*.deb) 2>/dev/null \
	  || echo "make deb: TARGETS names no Debian or Ubuntu row"
# Each row's package is a target of its own (deb-of-TAG, built each time: no file of that name), so
# `make -j deb` builds them side by side (`make release` does); each works in build/deb/TAG only.
# A tag with no row has no wheels to depend on: make says "No rule to make target" and exits 2.
row_python = $(word 2,$(subst :, ,$(filter $(1):%,$(DEB_TARGETS))))
.SECONDEXPANSION:
deb-of-%: deb-deps $(BUILD_VENV)/.installed $(WHEELS)/py$$(call row_python,$$*)/.complete
	@set -e; row='$(filter $*:%,$(DEB_TARGETS))'; $(read_row); start=$$(date +%s); \
	  rm -rf build/deb/$$tag; rm -f build/deb/hyperlight-agent_*+$${tag}_*.deb; \
	  tree=build/deb/$$tag/hyperlight-agent; mkdir -p $$tree; \
	  cp -r $(PKG_SOURCES) $$tree/; cp -r packaging/debian $$tree/debian; \
	  cd $$tree; \
	  { printf 'hyperlight-agent (%s+%s) %s; urgency=medium\n\n  * Built for %s from commit %s.\n\n -- %s  %s\n\n' \
	      '$(VERSION)' "$$tag" "$$suite" "$$suite" '$(GIT_COMMIT)' "$$(dpkg-parsechangelog -S Maintainer)" \
	      "$$(date -R -u -d @$(SOURCE_DATE_EPOCH))"; cat debian/changelog; } >debian/changelog.new; \
	  mv debian/changelog.new debian/changelog; \
	  VERSION=$(VERSION) TARGET_PYTHON=$$py UNITDIR=$$unitdir TARGET_REQUIRES=$$requires \
	    WHEELS=$(abspath $(WHEELS))/py$$py PYTHON=$(abspath $(BUILD_VENV)/bin/python) \
	    dpkg-buildpackage -b -us -uc >../build.log 2>&1 || { tail -30 ../build.log; exit 1; }; \
	  cd $(CURDIR); \
	  lintian --profile $$distribution --fail-on error,warning --suppress-tags-from-file /dev/null build/deb/$$tag/*.deb; \
	  mv build/deb/$$tag/*.deb build/deb/; \
	  echo "deb $$tag: built and judged in $$(( $$(date +%s) - start )) s"

# An .rpm per RPM target (packaging/targets: EL9, EL10, Azure Linux 3), for its Python, judged by
# rpmlint with the project's config, a warning failing the build as an error does.
rpm: rpm-deps $(BUILD_VENV)/.installed $(sort $(foreach row,$(RPM_TARGETS),$(WHEELS)/py$(word 2,$(subst :, ,$(row)))/.complete))  ## an .rpm per EL/Azure Linux target, judged by rpmlint
	rm -rf build/rpm && mkdir -p build/rpm
	sed 's/^Version:.*/Version:        $(VERSION)/' packaging/rpm/hyperlight-agent.spec >build/rpm/hyperlight-agent.spec
	@set -e; for row in $(RPM_TARGETS); do $(read_row); start=$$(date +%s); \
	  VERSION=$(VERSION) UNITDIR=$$unitdir WHEELS=$(abspath $(WHEELS))/py$$py PYTHON=$(abspath $(BUILD_VENV)/bin/python) \
	    packaging/stage.sh build/rpm/stage-$$tag $$py x86_64; \
	  shlibs=$$(packaging/shlib-requires.sh build/rpm/stage-$$tag | tr '\n' ' '); \
	  rpmbuild -bb --quiet --define "_topdir $(CURDIR)/build/rpm/top" \
	    --define "stagedir $(CURDIR)/build/rpm/stage-$$tag" --define "target_python $$py" \
	    --define "shlib_requires $$shlibs" --define "target_requires $$(echo $$requires | tr , ' ')" \
	    --define "dist .$$tag" --define "notice $(CURDIR)/packaging/debian/copyright" \
	    build/rpm/hyperlight-agent.spec; \
	  rpmlint --strict --config packaging/rpm/rpmlint.toml build/rpm/top/RPMS/*/*.$$tag.*.rpm; \
	  echo "rpm $$tag: built and judged in $$(( $$(date +%s) - start )) s"; \
	done
	@ls -l build/rpm/top/RPMS/*/*.rpm 2>/dev/null || echo "make rpm: TARGETS names no EL or Azure Linux row"

# The container image (deploy/image/build.sh): this CPU by default, PLATFORMS=linux/amd64,linux/arm64
# for a manifest list; podman or docker (ENGINE=...). Nothing in the build needs the network: the
# wheels are prepared here first (image-wheels). BASE_IMAGE defaults to the Containerfile's pinned
# python:3.13-slim-trixie; `make image-base` builds a Debian 13 base locally for machines without a
# registry (then: make image BASE_IMAGE=localhost/hyperlight-agent-base:trixie). IMAGE_PYTHON
# (above) is the base's Python.
IMAGE ?= ghcr.io/hyperlight-dev/hyperlight-agent:dev
PLATFORMS ?=
IMAGE_ARCHES = $(if $(PLATFORMS),$(subst linux/amd64,x86_64,$(subst linux/arm64,aarch64,$(PLATFORMS))),$(shell uname -m))
IMAGE_WHEELS := build/image-wheels
comma := ,
image: image-wheels  ## the container image (podman or docker)
	@IMAGE='$(IMAGE)' BASE_IMAGE='$(BASE_IMAGE)' PLATFORMS='$(PLATFORMS)' GIT_COMMIT='$(GIT_COMMIT)' \
	  VERSION='$(VERSION)' ENGINE='$(ENGINE)' deploy/image/build.sh
# Rebuilt when the sources, the locks, the version, the target Python or the CPUs change.
image-wheels: $(IMAGE_WHEELS)/.stamp-$(VERSION)-$(IMAGE_PYTHON)-$(subst $(comma),_,$(IMAGE_ARCHES))
$(IMAGE_WHEELS)/.stamp-%: pyproject.toml $(wildcard hyperlight_agent/*.py hyperlight_agent/*/*.py) $(wildcard pins/*.txt) \
  deploy/image/wheels.sh packaging/wheels.sh $(BUILD_VENV)/.installed
	@mkdir -p build && VERSION=$(VERSION) PYTHON=$(abspath $(BUILD_VENV)/bin/python) deploy/image/wheels.sh $(IMAGE_WHEELS) $(IMAGE_PYTHON) '$(IMAGE_ARCHES)' \
	  >build/image-wheels.log 2>&1 || { echo "make image: preparing wheels failed: $$(tail -n 1 build/image-wheels.log)" >&2; exit 1; }
	@touch $@
image-base:  ## a Debian 13 base image built locally, for machines without a registry
	@ENGINE='$(ENGINE)' deploy/image/base.sh

# The release tools (pins/release.in, locked with every dependency and hash in pins/release.txt):
# uv writes the locks, cyclonedx-bom the SBOMs.
RELEASE_TOOLS := build/release-tools
$(RELEASE_TOOLS)/.installed: pins/release.txt
	rm -rf $(RELEASE_TOOLS)
	$(PYTHON) -m venv $(RELEASE_TOOLS)
	$(RELEASE_TOOLS)/bin/pip install -q --disable-pip-version-check --require-hashes -r pins/release.txt
	touch $@

# The runtime dependencies of everything we ship, locked with hashes per target Python (each
# Python of packaging/targets and the image's) in pins/runtime-py*.txt, pip for the image build, and the tools of the build and the release (pins/build.in, pins/release.in: every
# dependency, hashed): `make lock` resolves the ranges anew at the newest releases (then run
# `make test` before committing the locks). Packages and the image install exactly these.
LOCK_PYTHONS := $(sort $(foreach row,$(call all_rows,deb) $(call all_rows,rpm),$(word 2,$(subst :, ,$(row)))) $(IMAGE_PYTHON))
UV_COMPILE = $(RELEASE_TOOLS)/bin/uv pip compile --quiet --upgrade --generate-hashes --custom-compile-command 'make lock'
lock: $(RELEASE_TOOLS)/.installed  ## re-resolve the locks (pins/runtime-py*.txt, build.txt, release.txt) at the newest releases, with hashes
	set -e; for py in $(LOCK_PYTHONS); do \
	  $(UV_COMPILE) --python-version $$py --python-platform x86_64-manylinux_2_28 -o pins/runtime-py$$py.txt pyproject.toml; \
	done
	echo pip | $(UV_COMPILE) --python-version $(IMAGE_PYTHON) -o pins/image-pip.txt -
	@# The tools of the build and the release, for whichever Python the build host runs (3.9 on).
	$(UV_COMPILE) --universal --python-version 3.9 -o pins/build.txt pins/build.in
	$(UV_COMPILE) --universal --python-version 3.9 -o pins/release.txt pins/release.in

# A complete, signed release in $(DIST)/$(VERSION)/ (what it holds: packaging/release.py): the
# .deb, the signed .rpm, signed apt and yum repositories, the image as an OCI archive, the
# Hyperlight example's image as another (its build needs what make hyperlight-example needs), the
# chart whose default image is the first's and whose `helm test` runs the second's, by digest,
# SBOMs, SHA256SUMS and its signature. Signing
# key: RELEASE_GPG_KEY in GNUPGHOME (none: a key made for this build only, for testing). The image
# is built as by `make image` (ENGINE, BASE_IMAGE: e.g. make image-base's, where no registry is).
DIST ?= dist
release: release-deps $(BUILD_VENV)/.installed $(RELEASE_TOOLS)/.installed tool-helm  ## a complete signed release in dist/<version>/ (VERSION= for another)
	@VERSION='$(VERSION)' DIST='$(DIST)' GIT_COMMIT='$(GIT_COMMIT)' SOURCE_DATE_EPOCH='$(SOURCE_DATE_EPOCH)' \
	  ENGINE='$(ENGINE)' BASE_IMAGE='$(BASE_IMAGE)' IMAGE_PYTHON='$(IMAGE_PYTHON)' TARGETS='$(TARGETS)' \
	  $(PYTHON) packaging/release.py

# Publish $(DIST)/$(VERSION)/ (packaging/publish.py): only a release signed by the release key,
# RELEASE_GPG_FINGERPRINT (the project's, configured where this runs: never read from the release;
# a release signed with a key made for its build is refused). The images and the chart to REGISTRY
# (OCI), each signed with cosign by digest and each image's SBOM attached as an attestation
# (COSIGN_KEY: a key pair's private half; unset: keyless, through the CI's OIDC identity), and the
# package repositories copied into SITE for hosting. INSECURE_REGISTRY=1: plain HTTP (a registry on
# this machine).
publish: release-deps tool-helm tool-cosign  ## push and sign a release: REGISTRY= (OCI), SITE= (the package repositories), RELEASE_GPG_FINGERPRINT=
	@VERSION='$(VERSION)' DIST='$(DIST)' REGISTRY='$(REGISTRY)' SITE='$(SITE)' INSECURE_REGISTRY='$(INSECURE_REGISTRY)' \
	  COSIGN_KEY='$(COSIGN_KEY)' RELEASE_GPG_FINGERPRINT='$(RELEASE_GPG_FINGERPRINT)' $(PYTHON) packaging/publish.py

# Re-date and re-sign the published apt repository in SITE (packaging/resign.py) before its
# Release's Valid-Until (30 days): the release workflow's weekly `resign` job. RELEASE_GPG_KEY in
# GNUPGHOME, as for `make release`; only a Release that key signed is signed again.
resign:  ## re-sign the published apt repository in SITE= before it expires (weekly, from the release workflow)
	@$(call apt_install,gnupg)
	@SITE='$(SITE)' RELEASE_GPG_KEY='$(RELEASE_GPG_KEY)' $(PYTHON) packaging/resign.py

clean:  ## remove the venvs and build products
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
