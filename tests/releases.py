"""Releases as `make release` builds them, and the servers users install them from, for the tests.

Two releases of this commit, each built once per test session: N-1, the tree's own version, and
N, the next patch version (`make release VERSION=…`, the tree untouched), signed with a key made
for the session. N is built for every target; N-1 for what the upgrade tests install of it
(`PREVIOUS_TARGETS`: the Debian 12 and 13 packages), with its image and chart. The image is built from
`make image-base`'s Debian 13 (no registry is reachable here), in podman storage of the session's
own. Served as users get them: the package repositories over HTTP (`Site`), the image and the
chart from a real OCI registry (`Registry`, the CNCF distribution registry built from its pinned
Go module)."""

from __future__ import annotations

import functools
import hashlib
import http.client
import http.server
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from types import ModuleType
from typing import Any, Optional, Sequence

from hyperlight_agent import __version__
from tests.e2e.tools import tool
from tests.locks import locked, shared_build_tree
from tests.podman import Podman

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "localhost/hyperlight-agent-base:trixie"
# Where the release's chart says its image lives; the tests' registry serves as its mirror.
IMAGE_REPOSITORY = "ghcr.io/hyperlight-dev/hyperlight-agent"
EXAMPLE_REPOSITORY = "ghcr.io/hyperlight-dev/hyperlight-example"
PUBLIC_REGISTRY = "ghcr.io/hyperlight-dev"


def packaging_module(name: str) -> ModuleType:
    """A script of packaging/ (release, publish, resign) as a module: they import one another by
    name, as they do when run from there."""
    directory = os.path.join(ROOT, "packaging")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module(name)


# The host targets (packaging/targets: one row each), as `make release` and the Makefile read them.
TARGETS: tuple[Any, ...] = packaging_module("targets").TARGETS
DEBS = tuple(t for t in TARGETS if t.format == "deb")
RPMS = tuple(t for t in TARGETS if t.format == "rpm")


def image_python() -> str:
    """The image's Python (the Makefile's IMAGE_PYTHON, its base's python3)."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        found = re.search(r"^IMAGE_PYTHON \?= (\S+)$", f.read(), re.M)
    assert found
    return found.group(1)


def next_version(version: str) -> str:
    major, minor, patch = version.split(".")
    return f"{major}.{minor}.{int(patch) + 1}"


PREVIOUS = __version__
CURRENT = next_version(__version__)
# What N-1 is built for: the package the upgrade tests (apt, the e2e host node) install before N.
PREVIOUS_TARGETS = ("deb12", "deb13")


class Keyring:
    """A GnuPG home with one signing key, made for a test session (as the release pipeline's
    secret key would be imported), or for a test (another key, a build's throwaway key)."""

    def __init__(
        self, directory: str, algorithm: str = "rsa3072", name: str = "test release", make: bool = True
    ) -> None:
        self.home = os.path.join(directory, "gnupg")
        self.env = {**os.environ, "GNUPGHOME": self.home}
        if make:
            self._make(algorithm, name)
        listing = subprocess.run(
            ["gpg", "--batch", "--with-colons", "--list-secret-keys"],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        self.fingerprint = listing.split("fpr:::::::::", 1)[1][:40]

    @classmethod
    def existing(cls, directory: str) -> Keyring:
        """The key another of the session's processes made in directory."""
        return cls(directory, make=False)

    def _make(self, algorithm: str, name: str) -> None:
        os.makedirs(self.home, mode=0o700)
        subprocess.run(
            [
                "gpg",
                "--batch",
                "--passphrase",
                "",
                "--quick-gen-key",
                f"hyperlight-agent {name} <release@hyperlight.invalid>",
                algorithm,
                "sign",
                "never",
            ],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def gpg(self, *args: str) -> bytes:
        return subprocess.run(
            ["gpg", "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase", "", *args],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout

    def public_key(self) -> bytes:
        return self.gpg("--armor", "--export", self.fingerprint)

    def sign(self, path: str) -> None:
        """A detached armored signature, path.asc, as `make release` signs SHA256SUMS."""
        self.gpg("--local-user", self.fingerprint, "--armor", "--detach-sign", "--output", path + ".asc", path)

    def close(self) -> None:
        subprocess.run(
            ["gpgconf", "--homedir", self.home, "--kill", "gpg-agent"], check=False, capture_output=True, timeout=30
        )


def resign(release: str, signer: Keyring, carried: Sequence[Keyring], ephemeral: bool) -> None:
    """Make a release directory look signed by `signer` (release.json's signing_key and
    signing_key_ephemeral) with hyperlight-agent.asc holding the keys of `carried`, its
    SHA256SUMS computed anew and signed by `signer`: as `make release` would have made it."""
    path = os.path.join(release, "release.json")
    found = manifest(release)
    found.update(signing_key=signer.fingerprint, signing_key_ephemeral=ephemeral)
    with open(path, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)
    with open(os.path.join(release, "hyperlight-agent.asc"), "wb") as f:
        f.write(b"".join(k.public_key() for k in carried))
    lines = []
    for directory, _, names in sorted(os.walk(release)):
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(directory, name), release)
            if rel not in ("SHA256SUMS", "SHA256SUMS.asc"):
                with open(os.path.join(directory, name), "rb") as g:
                    lines.append(f"{hashlib.sha256(g.read()).hexdigest()}  {rel}\n")
    with open(os.path.join(release, "SHA256SUMS"), "w") as f:
        f.writelines(lines)
    signer.sign(os.path.join(release, "SHA256SUMS"))


class Builder:
    """`make release` into a directory of the session's, with its key and podman storage.

    The session's processes (`make test`'s pytest workers) share one: the first to open the
    directory makes the key, the first to ask for a release builds it, and the others wait for
    that build (the directory's lock) and read what it made; nothing is built twice."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        with locked(os.path.join(directory, ".lock")):
            if os.path.isdir(os.path.join(directory, "gnupg")):
                self.keyring = Keyring.existing(directory)
            else:
                self.keyring = Keyring(directory)
            os.makedirs(os.path.join(directory, "podman"), exist_ok=True)
            self.engine = Podman(os.path.join(directory, "podman"))
        self.env = {
            **self.engine.env,
            **{k: v for k, v in self.keyring.env.items() if k == "GNUPGHOME"},
            "RELEASE_GPG_KEY": self.keyring.fingerprint,
            "MAKEFLAGS": "",
        }
        # What each `make release` printed, by version (its listing of suites and repositories).
        self.outputs: dict[str, str] = {}

    def make(self, *args: str, timeout: float = 3600, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["make", "-s", "-C", ROOT, *args, f"ENGINE={' '.join(self.engine.argv)}"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check:
            assert done.returncode == 0, f"make {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def release(self, version: str, dist: Optional[str] = None, targets: Sequence[str] = ()) -> str:
        """`make release` of version into dist (default the session's), of the rows `targets`
        names (default all: TARGETS=); built once, whichever of the session's processes asks."""
        dist = dist or os.path.join(self.directory, "dist")
        said = os.path.join(dist, f".{version}.made")  # what make printed, once the release is whole
        with locked(os.path.join(self.directory, ".lock")):
            if not os.path.exists(said):
                with shared_build_tree():
                    if not os.path.exists(os.path.join(self.directory, ".base.made")):
                        self.make("image-base")
                        open(os.path.join(self.directory, ".base.made"), "w").close()
                    done = self.make(
                        "release",
                        f"VERSION={version}",
                        f"DIST={dist}",
                        f"BASE_IMAGE={BASE}",
                        f"TARGETS={' '.join(targets)}",
                    )
                with open(said + ".new", "w") as f:
                    f.write(done.stdout)
                os.replace(said + ".new", said)
            with open(said) as f:
                self.outputs.setdefault(version, f.read())
        return os.path.join(dist, version)

    def close(self) -> None:
        self.engine.close()
        # gpg started an agent for the key's home: it ends with us, not minutes after the directory.
        self.keyring.close()


def manifest(release: str) -> dict[str, Any]:
    with open(os.path.join(release, "release.json")) as f:
        found: dict[str, Any] = json.load(f)
    return found


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the test output stays readable
        pass

    def send_head(self) -> Any:
        # Always the file itself: with one-second file times, a release published in the same
        # second as the one before it would be answered "304 Not Modified".
        del self.headers["If-Modified-Since"]
        return super().send_head()


class Site:
    """A static web host on 127.0.0.1 for a directory, as the public package site would be."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        handler = functools.partial(_Handler, directory=directory)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """The CNCF distribution registry (build/tools/registry), plain HTTP on 127.0.0.1, storage in
    a temp dir; deletes allowed so a test can replace a tag's manifest."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="hl-registry-")
        self._log = open(os.path.join(self.directory, "registry.log"), "wb")  # noqa: SIM115 (closed in close())
        # A free port can be taken by another process before the registry binds it: then it
        # exits saying so, and it starts again on another.
        for _ in range(5):
            self.port = free_port()
            self.host = f"127.0.0.1:{self.port}"
            config = os.path.join(self.directory, "config.yml")
            with open(config, "w") as f:
                f.write(
                    f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: "
                    f"{self.directory}/data\n  delete:\n    enabled: true\nhttp:\n  addr: {self.host}\n"
                )
            self.process = subprocess.Popen(
                [tool("registry"), "serve", config],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            from tests.conftest import wait_for

            if wait_for(self._up, 30, "the registry to listen") == "up":
                return
        raise AssertionError(f"the registry found no free port: {self._log_tail()}")

    def _log_tail(self) -> str:
        with open(os.path.join(self.directory, "registry.log")) as f:
            return f.read()[-2000:]

    def _up(self) -> str:
        """ "up" once this registry answers (its API's version header: not whatever else may
        listen there), "taken" if it exited for want of its port, "" while it is starting."""
        if self.process.poll() is not None:
            if "address already in use" in self._log_tail():
                return "taken"
            raise AssertionError(f"the registry exited: {self._log_tail()}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/v2/")
            answer = conn.getresponse()
            answer.read()
        except OSError:
            return ""
        finally:
            conn.close()
        return "up" if answer.getheader("Docker-Distribution-Api-Version") == "registry/2.0" else ""

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class Published:
    """Both releases published by `make publish`: the image and chart of each in `registry` (a
    mirror of the public registry: the chart's image names ghcr.io), signed with a cosign key pair
    made here (`cosign_pub`); each one's package repositories in a site directory of its own,
    served at `site.url` from the directory the link `served` points at (`serve(version)`: as the
    public site changes when a release is published)."""

    def __init__(self, builder: Builder, previous: str, current: str) -> None:
        self.builder = builder
        self.releases = {manifest(r)["version"]: r for r in (previous, current)}
        self.directory = tempfile.mkdtemp(prefix="hl-pub-")
        self.registry: Optional[Registry] = None
        self.site: Optional[Site] = None
        try:
            keys = os.path.join(self.directory, "cosign")
            os.makedirs(keys)
            subprocess.run(
                [tool("cosign"), "generate-key-pair"],
                cwd=keys,
                check=True,
                capture_output=True,
                env={**os.environ, "COSIGN_PASSWORD": ""},
                timeout=60,
            )
            self.cosign_key, self.cosign_pub = os.path.join(keys, "cosign.key"), os.path.join(keys, "cosign.pub")
            self.registry = Registry()
            self.host = self.registry.host
            for version, release in self.releases.items():
                self.publish(release, os.path.join(self.directory, f"site-{version}"))
            self.served = os.path.join(self.directory, "served")
            self.serve(PREVIOUS)
            self.site = Site(self.served)
        except BaseException:
            self.close()
            raise

    def publish(
        self, release: str, site: str, namespace: str = "hyperlight-dev", fingerprint: str = "", check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`make publish` of a release into REGISTRY=<the registry>/namespace, with the session's
        release key (or `fingerprint`) as the configured one."""
        self.builder.env["COSIGN_PASSWORD"] = ""
        return self.builder.make(
            "publish",
            f"VERSION={manifest(release)['version']}",
            f"DIST={os.path.dirname(release)}",
            f"REGISTRY={self.host}/{namespace}",
            "INSECURE_REGISTRY=1",
            f"COSIGN_KEY={self.cosign_key}",
            f"SITE={site}",
            f"RELEASE_GPG_FINGERPRINT={fingerprint or self.builder.keyring.fingerprint}",
            check=check,
        )

    def repositories(self) -> list[str]:
        """Every repository the registry holds (its catalog)."""
        with urllib.request.urlopen(f"http://{self.host}/v2/_catalog", timeout=30) as response:
            found: list[str] = json.load(response)["repositories"]
        return found

    def serve(self, version: str) -> None:
        """Point the site at this release's repositories (a link swapped atomically)."""
        link = self.served + ".new"
        os.symlink(os.path.join(self.directory, f"site-{version}"), link)
        os.replace(link, self.served)

    def image(self, version: str) -> str:
        """This release's image in the test registry, by digest."""
        return f"{self.host}/hyperlight-dev/hyperlight-agent@{manifest(self.releases[version])['image']['digest']}"

    def example(self, version: str) -> str:
        """This release's image of the Hyperlight example in the test registry, by digest."""
        return f"{self.host}/hyperlight-dev/hyperlight-example@{manifest(self.releases[version])['example']['digest']}"

    def chart(self) -> str:
        return f"oci://{self.host}/hyperlight-dev/charts/hyperlight-agent"

    def close(self) -> None:
        if self.site is not None:
            self.site.close()
        if self.registry is not None:
            self.registry.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Published:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The public channels as README.md gives them to operators; the tests run README's own commands
# with these replaced by the local servers' addresses.
PUBLIC_SITE = "https://hyperlight-dev.github.io/hyperlight-agent"
PUBLIC_CHARTS = "oci://ghcr.io/hyperlight-dev/charts"


def readme_commands(marker: str) -> str:
    """The ```sh block after `<!-- operator: MARKER -->` in README.md, exactly as written there."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    after = text.split(f"<!-- operator: {marker} -->", 1)[1]
    return after.split("```sh\n", 1)[1].split("```", 1)[0]
