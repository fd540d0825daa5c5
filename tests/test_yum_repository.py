"""The release's signed yum repositories (one per RPM target: el9, el10, azl3), read by a real yum
client: Debian's dnf, over HTTP from a local server as from the public site, with gpgcheck=1 and
repo_gpgcheck=1. The RPMs pass `rpm -K`, dnf installs the EL9 and EL10 ones (into a scratch root
whose rpm database holds a stand-in providing what the distribution itself would: its Python,
systemd, glibc's libraries), and a tampered repomd.xml is refused."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.releases import CURRENT, PUBLIC_SITE, RPMS, Site, manifest, readme_commands

pytestmark = pytest.mark.system

KEY = "hyperlight-agent.asc"
# Each RPM target (packaging/targets) by its tag, which names its repository (yum/<tag>).
TARGETS = {t.tag: t for t in RPMS}


def repo_file(url: str, dist: str) -> str:
    """The .repo file README.md has users write into /etc/yum.repos.d, with the local site in place
    of the public one (and the Azure Linux repository for azl3, as README says)."""
    commands = readme_commands("yum")
    text = commands.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0] + "\n"
    assert "gpgcheck=1\n" in text and "repo_gpgcheck=1\n" in text and PUBLIC_SITE in text
    return text.replace(PUBLIC_SITE, url).replace("/yum/el9/", f"/yum/{dist}/")


def dnf(root: str, *args: str, check: bool = True, release: str = "9") -> subprocess.CompletedProcess[str]:
    # Everything dnf keeps (its cache, the keyrings repo_gpgcheck imports) inside the scratch root.
    done = subprocess.run(
        [
            "dnf",
            "-y",
            "--installroot",
            root,
            "--releasever",
            release,
            "--forcearch",
            "x86_64",
            "--setopt",
            f"reposdir={root}/etc/yum.repos.d",
            "--setopt",
            f"cachedir={root}/var/cache/dnf",
            "--setopt",
            "install_weak_deps=False",
            "--noplugins",
            # EL9's default (Debian's dnf skips a repository it cannot verify, with a warning).
            "--setopt",
            "skip_if_unavailable=False",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def scratch_root(directory: str, url: str, dist: str) -> str:
    root = os.path.join(directory, f"root-{dist}")
    os.makedirs(os.path.join(root, "etc", "yum.repos.d"))
    with open(os.path.join(root, "etc", "yum.repos.d", "hyperlight-agent.repo"), "w") as f:
        f.write(repo_file(url, dist))
    return root


def stand_in_for_the_distribution(rpm: str, directory: str) -> str:
    """An RPM providing every capability the package requires (but rpm's own): what EL9's base
    packages would provide, so dnf's solver has them installed."""
    requires = subprocess.run(
        ["rpm", "-qp", "--requires", rpm], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    provides = sorted({r for r in requires if not r.startswith("rpmlib(")})
    spec = os.path.join(directory, "base.spec")
    with open(spec, "w") as f:
        f.write(
            "Name: base-stand-in\nVersion: 1\nRelease: 1\nSummary: stand-in\nLicense: none\n"
            "BuildArch: noarch\n" + "".join(f"Provides: {p}\n" for p in provides) + "%description\nstand-in\n%files\n"
        )
    subprocess.run(
        ["rpmbuild", "-bb", "--quiet", "--define", f"_topdir {directory}/top", spec],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return os.path.join(directory, "top", "RPMS", "noarch", "base-stand-in-1-1.noarch.rpm")


@pytest.fixture(autouse=True)
def no_agent_left(tmp: str) -> Iterator[None]:
    """librepo verifies repomd.xml with gpgme, whose gpg-agent (one per repository keyring, under
    our scratch root's cache) would outlive dnf: ended here, by the keyring path that is ours."""
    yield
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"gpg-agent", b"--homedir"] and argv[2].startswith(tmp.encode() + b"/"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGTERM)


@pytest.fixture
def site(release_current: str) -> Iterator[Site]:
    """The release's directory on a web server, as the public site serves the newest release."""
    served = Site(release_current)
    yield served
    served.close()


def test_rpms_pass_rpm_k_with_the_release_key(release_current: str, tmp: str) -> None:
    m = manifest(release_current)
    db = os.path.join(tmp, "rpmdb")
    os.makedirs(db)
    for dist in TARGETS:
        rpm = os.path.join(release_current, m["packages"][dist])
        unknown = subprocess.run(
            ["rpm", "--dbpath", db, "-K", rpm], capture_output=True, text=True, timeout=60, check=False
        )
        # Signed, by a key this rpm database does not trust yet.
        assert unknown.returncode != 0 and "digests SIGNATURES NOT OK" in unknown.stdout, unknown.stdout
    subprocess.run(["rpm", "--dbpath", db, "--import", os.path.join(release_current, KEY)], check=True, timeout=60)
    for dist in TARGETS:
        rpm = os.path.join(release_current, m["packages"][dist])
        checked = subprocess.run(
            ["rpm", "--dbpath", db, "-K", rpm], capture_output=True, text=True, timeout=60, check=False
        )
        assert checked.returncode == 0 and checked.stdout.strip().endswith("digests signatures OK"), checked.stdout
        key_id = m["signing_key"][-8:].lower()
        info = subprocess.run(
            ["rpm", "--dbpath", db, "-qp", "--qf", "%{RSAHEADER:pgpsig}", rpm],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert key_id in info.lower(), info


@pytest.mark.parametrize("dist", list(TARGETS))
def test_dnf_reads_the_signed_repository(release_current: str, site: Site, tmp: str, dist: str) -> None:
    assert manifest(release_current)["repositories"]["yum"] == [t.suite for t in RPMS]
    root = scratch_root(tmp, site.url, dist)
    dnf(root, "makecache", release=TARGETS[dist].release)
    found = dnf(
        root,
        "repoquery",
        "--qf",
        "%{name} %{version} %{release} %{arch}",
        "hyperlight-agent",
        release=TARGETS[dist].release,
    ).stdout
    assert f"hyperlight-agent {CURRENT} 1.{dist} x86_64" in found, found


@pytest.mark.root
@pytest.mark.parametrize("dist", ["el9", "el10"])
def test_dnf_installs_the_el_package_with_gpgcheck(release_current: str, site: Site, tmp: str, dist: str) -> None:
    root = scratch_root(tmp, site.url, dist)
    rpm = os.path.join(release_current, manifest(release_current)["packages"][dist])
    base = stand_in_for_the_distribution(rpm, tmp)
    subprocess.run(["rpm", "--root", root, "-i", "--nodeps", base], check=True, capture_output=True, timeout=120)
    # No scriptlets: they run the distribution's systemctl, which this scratch root has not.
    dnf(root, "--setopt", "tsflags=noscripts", "install", "hyperlight-agent", release=TARGETS[dist].release)
    installed = subprocess.run(
        ["rpm", "--root", root, "-q", "--qf", "%{version}-%{release} %{RSAHEADER:pgpsig}", "hyperlight-agent"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert re.match(rf"{re.escape(CURRENT)}-1\.{dist} RSA/SHA(256|512), ", installed), installed
    assert os.path.exists(os.path.join(root, "usr", "bin", "hyperlight-agent"))


def test_a_tampered_repomd_xml_is_refused(release_current: str, tmp: str) -> None:
    copy = os.path.join(tmp, "site")
    shutil.copytree(os.path.join(release_current, "yum"), os.path.join(copy, "yum"))
    shutil.copy2(os.path.join(release_current, KEY), copy)
    repomd = os.path.join(copy, "yum", "el9", "x86_64", "repodata", "repomd.xml")
    with open(repomd) as f:
        text = f.read()
    with open(repomd, "w") as f:
        f.write(text.replace("<revision>", "<revision>1", 1))  # the signature stays the original's
    served = Site(copy)
    try:
        root = scratch_root(tmp, served.url, "el9")
        refused = dnf(root, "makecache", check=False)
        assert refused.returncode != 0, refused.stdout
        assert "repomd.xml GPG signature verification error" in refused.stderr, refused.stderr
        found = dnf(root, "repoquery", "hyperlight-agent", check=False)
        assert f"hyperlight-agent-0:{CURRENT}" not in found.stdout
    finally:
        served.close()
