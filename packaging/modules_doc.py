"""Write docs/modules.md's table from the modules' own docstrings (their first paragraph), in the
layers pyproject.toml's import contract puts them, highest first: the docstring is the one home
of what a module is, so the page cannot drift from the code.

python packaging/modules_doc.py       (rewrites the table; tests/test_docs.py checks it)
"""

from __future__ import annotations

import ast
import os
import re
import sys

import settings_doc

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the development venv's Python decides
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "modules.md")
PACKAGE = "hyperlight_agent"


def layers() -> list[list[str]]:
    """The import contract's layers, highest first, each a list of dotted module names."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layered,) = [c for c in contracts if c["type"] == "layers"]
    return [[m.strip() for m in re.split(r"[:|]", layer)] for layer in layered["layers"]]


def summary(module: str) -> str:
    """The first paragraph of the module's docstring, on one line (a package: its __init__'s)."""
    path = os.path.join(ROOT, *module.split("."))
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    if not doc:
        raise SystemExit(f"{path}: no docstring to say what the module is")
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def table() -> str:
    rows = ["| layer | module | what it is |", "|---|---|---|"]
    for number, layer in enumerate(layers(), 1):
        for module in layer:
            shown = module.removeprefix(f"{PACKAGE}.").replace(".", "/")
            if not shown.endswith("_pb2"):
                rows.append(f"| {number} | `{shown}` | {summary(module)} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """The page's text with its table made anew; the rest unchanged."""
    return settings_doc.fill(text, PAGE, "modules-table", table())


def main() -> None:
    settings_doc.rewrite(PAGE, render)


if __name__ == "__main__":
    main()
