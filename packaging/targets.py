"""The host targets (packaging/targets, one row each), for `make release` and the tests; the
Makefile reads the same table with awk.

    >>> [t.tag for t in TARGETS if t.format == "rpm"]
    ['el9', 'el10', 'azl3']
    >>> BY_TAG["deb13"].label, BY_TAG["deb13"].suite, BY_TAG["deb13"].python
    ('Debian 13', 'trixie', '3.13')

Why: docs/decisions/host-targets-are-rows.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
LABELS = {"debian": "Debian {}", "ubuntu": "Ubuntu {}", "el": "EL{}", "azurelinux": "Azure Linux {}"}


@dataclass(frozen=True)
class Target:
    tag: str
    format: str
    distribution: str
    release: str
    suite: str
    python: str
    unitdir: str
    requires: tuple[str, ...]

    @property
    def label(self) -> str:
        """How people name it: "Debian 13", "Azure Linux 3"."""
        return LABELS[self.distribution].format(self.release)

    def version(self, version: str) -> str:
        """The package's version: a .deb's carries the tag (one apt pool holds every target's
        package, each its own file), an .rpm's dist tag is in its release field instead."""
        return f"{version}+{self.tag}" if self.format == "deb" else version

    def package(self, version: str) -> str:
        """The file `make deb`/`make rpm` writes for this target."""
        if self.format == "deb":
            return f"hyperlight-agent_{self.version(version)}_amd64.deb"
        return f"hyperlight-agent-{version}-1.{self.tag}.x86_64.rpm"


def load(path: str = TABLE) -> tuple[Target, ...]:
    rows = []
    with open(path) as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if fields:
                tag, format, distribution, release, suite, python, unitdir, requires = fields
                rows.append(
                    Target(tag, format, distribution, release, suite, python, unitdir, tuple(requires.split(",")))
                )
    return tuple(rows)


TARGETS = load()
BY_TAG = {t.tag: t for t in TARGETS}
