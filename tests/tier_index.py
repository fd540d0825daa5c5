"""The tests by tier, as docs/testing.md lists them: which modules `make check` runs (the fast
tier) and which only `make test` does, from pytest's own collection and the tiers conftest.py
gives each test (the ones `make test`'s phases add up).

    python -m tests.tier_index            print the table
    python -m tests.tier_index --write    write it into docs/testing.md, between its markers

The modules stay flat in tests/ (a unit test is named for the module it tests: tests/test_<package
path>.py); this table is where a newcomer sees the layers of the proof.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "testing.md")
BEGIN = "<!-- tiers: written by `python -m tests.tier_index --write` -->"
END = "<!-- end of tiers -->"
# The tiers in the order a change meets them: make check's first, the real clusters last.
ORDER = (
    "fast (make check's)",
    "root",
    "system",
    "manifest judges",
    "releases and what is installed from them",
    "real clusters (e2e)",
)


class _Tiers:
    """A pytest plugin: each collected test's module and tier (conftest.tier)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from tests.conftest import tier

        for item in session.items:
            by_tier = self.counts.setdefault(item.nodeid.split("::", 1)[0], {})
            name = tier(item)
            by_tier[name] = by_tier.get(name, 0) + 1


def collected() -> dict[str, dict[str, int]]:
    """module → tier → tests, from a collection of the whole suite in this process."""
    tiers = _Tiers()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[tiers])
    if code != 0:
        raise SystemExit(f"tests.tier_index: pytest's collection failed ({code})")
    return tiers.counts


def render(counts: dict[str, dict[str, int]]) -> str:
    """The table: a row per module, in tier order (a module's first tier), with its tests per tier."""
    header = "| module | " + " | ".join(ORDER) + " |\n|---|" + "---:|" * len(ORDER) + "\n"
    totals = [sum(c.get(t, 0) for c in counts.values()) for t in ORDER]

    def first_tier(module: str) -> tuple[int, str]:
        return min(ORDER.index(t) for t in counts[module]), module

    rows = [
        f"| `{module}` | " + " | ".join(str(counts[module].get(t, "")) for t in ORDER) + " |"
        for module in sorted(counts, key=first_tier)
    ]
    return header + "\n".join(rows) + "\n| all | " + " | ".join(str(n) for n in totals) + " |\n"


def replaced(page: str, table: str) -> str:
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n\n" + table + "\n" + page[end:]


def main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):  # pytest's own lines: not the table
        table = render(collected())
    if "--write" not in argv:
        sys.stdout.write(table)
        return 0
    with open(PAGE) as f:
        page = f.read()
    with open(PAGE + ".tmp", "w") as f:
        f.write(replaced(page, table))
    os.replace(PAGE + ".tmp", PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
