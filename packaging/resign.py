"""`make resign`: keep a published apt repository fresh: each suite's Release re-dated (Date: now,
Valid-Until: now + release.py's APT_VALID_DAYS) and signed again, InRelease and Release.gpg.

    python packaging/resign.py        (the Makefile passes its settings in the environment)

apt refuses a Release past its Valid-Until, so a mirror frozen at an old release cannot keep
hosts from a fix unnoticed; the price is that the published repository must be re-signed before
it expires: the release workflow's `resign` job does it weekly. Only a Release the same key signed
is re-signed (its current signature is checked first, expired or not), and nothing else in the
repository changes: the package indices it lists keep their hashes.

Settings (environment): SITE (required: the directory `make publish` filled, holding apt/),
RELEASE_GPG_KEY in GNUPGHOME (required: the release key), SOURCE_DATE_EPOCH (the date to write;
default now). A setting missing exits 2; any other failure 1, with one line saying what failed.
"""

from __future__ import annotations

import datetime
import email.utils
import glob
import os
import re
import subprocess
import sys
import tempfile

from publish import ConfigError, PublishError, command, run, signers
from release import APT_VALID_DAYS


def rfc2822(when: datetime.datetime) -> str:
    """The date format of Release files (reprepro's, Debian's): English names, UTC."""
    return email.utils.format_datetime(when.astimezone(datetime.timezone.utc), usegmt=True).replace("GMT", "UTC")


def redate(text: str, now: datetime.datetime, days: int = APT_VALID_DAYS) -> str:
    """The Release text with its Date set to `now` and its Valid-Until to `days` later (added after
    Date when missing); every other line as it was."""
    if not re.search(r"^Date: .*$", text, flags=re.M):
        raise PublishError("Release: no Date field")
    until = f"Valid-Until: {rfc2822(now + datetime.timedelta(days=days))}"
    text = re.sub(r"^Valid-Until: .*\n", "", text, flags=re.M)
    return re.sub(r"^Date: .*$", lambda _: f"Date: {rfc2822(now)}\n{until}", text, count=1, flags=re.M)


def fingerprint(key: str) -> str:
    listing = run("gpg", "--batch", "--with-colons", "--list-secret-keys", key, what=f"gpg: secret key {key}")
    return listing.split("fpr:::::::::", 1)[1][:40]


def resign_suite(suite: str, key: str, now: datetime.datetime) -> None:
    """One dists/<suite>/ directory: its Release checked, re-dated and signed, replaced in place."""
    release = os.path.join(suite, "Release")
    done = subprocess.run(
        ["gpg", "--batch", "--status-fd", "1", "--verify", release + ".gpg", release],
        capture_output=True,
        text=True,
        check=False,
    )
    # gpg exits non-zero for a signature by a key not in the keyring; signers() says which.
    found = signers(done.stdout, release + ".gpg")
    if done.returncode != 0 or found != [key]:
        raise PublishError(f"{release}: not signed by {key} (found: {', '.join(found) or 'no good signature'})")
    with open(release) as f:
        text = redate(f.read(), now)
    staged = tempfile.mkdtemp(prefix=".resign-", dir=suite)
    try:
        new = os.path.join(staged, "Release")
        with open(new, "w") as f:
            f.write(text)
        sign = ["gpg", "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase", "", "--local-user", key]
        run(*sign, "--clearsign", "--output", os.path.join(staged, "InRelease"), new, what="gpg --clearsign")
        run(*sign, "--armor", "--detach-sign", "--output", new + ".gpg", new, what="gpg --detach-sign")
        # InRelease first: apt reads it first, and it carries its own text.
        for name in ("InRelease", "Release.gpg", "Release"):
            os.replace(os.path.join(staged, name), os.path.join(suite, name))
    finally:
        for name in os.listdir(staged):
            os.unlink(os.path.join(staged, name))
        os.rmdir(staged)
    print(f"re-signed {suite}: valid until {rfc2822(now + datetime.timedelta(days=APT_VALID_DAYS))}")


def resign() -> None:
    site = os.environ.get("SITE", "")
    if not site:
        raise ConfigError("SITE is not set: the directory `make publish` filled (make resign SITE=site)")
    key = os.environ.get("RELEASE_GPG_KEY", "")
    if not key:
        raise ConfigError("RELEASE_GPG_KEY is not set: the release key, in GNUPGHOME, signs the Release files")
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    try:
        now = (
            datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
            if epoch
            else datetime.datetime.now(datetime.timezone.utc)
        )
    except ValueError:
        raise ConfigError(f"SOURCE_DATE_EPOCH {epoch!r}: not seconds since 1970") from None
    suites = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(site, "apt", "dists", "*", "Release")))
    if not suites:
        raise PublishError(f"{site}: no apt/dists/*/Release here")
    signer = fingerprint(key)
    for suite in suites:
        resign_suite(suite, signer, now.replace(microsecond=0))


def main() -> int:
    return command("make resign", resign)


if __name__ == "__main__":
    sys.exit(main())
