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
#          contents), man-db (man page lint).
DEB_BUILD_PACKAGES := python3-venv python3-pip debhelper lintian
RPM_BUILD_PACKAGES := python3-venv python3-pip rpm rpmlint binutils
TEST_PACKAGES := protobuf-compiler podman runc gcc libc6-dev debootstrap systemd-container cpio man-db
APT_PACKAGES := $(sort $(DEB_BUILD_PACKAGES) $(RPM_BUILD_PACKAGES) $(TEST_PACKAGES))
# Install those of $(1) that are missing.
apt_install = missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	fi

.PHONY: run test lint typecheck bench proto system-deps deb-deps rpm-deps clean deb rpm image
# Package builds run in a copy of the sources under build/, never in the work tree.
PKG_SOURCES := pyproject.toml README.md hyperlight_agent proto packaging systemd

run: $(VENV)/.installed
	$(PY) -m hyperlight_agent.demo

# Manifest judges (checkov, kubernetes-validate) pin their own dependencies: a venv of their own.
JUDGES := build/judges

test: $(VENV)/.installed $(JUDGES)/.installed system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy hyperlight_agent tests bench packaging/manpage.py
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy hyperlight_agent tests bench packaging/manpage.py

bench: $(VENV)/.installed
	$(PY) -m bench

# Regenerate the committed message code with Debian 12's protoc (3.21): code from a newer protoc
# would not import under Debian's python3-protobuf 3.21.
proto: system-deps
	protoc -I proto --python_out=hyperlight_agent --pyi_out=hyperlight_agent proto/deviceplugin.proto

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null \
	  || $(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(JUDGES)/.installed:
	$(PYTHON) -m venv $(JUDGES)
	$(JUDGES)/bin/pip install -q checkov kubernetes-validate
	touch $@

system-deps:
	@$(call apt_install,$(APT_PACKAGES))

deb-deps:
	@$(call apt_install,$(DEB_BUILD_PACKAGES))

rpm-deps:
	@$(call apt_install,$(RPM_BUILD_PACKAGES))

# Package builds need pip and the project's sources, not its test extra: a venv of their own.
BUILD_VENV := build/venv
$(BUILD_VENV)/.installed:
	@$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null \
	  || $(MAKE) --no-print-directory deb-deps
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q --upgrade pip
	touch $@

# A .deb for Debian 12 (its python3 3.11): debhelper runs packaging/stage.sh, lintian judges.
deb: deb-deps $(BUILD_VENV)/.installed
	rm -rf build/deb && mkdir -p build/deb/hyperlight-agent
	cp -r $(PKG_SOURCES) build/deb/hyperlight-agent/
	cp -r packaging/debian build/deb/hyperlight-agent/debian
	cd build/deb/hyperlight-agent && PYTHON=$(abspath $(BUILD_VENV)/bin/python) dpkg-buildpackage -b -us -uc >../build.log 2>&1 \
	  || { tail -30 ../build.log; exit 1; }
	lintian --fail-on error,warning --suppress-tags-from-file /dev/null build/deb/*.deb
	@ls -l build/deb/*.deb

# RPMs for the RPM hosts that run Hyperlight, one per target Python: EL9 (3.9) and
# Azure Linux 3 (3.12), the MSHV hosts. rpmlint judges with the project's config.
RPM_TARGETS := el9:3.9 azl3:3.12
rpm: rpm-deps $(BUILD_VENV)/.installed
	rm -rf build/rpm && mkdir -p build/rpm
	set -e; for target in $(RPM_TARGETS); do dist=$${target%%:*}; py=$${target#*:}; \
	  UNITDIR=/usr/lib/systemd/system PYTHON=$(abspath $(BUILD_VENV)/bin/python) \
	    packaging/stage.sh build/rpm/stage-$$dist $$py x86_64; \
	  shlibs=$$(packaging/shlib-requires.sh build/rpm/stage-$$dist | tr '\n' ' '); \
	  rpmbuild -bb --quiet --define "_topdir $(CURDIR)/build/rpm/top" \
	    --define "stagedir $(CURDIR)/build/rpm/stage-$$dist" --define "target_python $$py" \
	    --define "shlib_requires $$shlibs" \
	    --define "dist .$$dist" --define "notice $(CURDIR)/packaging/debian/copyright" \
	    packaging/rpm/hyperlight-agent.spec; \
	done
	rpmlint --config packaging/rpm/rpmlint.toml build/rpm/top/RPMS/*/*.rpm
	@ls -l build/rpm/top/RPMS/*/*.rpm

# The container image, for amd64 and arm64, with the git commit baked in. Needs a container
# engine that can reach the base image's registry (docker buildx, or podman).
IMAGE ?= ghcr.io/hyperlight-dev/hyperlight-agent:dev
GIT_COMMIT := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
image:
	@if docker buildx version >/dev/null 2>&1 && docker info >/dev/null 2>&1; then \
	  docker buildx build --platform linux/amd64,linux/arm64 --build-arg GIT_COMMIT=$(GIT_COMMIT) \
	    -f Containerfile -t $(IMAGE) . ; \
	elif command -v podman >/dev/null 2>&1; then \
	  podman build --platform linux/amd64,linux/arm64 --manifest $(IMAGE) --build-arg GIT_COMMIT=$(GIT_COMMIT) \
	    -f Containerfile . && podman manifest inspect $(IMAGE) | grep digest; \
	else echo "make image: no container engine (docker buildx or podman) found" >&2; exit 1; fi

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
