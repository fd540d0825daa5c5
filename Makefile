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
DEB_BUILD_PACKAGES := python3-venv python3-pip debhelper lintian
RPM_BUILD_PACKAGES := python3-venv python3-pip rpm rpmlint binutils
#   release: both of those, plus reprepro (the apt repository), createrepo-c (the yum ones), gnupg
#          (signatures), podman + runc (the image), skopeo (pushing its archive unchanged: make publish).
RELEASE_PACKAGES := $(DEB_BUILD_PACKAGES) $(RPM_BUILD_PACKAGES) reprepro createrepo-c gnupg podman runc skopeo
TEST_PACKAGES := protobuf-compiler podman runc gcc libc6-dev debootstrap systemd-container cpio man-db \
  containernetworking-plugins busybox-static openssl iproute2 dnf
APT_PACKAGES := $(sort $(RELEASE_PACKAGES) $(TEST_PACKAGES))
# Install those of $(1) that are missing.
apt_install = missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	fi

.PHONY: help e2e e2e-components run test check lint typecheck bench proto system-deps deb-deps rpm-deps clean deb rpm image image-base \
  image-wheels tools pin-tools lock release publish release-deps
# Package builds run in a copy of the sources under build/, never in the work tree.
PKG_SOURCES := pyproject.toml README.md hyperlight_agent proto packaging systemd pins
# The version everything is built as: hyperlight_agent/__init__.py is the one source of truth.
# VERSION=X.Y.Z builds another without editing the tree (the release tests build N-1 and N from
# one commit); a commit tagged vX.Y.Z is released only as X.Y.Z (packaging/release.py checks).
VERSION ?= $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' hyperlight_agent/__init__.py)
GIT_COMMIT := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
# The commit's time: the date of a changelog entry written for VERSION, and of the release.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || date +%s)

help:  ## the targets a contributor runs, and what each does
	@awk -F':.*## ' '/^[a-z][a-z0-9-]*:.*## / {printf "  %-11s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

run: $(VENV)/.installed  ## the agent against a local kubelet stand-in on this machine's /dev/kvm (README)
	$(PY) -m standin.demo

# Manifest judges (checkov, kubernetes-validate) pin their own dependencies: a venv of their own.
JUDGES := build/judges

# The judges of the code, written once: every target that lints or type-checks runs these.
RUFF := $(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
MYPY := $(VENV)/bin/mypy hyperlight_agent standin tests bench packaging/manpage.py packaging/release.py \
  packaging/publish.py pins/update.py
# The module layers and boundaries (pyproject.toml's [tool.importlinter]).
IMPORTS := $(VENV)/bin/lint-imports --no-cache

# Everything, system tests included, beside a neighbour agent (tests observe only what they create).
test: $(VENV)/.installed $(JUDGES)/.installed system-deps tools e2e-components  ## everything: lint, types, imports, and every test (system tests and the real cluster)
	$(RUFF)
	$(MYPY)
	$(IMPORTS)
	HYPERLIGHT_TEST_NEIGHBOUR=1 $(PY) -m pytest -q

# Just the real-cluster tests (tests/test_e2e.py): Kubernetes, etcd and containerd built from the
# pinned Go modules under tests/e2e/components, once (build/e2e/bin, Go's caches).
e2e: $(VENV)/.installed system-deps tools e2e-components  ## only the real-cluster tests (Kubernetes built from pinned Go modules)
	$(PY) -m pytest -q -m e2e

E2E_BIN := build/e2e/bin
e2e-components:
	@tests/e2e/components/build.sh $(E2E_BIN)

# The fast inner loop: no system tests, nothing that needs root, no manifest judges; .ci/run
# runs it with every capability dropped. Ends with the line coverage of the core modules
# (pyproject.toml's [tool.coverage]), measured in-process, and fails below its floor.
check: $(VENV)/.installed  ## the fast loop: lint, types, imports and the tests needing neither root nor system tools
	$(RUFF)
	$(MYPY)
	$(IMPORTS)
	@mkdir -p build && rm -f build/check.coverage*
	HYPERLIGHT_FUZZ_SCALE=0.1 $(PY) -m coverage run -m pytest -q -n 2 -m "not system and not root and not judge"
	@$(PY) -m coverage combine -q
	$(PY) -m coverage report

lint: $(VENV)/.installed  ## ruff and the import contracts
	$(RUFF)
	$(IMPORTS)

typecheck: $(VENV)/.installed  ## mypy --strict
	$(MYPY)

bench: $(VENV)/.installed  ## the speed and memory figures (BENCHMARKS.md)
	$(PY) -m bench

# Regenerate the committed message code with Debian 12's protoc (3.21): code from a newer protoc
# would not import under Debian's python3-protobuf 3.21.
proto: system-deps  ## regenerate the committed protobuf messages with Debian 12's protoc
	protoc -I proto --python_out=hyperlight_agent/deviceplugin --pyi_out=hyperlight_agent/deviceplugin proto/deviceplugin.proto
	protoc -I proto --python_out=hyperlight_agent/dra --pyi_out=hyperlight_agent/dra \
	  proto/dra_v1.proto proto/dra_v1beta1.proto proto/dra_health_v1.proto proto/dra_health_v1alpha1.proto \
	  proto/pluginregistration.proto

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

system-deps:
	@$(call apt_install,$(APT_PACKAGES))

deb-deps:
	@$(call apt_install,$(DEB_BUILD_PACKAGES))

rpm-deps:
	@$(call apt_install,$(RPM_BUILD_PACKAGES))

release-deps:
	@$(call apt_install,$(RELEASE_PACKAGES))

# Package builds need pip and the project's sources, not its test extra: a venv of their own.
BUILD_VENV := build/venv
$(BUILD_VENV)/.installed:
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null \
	  || $(MAKE) --no-print-directory deb-deps
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q --upgrade pip
	touch $@

# A .deb for Debian 12 (its python3 3.11): debhelper runs packaging/stage.sh, lintian judges.
deb: deb-deps $(BUILD_VENV)/.installed  ## the .deb for Debian 12, judged by lintian
	rm -rf build/deb && mkdir -p build/deb/hyperlight-agent
	cp -r $(PKG_SOURCES) build/deb/hyperlight-agent/
	cp -r packaging/debian build/deb/hyperlight-agent/debian
	@# Another version than the tree's (VERSION=...): an entry of its own on top of the changelog.
	cd build/deb/hyperlight-agent && if [ "$$(dpkg-parsechangelog -S Version)" != "$(VERSION)" ]; then \
	  { printf 'hyperlight-agent (%s) unstable; urgency=medium\n\n  * Built as %s from commit %s.\n\n -- %s  %s\n\n' \
	      '$(VERSION)' '$(VERSION)' '$(GIT_COMMIT)' "$$(dpkg-parsechangelog -S Maintainer)" \
	      "$$(date -R -u -d @$(SOURCE_DATE_EPOCH))"; cat debian/changelog; } >debian/changelog.new \
	  && mv debian/changelog.new debian/changelog; fi
	cd build/deb/hyperlight-agent && VERSION=$(VERSION) PYTHON=$(abspath $(BUILD_VENV)/bin/python) \
	  dpkg-buildpackage -b -us -uc >../build.log 2>&1 \
	  || { tail -30 ../build.log; exit 1; }
	lintian --fail-on error,warning --suppress-tags-from-file /dev/null build/deb/*.deb
	@ls -l build/deb/*.deb

# RPMs for the RPM hosts that run Hyperlight, one per target Python: EL9 (3.9) and
# Azure Linux 3 (3.12), the MSHV hosts. rpmlint judges with the project's config.
RPM_TARGETS := el9:3.9 azl3:3.12
rpm: rpm-deps $(BUILD_VENV)/.installed  ## the .rpm for EL9 and Azure Linux 3, judged by rpmlint
	rm -rf build/rpm && mkdir -p build/rpm
	sed 's/^Version:.*/Version:        $(VERSION)/' packaging/rpm/hyperlight-agent.spec >build/rpm/hyperlight-agent.spec
	set -e; for target in $(RPM_TARGETS); do dist=$${target%%:*}; py=$${target#*:}; \
	  VERSION=$(VERSION) UNITDIR=/usr/lib/systemd/system PYTHON=$(abspath $(BUILD_VENV)/bin/python) \
	    packaging/stage.sh build/rpm/stage-$$dist $$py x86_64; \
	  shlibs=$$(packaging/shlib-requires.sh build/rpm/stage-$$dist | tr '\n' ' '); \
	  rpmbuild -bb --quiet --define "_topdir $(CURDIR)/build/rpm/top" \
	    --define "stagedir $(CURDIR)/build/rpm/stage-$$dist" --define "target_python $$py" \
	    --define "shlib_requires $$shlibs" \
	    --define "dist .$$dist" --define "notice $(CURDIR)/packaging/debian/copyright" \
	    build/rpm/hyperlight-agent.spec; \
	done
	rpmlint --config packaging/rpm/rpmlint.toml build/rpm/top/RPMS/*/*.rpm
	@ls -l build/rpm/top/RPMS/*/*.rpm

# The container image (deploy/image/build.sh): this CPU by default, PLATFORMS=linux/amd64,linux/arm64
# for a manifest list; podman or docker (ENGINE=...). Nothing in the build needs the network: the
# wheels are prepared here first (image-wheels). BASE_IMAGE defaults to the Containerfile's pinned
# python:3.11-slim; `make image-base` builds a Debian 12 base locally for machines without a
# registry (then: make image BASE_IMAGE=localhost/hyperlight-agent-base:bookworm).
IMAGE ?= ghcr.io/hyperlight-dev/hyperlight-agent:dev
IMAGE_PYTHON ?= 3.11
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
  deploy/image/wheels.sh packaging/wheels.sh
	@mkdir -p build && VERSION=$(VERSION) PYTHON=$(PYTHON) deploy/image/wheels.sh $(IMAGE_WHEELS) $(IMAGE_PYTHON) '$(IMAGE_ARCHES)' \
	  >build/image-wheels.log 2>&1 || { echo "make image: preparing wheels failed: $$(tail -n 1 build/image-wheels.log)" >&2; exit 1; }
	@touch $@
image-base:  ## a Debian 12 base image built locally, for machines without a registry
	@ENGINE='$(ENGINE)' deploy/image/base.sh

# The release tools (pins/release.txt): uv writes the locks, cyclonedx-bom the SBOMs.
RELEASE_TOOLS := build/release-tools
$(RELEASE_TOOLS)/.installed: pins/release.txt
	$(PYTHON) -m venv $(RELEASE_TOOLS)
	$(RELEASE_TOOLS)/bin/pip install -q -r pins/release.txt
	touch $@

# The runtime dependencies of everything we ship, locked with hashes per target Python (3.9 EL9,
# 3.11 Debian 12 and the image, 3.12 Azure Linux 3) in pins/runtime-py*.txt, and pip for the image
# build: `make lock` resolves pyproject.toml's ranges anew at the newest releases (then run
# `make test` before committing the locks). Packages and the image install exactly these.
LOCK_PYTHONS := 3.9 3.11 3.12
UV_COMPILE = $(RELEASE_TOOLS)/bin/uv pip compile --quiet --upgrade --generate-hashes --custom-compile-command 'make lock'
lock: $(RELEASE_TOOLS)/.installed  ## re-resolve the runtime locks (pins/runtime-py*.txt) at the newest releases, with hashes
	set -e; for py in $(LOCK_PYTHONS); do \
	  $(UV_COMPILE) --python-version $$py --python-platform x86_64-manylinux_2_28 -o pins/runtime-py$$py.txt pyproject.toml; \
	done
	echo pip | $(UV_COMPILE) --python-version 3.11 -o pins/image-pip.txt -

# A complete, signed release in $(DIST)/$(VERSION)/ (what it holds: packaging/release.py): the
# .deb, the signed .rpm, signed apt and yum repositories, the image as an OCI archive, the chart
# whose default image is that archive's by digest, SBOMs, SHA256SUMS and its signature. Signing
# key: RELEASE_GPG_KEY in GNUPGHOME (none: a key made for this build only, for testing). The image
# is built as by `make image` (ENGINE, BASE_IMAGE: e.g. make image-base's, where no registry is).
DIST ?= dist
release: release-deps $(BUILD_VENV)/.installed $(RELEASE_TOOLS)/.installed tools  ## a complete signed release in dist/<version>/ (VERSION= for another)
	@VERSION='$(VERSION)' DIST='$(DIST)' GIT_COMMIT='$(GIT_COMMIT)' SOURCE_DATE_EPOCH='$(SOURCE_DATE_EPOCH)' \
	  ENGINE='$(ENGINE)' BASE_IMAGE='$(BASE_IMAGE)' $(PYTHON) packaging/release.py

# Publish $(DIST)/$(VERSION)/ (packaging/publish.py): the image and the chart to REGISTRY (OCI), the
# image signed with cosign and its SBOM attached as an attestation (COSIGN_KEY: a key pair's
# private half; unset: keyless, through the CI's OIDC identity), and the package repositories
# copied into SITE for hosting. INSECURE_REGISTRY=1: plain HTTP (a registry on this machine).
publish: release-deps tools  ## push and sign a release: REGISTRY= (OCI), SITE= (the package repositories)
	@VERSION='$(VERSION)' DIST='$(DIST)' REGISTRY='$(REGISTRY)' SITE='$(SITE)' INSECURE_REGISTRY='$(INSECURE_REGISTRY)' \
	  COSIGN_KEY='$(COSIGN_KEY)' $(PYTHON) packaging/publish.py

clean:  ## remove the venvs and build products
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
