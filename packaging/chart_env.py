"""Write the chart's list of the agent's HYPERLIGHT_* names (values.schema.json's agentEnvName,
which extraEnv's names must be one of) from the agent's settings table, its one home.

python packaging/chart_env.py       (rewrites the one line; tests/test_chart_docs.py checks it)
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyperlight_agent import config

SCHEMA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "deploy",
    "helm",
    "hyperlight-agent",
    "values.schema.json",
)
# The line holding the list, whole: the rest of the file is written by hand.
LINE = re.compile(r'^(\s*"agentEnvName": \{"enum": )\[[^\]]*\](.*)$', re.M)


def names() -> list[str]:
    """Every HYPERLIGHT_* name the settings table (docs/settings.md) gives: each setting's, and the file's. Not
    the prefixed twins of the five unprefixed names (HYPERLIGHT_DEVICE_COUNT …): the chart sets
    those settings under their unprefixed names (deviceCount …), and a twin with another value is
    refused by the agent at start; extraEnv overrides them by the chart's own names."""
    table = [s.env for s in config.SETTINGS] + [config.CONFIG_ENV]
    return sorted(n for n in table if n.startswith(config.ENV_PREFIX))


def render(text: str) -> str:
    """The schema's text with its list made `names()`; the rest unchanged."""
    new, count = LINE.subn(lambda m: m.group(1) + json.dumps(names()) + m.group(2), text)
    if count != 1:
        raise SystemExit(f"{SCHEMA}: no single agentEnvName line to write")
    return new


def main() -> None:
    with open(SCHEMA) as f:
        text = f.read()
    with open(SCHEMA, "w") as f:
        f.write(render(text))


if __name__ == "__main__":
    main()
