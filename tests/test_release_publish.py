"""What `make publish` accepts as a release (packaging/publish.py's checks), with real gpg keys on
a small release directory: only one signed by the configured release key, never one signed with
a key made for its build, nor one re-signed by another key, whatever key it carries."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.releases import Keyring, packaging_module, resign

pytestmark = pytest.mark.system


publish = packaging_module("publish")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Keyring, Keyring]]:
    """The release key, and another (a build's throwaway key, or anyone's)."""
    project = Keyring(str(tmp_path_factory.mktemp("project")), "ed25519", "release")
    other = Keyring(str(tmp_path_factory.mktemp("other")), "ed25519", "throwaway")
    yield project, other
    project.close()
    other.close()


def release(directory: str) -> str:
    out = os.path.join(directory, "9.9.9")
    os.makedirs(os.path.join(out, "apt"))
    for name, data in (("hyperlight-agent_9.9.9_amd64.deb", b"deb"), ("apt/Release", b"Origin: x\n")):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    with open(os.path.join(out, "release.json"), "w") as f:
        json.dump({"version": "9.9.9"}, f)
    return out


def refusal(out: str, fingerprint: str) -> str:
    with pytest.raises(publish.PublishError) as refused:
        publish.verify_release(out, fingerprint)
    return str(refused.value)


def test_a_release_signed_by_the_release_key_is_accepted(keys: tuple[Keyring, Keyring], tmp: str) -> None:
    project, _ = keys
    out = release(tmp)
    resign(out, project, [project], ephemeral=False)
    assert publish.verify_release(out, project.fingerprint)["version"] == "9.9.9"


def test_a_release_signed_with_its_build_s_own_key_is_refused(keys: tuple[Keyring, Keyring], tmp: str) -> None:
    project, throwaway = keys
    out = release(tmp)
    resign(out, throwaway, [throwaway], ephemeral=True)
    # Even where the fingerprint was taken from the release itself.
    for fingerprint in (project.fingerprint, throwaway.fingerprint):
        assert "signed with a key made for that build only" in refusal(out, fingerprint)


def test_a_release_re_signed_by_another_key_is_refused(keys: tuple[Keyring, Keyring], tmp: str) -> None:
    project, other = keys
    out = release(tmp)
    # Carrying the other key (its signature verifies against what it carries).
    resign(out, other, [other], ephemeral=False)
    assert refusal(out, project.fingerprint) == (
        f"SHA256SUMS.asc: signed by {other.fingerprint}, not by the release key {project.fingerprint}"
    )
    # Carrying the release key: the signature cannot even be checked.
    resign(out, other, [project], ephemeral=False)
    assert refusal(out, project.fingerprint).startswith(f"SHA256SUMS.asc: ERRSIG {other.fingerprint[-16:]}: ")
    # Signed by the release key, but carrying another key beside it, which users would trust too.
    resign(out, project, [project, other], ephemeral=False)
    assert refusal(out, project.fingerprint) == (
        f"hyperlight-agent.asc: holds {project.fingerprint}, {other.fingerprint}, "
        f"not only the release key {project.fingerprint}"
    )


def test_a_changed_listed_or_unlisted_file_is_refused(keys: tuple[Keyring, Keyring], tmp: str) -> None:
    project, _ = keys
    out = release(tmp)
    resign(out, project, [project], ephemeral=False)
    with open(os.path.join(out, "SHA256SUMS"), "a") as f:
        f.write("0" * 64 + "  extra\n")
    assert refusal(out, project.fingerprint).startswith(f"SHA256SUMS.asc: BADSIG {project.fingerprint[-16:]}: ")
    resign(out, project, [project], ephemeral=False)
    with open(os.path.join(out, "apt", "Release"), "a") as f:
        f.write("Valid-Until: never\n")
    assert refusal(out, project.fingerprint) == "apt/Release: its SHA-256 is not the one SHA256SUMS lists"
    resign(out, project, [project], ephemeral=False)
    with open(os.path.join(out, "apt", "InRelease"), "w") as f:
        f.write("added\n")
    assert refusal(out, project.fingerprint) == "apt/InRelease: in the release but not in SHA256SUMS"
