"""Write docs/settings.md's settings table from the agent's settings table (config.SETTINGS), its
one home, so the page cannot drift from the code.

python packaging/settings_doc.py       (rewrites the table; tests/test_docs.py checks it)
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyperlight_agent import config

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "settings.md")
# Between the two markers, whole lines: the rest of the page is written by hand.
BLOCK = re.compile(r"(<!-- settings-table:[^\n]*-->\n).*?(\n<!-- end settings-table -->)", re.S)


def render(text: str) -> str:
    """The page's text with its table made the settings table's; the rest unchanged."""
    new, count = BLOCK.subn(lambda m: m.group(1) + config.settings_table() + m.group(2), text)
    if count != 1:
        raise SystemExit(f"{PAGE}: no single settings-table block to write")
    return new


def main() -> None:
    with open(PAGE) as f:
        new = render(f.read())  # before the page is opened for writing: a refusal leaves it whole
    with open(PAGE, "w") as f:
        f.write(new)


if __name__ == "__main__":
    main()
