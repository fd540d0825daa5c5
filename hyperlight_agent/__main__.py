"""The agent's entry points: `python -m hyperlight_agent`, the console script and the packages'
launcher all start here, so the signal handlers come first, before any heavy import (grpc,
asyncio, the settings); signals.py says what each signal means.

Importing this module installs them: the console script's first line is
`from hyperlight_agent.__main__ import main`.
"""

from __future__ import annotations

from hyperlight_agent.host.signals import install_early

install_early()

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this runs first, keep it light
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    from hyperlight_agent.cli import exit_now
    from hyperlight_agent.cli import main as run

    exit_now(run())


if __name__ == "__main__":
    main()
