"""Write docs/settings.md's settings table from the agent's settings table (config.SETTINGS), its
one home, so the page cannot drift from the code.

python packaging/settings_doc.py       (rewrites the table; tests/test_docs.py checks it)
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyperlight_agent import config

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "settings.md")


def fill(text: str, page: str, name: str, table: str) -> str:
    """text with the lines between `<!-- name: … -->` and `<!-- end name -->` made `table`; the
    rest, written by hand, unchanged. (docs/modules.md's table is written the same way.)"""
    block = re.compile(rf"(<!-- {name}:[^\n]*-->\n).*?(\n<!-- end {name} -->)", re.S)
    new, count = block.subn(lambda m: m.group(1) + table + m.group(2), text)
    if count != 1:
        raise SystemExit(f"{page}: no single {name} block to write")
    return new


def rewrite(page: str, render: Callable[[str], str]) -> None:
    """The page made render(its text); rendered before it is opened for writing, so a refusal
    leaves it whole."""
    with open(page) as f:
        new = render(f.read())
    with open(page, "w") as f:
        f.write(new)


def render(text: str) -> str:
    """The page's text with its table made the settings table's; the rest unchanged."""
    return fill(text, PAGE, "settings-table", config.settings_table())


def main() -> None:
    rewrite(PAGE, render)


if __name__ == "__main__":
    main()
