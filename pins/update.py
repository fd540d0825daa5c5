"""Rewrite the pins from fresh venvs (`make pin-tools`): each tool at the version installed there.

Usage: python pins/update.py DEV_PYTHON JUDGES_PYTHON, where DEV_PYTHON's venv has `.[test]` and
JUDGES_PYTHON's venv has the judges, both installed without pins (so at the newest releases).
Which tools: the `test` extra of pyproject.toml, the DRA client's packages already listed in
pins/dra.txt (from the same venv: `.[test]` brings the runtime dependencies), and the judges already
listed in pins/judges.txt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PINS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PINS)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def header(path: str) -> list[str]:
    """The comment lines at the top of a pin file: they survive a rewrite."""
    with open(path) as f:
        return [line for line in f if line.startswith("#")]


def names(path: str) -> list[str]:
    with open(path) as f:
        return [m.group(0) for line in f if not line.startswith("#") and (m := NAME.match(line))]


def test_extra() -> list[str]:
    """The names in pyproject.toml's `test` extra (requirements on one line each, in a list)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        line = next(line for line in f if line.startswith("test = ["))
    return [m.group(0) for m in (NAME.match(req) for req in re.findall(r'"([^"]+)"', line)) if m]


def dev_tools(dra: list[str]) -> list[str]:
    """The test extra's packages that pins/dev.txt holds: those the DRA client also needs (anyio,
    whose pytest plugin runs the coroutine tests) keep their one pin in pins/dra.txt."""
    return [n for n in test_extra() if n not in dra]


def installed(python: str, tools: list[str]) -> list[str]:
    code = "import importlib.metadata as m, sys\nfor n in sys.argv[1:]: print(n + '==' + m.version(n))"
    out = subprocess.run([python, "-c", code, *tools], check=True, capture_output=True, text=True).stdout
    return sorted(out.split(), key=str.lower)


def render(path: str, python: str, tools: list[str]) -> str:
    """The new content of the pin file at `path`: its header, then each tool as installed for `python`."""
    return "".join(header(path)) + "".join(pin + "\n" for pin in installed(python, tools))


def rewrite(path: str, python: str, tools: list[str]) -> None:
    text = render(path, python, tools)
    with open(path, "w") as f:
        f.write(text)
    print(f"{os.path.relpath(path, ROOT)}:", " ".join(line for line in text.splitlines() if not line.startswith("#")))


def main(dev_python: str, judges_python: str) -> None:
    dra = os.path.join(PINS, "dra.txt")
    rewrite(os.path.join(PINS, "dev.txt"), dev_python, dev_tools(names(dra)))
    rewrite(dra, dev_python, names(dra))
    judges = os.path.join(PINS, "judges.txt")
    rewrite(judges, judges_python, names(judges))


if __name__ == "__main__":
    main(*sys.argv[1:])
