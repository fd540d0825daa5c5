"""The Kubernetes releases the e2e tests run: the rows of tests/e2e/components/kubernetes (one per
minor, written by pin-kubernetes.sh), each at the version its module's go.mod pins. A row's role
follows from its place: the newest runs the session's cluster, the oldest a whole cluster of its
own and its kubelet under the newest control plane, any other a whole cluster as a smoke."""

from __future__ import annotations

import os
from dataclasses import dataclass

COMPONENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "components")
TABLE = os.path.join(COMPONENTS, "kubernetes")


@dataclass(frozen=True)
class Row:
    minor: int  # 37 for 1.37
    module: str  # the module directory under components/
    components: tuple[str, ...]  # the commands built from it (k8s.io/kubernetes/cmd/…)
    version: str  # what the module pins, e.g. v1.37.2


def pinned(module: str, path: str) -> str:
    """The version of `path` that components/<module>/go.mod requires."""
    with open(os.path.join(COMPONENTS, module, "go.mod")) as f:
        for line in f:
            words = line.split()
            if len(words) >= 3 and words[0] == "require" and words[1] == path:
                return words[2]
            if len(words) >= 2 and words[0] == path and words[1].startswith("v"):
                return words[1]
    raise LookupError(f"{module}/go.mod pins no {path}")


def rows(table: str = TABLE) -> list[Row]:
    """The table's rows, newest first; a row whose module pins another minor than its own is refused."""
    found = []
    with open(table) as f:
        for number, line in enumerate(f, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) < 3 or not words[0].startswith("1."):
                raise ValueError(f"{table}:{number}: want 'MINOR MODULE COMPONENT…', got {line.strip()!r}")
            minor = int(words[0].split(".", 1)[1])
            version = pinned(words[1], "k8s.io/kubernetes")
            if version.split(".")[:2] != ["v1", str(minor)]:
                raise ValueError(f"{table}:{number}: row 1.{minor}'s module {words[1]} pins {version}")
            found.append(Row(minor, words[1], tuple(words[2:]), version))
    if not found:
        raise ValueError(f"{table}: no rows")
    return sorted(found, key=lambda row: row.minor, reverse=True)


def newest() -> Row:
    return rows()[0]


def oldest() -> Row:
    return rows()[-1]


def whole_clusters() -> list[Row]:
    """The rows that run a whole cluster of their own: every one but the newest (whose cluster is
    the session's), oldest first."""
    return list(reversed(rows()[1:]))
