"""The release's signed apt repository on a clean Debian 12 and 13, as an operator uses it:
README.md's own commands (key, `Signed-By:` source line for the host's own release, `apt-get update
&& apt-get install`) run in systemd-nspawn over HTTP from a local server standing for the public
site; on Debian 13 under its own systemd from install to purge; every suite (the Ubuntu ones too)
verified by apt; a tampered or expired Release is refused; and `apt-get upgrade` takes a running
host from release N-1 to N once the site serves N."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from standin.kubelet import StandinThread
from tests import nspawn
from tests.conftest import make_node, wait_for
from tests.releases import CURRENT, DEBS, PREVIOUS, PUBLIC_SITE, ROOT, Published, Site, readme_commands
from tests.test_deb import DOCUMENTED, NOT_OURS, UNIT, agent_starts, our_sockets

pytestmark = pytest.mark.system
BY_SUITE = {t.suite: t for t in DEBS}

# README's commands are interactive (apt-get asks before installing): in the guest, apt assumes yes.
ASSUME_YES = 'APT::Get::Assume-Yes "true";\n'


def fresh_root(tmp: str, suite: str = "bookworm") -> str:
    root = os.path.join(tmp, "root")
    subprocess.run(["cp", "-a", "--reflink=auto", nspawn.rootfs(suite), root], check=True, timeout=300)
    with open(os.path.join(root, "etc", "apt", "apt.conf.d", "90assume-yes"), "w") as f:
        f.write(ASSUME_YES)
    return root


def operator_script(url: str) -> str:
    """README's apt commands, with the local site in place of the public one."""
    script = readme_commands("apt").replace(PUBLIC_SITE, url)
    assert url in script
    return script


def operator_install(root: str, url: str) -> subprocess.CompletedProcess[str]:
    """README's apt commands run in the guest's root."""
    return nspawn.pipe(root, "env", "DEBIAN_FRONTEND=noninteractive", "sh", "-ec", operator_script(url))


def host_binds(tmp: str) -> list[str]:
    """A guest's node: a KVM device node of ours at /dev/kvm, and tmp/kubelet (made here, where the
    stand-in kubelet serves) as the kubelet's device-plugin directory."""
    os.makedirs(os.path.join(tmp, "kubelet"), exist_ok=True)
    kvm = make_node(os.path.join(tmp, "kvm"), 10, 232)
    return [f"{kvm}:/dev/kvm", f"{tmp}/kubelet:/var/lib/kubelet/device-plugins"]


@pytest.fixture
def site(published: Published) -> Iterator[Site]:
    """The public site's stand-in, left serving N-1 (as the session's other tests expect)."""
    assert published.site is not None
    yield published.site
    published.serve(PREVIOUS)


def test_readme_commands_add_the_signed_source_and_install(published: Published, site: Site, tmp: str) -> None:
    published.serve(CURRENT)
    root = fresh_root(tmp)
    done = operator_install(root, site.url)
    assert done.returncode == 0, done.stdout + done.stderr
    sources = nspawn.pipe(root, "cat", "/etc/apt/sources.list.d/hyperlight-agent.list").stdout
    assert re.fullmatch(
        rf"deb \[signed-by=/etc/apt/keyrings/hyperlight-agent\.asc\] {re.escape(site.url)}/apt "
        r"bookworm main\n",
        sources,
    ), sources
    version = nspawn.pipe(root, "dpkg-query", "-W", "-f=${Version}", "hyperlight-agent").stdout
    assert version == BY_SUITE["bookworm"].version(CURRENT)
    policy = nspawn.pipe(root, "apt-cache", "policy", "hyperlight-agent").stdout
    assert f"{site.url}/apt bookworm/main amd64 Packages" in policy, policy


def test_apt_verifies_every_suite_and_each_offers_its_release_s_package(
    published: Published, site: Site, tmp: str
) -> None:
    """Every suite of the one pool (Ubuntu's too, whose userland this machine cannot have) is signed
    and read by apt: a source line per suite, `apt-get update` verifying each InRelease, and each
    suite's candidate is its own target's package."""
    published.serve(CURRENT)
    root = fresh_root(tmp)
    done = operator_install(root, site.url)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = "".join(
        f"deb [arch=amd64 signed-by=/etc/apt/keyrings/hyperlight-agent.asc] {site.url}/apt {t.suite} main\n"
        for t in DEBS
    )
    with open(os.path.join(root, "etc", "apt", "sources.list.d", "hyperlight-agent.list"), "w") as f:
        f.write(lines)
    updated = nspawn.pipe(root, "apt-get", "update", "-q")
    assert updated.returncode == 0 and "W:" not in updated.stdout + updated.stderr, updated.stdout + updated.stderr
    for target in DEBS:
        assert f"{site.url}/apt {target.suite} InRelease" in updated.stdout, updated.stdout
    madison = nspawn.pipe(root, "apt-cache", "madison", "hyperlight-agent").stdout
    offered = {
        line.split("|")[2].split()[1].split("/")[0]: line.split("|")[1].strip()
        for line in madison.splitlines()
        if "|" in line
    }
    assert offered == {t.suite: t.version(CURRENT) for t in DEBS}, madison


def test_a_tampered_release_is_refused(release_current: str, tmp: str) -> None:
    copy = os.path.join(tmp, "site")
    shutil.copytree(os.path.join(release_current, "apt"), os.path.join(copy, "apt"))
    shutil.copy2(os.path.join(release_current, "hyperlight-agent.asc"), copy)
    dists = os.path.join(copy, "apt", "dists", "bookworm")
    for name in ("InRelease", "Release"):  # the signed text changed, the signatures left as they were
        with open(os.path.join(dists, name)) as f:
            text = f.read()
        changed = re.sub(r"^Date: .*$", "Date: Thu, 01 Jan 2099 00:00:00 UTC", text, count=1, flags=re.M)
        assert changed != text
        with open(os.path.join(dists, name), "w") as f:
            f.write(changed)
    served = Site(copy)
    try:
        root = fresh_root(tmp)
        done = operator_install(root, served.url)
        assert done.returncode != 0, done.stdout
        assert (
            "The following signatures were invalid" in done.stdout + done.stderr
            or "BADSIG" in done.stdout + done.stderr
        ), done.stdout + done.stderr
        assert nspawn.pipe(root, "dpkg-query", "-W", "hyperlight-agent").returncode != 0, "installed anyway"
        candidate = nspawn.pipe(root, "apt-cache", "policy", "hyperlight-agent").stdout
        assert "Candidate" not in candidate or "Candidate: (none)" in candidate, candidate
    finally:
        served.close()


@pytest.mark.root
@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_apt_get_upgrade_takes_a_running_host_from_n_minus_1_to_n(
    published: Published, site: Site, tmp: str, suite: str
) -> None:
    """Each Debian this machine can boot, from its own suite of the repository: N-1 running under
    its systemd (252, 257), `apt-get upgrade` to N, N registered."""
    published.serve(PREVIOUS)
    root = fresh_root(tmp, suite)
    done = operator_install(root, site.url)
    assert done.returncode == 0, done.stdout + done.stderr
    with (
        StandinThread(os.path.join(tmp, "kubelet")) as kubelet,
        nspawn.Guest(root, host_binds(tmp), ephemeral=False, private_network=False) as guest,
    ):
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 60, "release N-1 registered")
        assert guest.run("hyperlight-agent", "--version").stdout.strip() == f"hyperlight-agent {PREVIOUS}"

        published.serve(CURRENT)
        upgrade = guest.run(
            "sh",
            "-c",
            "DEBIAN_FRONTEND=noninteractive apt-get update -q && "
            "DEBIAN_FRONTEND=noninteractive apt-get upgrade -y -q </dev/null",
            check=False,
            timeout=600,
        )
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
        assert "hyperlight-agent" in upgrade.stdout
        wait_for(lambda: guest.is_active(UNIT) == "active", 60, "the unit active after the upgrade")
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 60, "release N registered")
        assert guest.run("hyperlight-agent", "--version").stdout.strip() == f"hyperlight-agent {CURRENT}"
        assert agent_starts(guest)[-1] == CURRENT, agent_starts(guest)


def test_an_expired_release_is_refused_and_make_resign_renews_it(
    published: Published, release_current: str, tmp: str
) -> None:
    """The Release carries Valid-Until (30 days): a copy frozen past it is refused by apt, so a
    mirror cannot hold hosts at an old release unnoticed; `make resign` (the release workflow's
    weekly job) re-dates and re-signs it with the release key, and apt takes it again."""
    copy = os.path.join(tmp, "site")
    shutil.copytree(os.path.join(release_current, "apt"), os.path.join(copy, "apt"))
    shutil.copy2(os.path.join(release_current, "hyperlight-agent.asc"), copy)
    builder = published.builder
    # As if last re-signed 40 days ago: expired 10 days ago.
    stale = subprocess.run(
        [sys.executable, os.path.join(ROOT, "packaging", "resign.py")],
        env={**builder.env, "SITE": copy, "SOURCE_DATE_EPOCH": str(int(time.time()) - 40 * 86400)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert stale.returncode == 0, stale.stderr
    served = Site(copy)
    try:
        root = fresh_root(tmp)
        done = operator_install(root, served.url)
        assert done.returncode != 0, done.stdout
        assert "is expired" in done.stdout + done.stderr, done.stdout + done.stderr
        assert nspawn.pipe(root, "dpkg-query", "-W", "hyperlight-agent").returncode != 0, "installed anyway"

        renewed = builder.make("resign", f"SITE={copy}")
        said = re.findall(r"^re-signed \S+/apt/dists/(\w+): valid until .* UTC$", renewed.stdout, re.M)
        assert sorted(said) == sorted(t.suite for t in DEBS), renewed.stdout
        done = operator_install(root, served.url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert nspawn.pipe(root, "dpkg-query", "-W", "-f=${Version}", "hyperlight-agent").stdout == (
            BY_SUITE["bookworm"].version(CURRENT)
        )
    finally:
        served.close()

    # Only what the release key signed is signed again.
    with open(os.path.join(copy, "apt", "dists", "bookworm", "Release"), "a") as f:
        f.write("Suite: stable\n")
    refused = builder.make("resign", f"SITE={copy}", check=False)
    assert refused.returncode != 0 and "make resign: " in refused.stderr and "BADSIG" in refused.stderr, refused.stderr


# The Debian releases whose real userland this machine can debootstrap and boot, beside Debian 12
# (whose package goes through the same and more in tests/test_deb.py, and is upgraded from the
# repository above). Ubuntu's and EL's archives are out of reach: their packages are judged by
# lintian and rpmlint, their trees run by their Python (tests/test_package_trees.py).
BOOTABLE = ("trixie",)
# The systemd each bootable suite ships (its analyzer judges the unit; README's matrix names it).
SYSTEMD = {"bookworm": 252, "trixie": 257}
# What README's commands write (the operator's, not the package's: they stay after a purge).
OPERATOR_FILES = ("/etc/apt/keyrings/hyperlight-agent.asc", "/etc/apt/sources.list.d/hyperlight-agent.list")


@pytest.mark.root
@pytest.mark.parametrize("suite", BOOTABLE)
def test_installed_from_the_repository_under_the_release_s_own_systemd_to_purge(
    published: Published, site: Site, tmp: str, suite: str
) -> None:
    """On a booted Debian of that release (Debian 13: systemd 257, Python 3.13): README's commands
    install its suite's package, the postinst starts the unit, which is active and READY once the
    kubelet registered it; its hardening judged by that systemd's own analyzer; `systemctl reload`
    in place; purge leaves nothing of ours."""
    published.serve(CURRENT)
    target = BY_SUITE[suite]
    root = fresh_root(tmp, suite)
    with (
        StandinThread(os.path.join(tmp, "kubelet")) as kubelet,
        nspawn.Guest(root, host_binds(tmp), ephemeral=False, private_network=False) as guest,
    ):
        guest.settle()  # the boot's last jobs run after multi-user.target: their files come and go
        before = guest.listing()
        release = guest.run("sh", "-c", ". /etc/os-release && echo $VERSION_ID $VERSION_CODENAME").stdout.split()
        assert release == [target.release, suite], release
        python = guest.run("python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
        assert python == target.python
        systemd = guest.run("systemctl", "--version").stdout.split()[:2]
        assert systemd == ["systemd", str(SYSTEMD[suite])], systemd

        started = time.monotonic()
        done = guest.run(
            "env", "DEBIAN_FRONTEND=noninteractive", "sh", "-ec", operator_script(site.url), check=False, timeout=300
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert guest.run("dpkg-query", "-W", "-f=${Version}", "hyperlight-agent").stdout == target.version(CURRENT)
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 60, "the installed agent registered")
        wait_for(lambda: guest.is_active(UNIT) == "active", 30, "the unit active (READY=1)")
        print(f"\n{target.label}: README's install → active: {time.monotonic() - started:.2f} s")
        assert 'Status: "ready: kvm, 2000 slots, 1 stream; version ' in guest.status(UNIT)

        unit = f"{target.unitdir}/{UNIT}"
        verified = guest.run("systemd-analyze", "verify", unit, check=False)
        assert verified.returncode == 0 and not (verified.stdout + verified.stderr).strip(), verified.stderr
        exposure = guest.run("systemd-analyze", "security", "--offline=yes", "--threshold=15", unit, check=False)
        print(f"{target.label}: {exposure.stdout.strip().splitlines()[-1]}")
        assert exposure.returncode == 0, exposure.stdout

        guest.run("sh", "-c", "echo 'device_count = 7' >> /etc/hyperlight-agent/agent.toml")
        guest.run("systemctl", "reload", UNIT)
        kubelet.wait_until(lambda k: k.allocatable() == 7, 15, "7 slots after the reload")
        assert agent_starts(guest) == [CURRENT, CURRENT], "the reload started a new process in place"
        assert guest.run("systemctl", "show", "-P", "NRestarts", UNIT).stdout.strip() == "0"
        assert guest.is_active(UNIT) == "active"

        purged = guest.run(
            "sh", "-c", "DEBIAN_FRONTEND=noninteractive apt-get purge -y -q hyperlight-agent </dev/null", check=False
        )
        assert purged.returncode == 0 and "not empty" not in purged.stdout + purged.stderr, purged.stdout
        wait_for(lambda: our_sockets(tmp) == [], 10, "the plugin socket to go")
        assert guest.run("pgrep", "-f", "hyperlight", check=False).returncode == 1, "a process was left"
        guest.settle()
        after = guest.listing()
    changed = sorted(
        p for p in before ^ after if not p.startswith(NOT_OURS) and p not in DOCUMENTED and p not in OPERATOR_FILES
    )
    assert changed == [], f"install → reload → purge changed: {changed[:20]}"
