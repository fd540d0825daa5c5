"""Signals from the first line: every entry point installs the handlers before anything heavy is
imported, and a signal that arrived early is acted on once the event loop takes over."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hyperlight_agent.host import signals
from tests.test_docs import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the hosts' older Pythons
    import tomli as tomllib

# Imported only after our handlers must be in place: each takes tens of milliseconds.
HEAVY = ("argparse", "asyncio", "grpc", "hyperlight_agent.cli", "hyperlight_agent.config")
# Runs an entry point with --version and says, at the first heavy import, what SIGTERM's handler
# was then.
PROBE = """
import signal, sys
seen = []
def hook(event, args):
    if event == "import" and args[0] in {heavy!r} and not seen:
        seen.append(args[0])
        handler = signal.getsignal(signal.SIGTERM)
        sys.stderr.write("first heavy import: %s, SIGTERM: %s\\n" % (args[0], getattr(handler, "__name__", handler)))
sys.addaudithook(hook)
sys.argv = ["hyperlight-agent", "--version"]
{entry}
"""


def console_script() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        module, function = tomllib.load(f)["project"]["scripts"]["hyperlight-agent"].split(":")
    return f"import importlib; getattr(importlib.import_module({module!r}), {function!r})()"


ENTRIES = {
    "console script": console_script(),
    "python -m": "import runpy; runpy.run_module('hyperlight_agent', run_name='__main__')",
    "package launcher": f"import runpy; runpy.run_path({os.path.join(ROOT, 'packaging', 'hyperlight-agent')!r}, "
    "run_name='__main__')",
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_entry_point_handles_signals_before_any_heavy_import(entry: str) -> None:
    """A SIGTERM or SIGHUP during the imports used to kill the agent by the default action
    (issue 19, item 8)."""
    result = subprocess.run(
        [sys.executable, "-I", "-c", PROBE.format(heavy=HEAVY, entry=ENTRIES[entry])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.startswith("hyperlight-agent "), result.stderr
    first = [line for line in result.stderr.splitlines() if line.startswith("first heavy import: ")]
    assert first and first[0].endswith("SIGTERM: _remember"), result.stderr


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (*signals.STOP, *signals.RELOAD)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        signals._early.clear()


@pytest.mark.parametrize(
    ("early", "acted"), [((signal.SIGHUP,), ["reload"]), ((signal.SIGHUP, signal.SIGTERM), ["stop"]), ((), [])]
)
@pytest.mark.usefixtures("handlers")
def test_a_signal_before_the_loop_took_over_is_acted_on(early: tuple[int, ...], acted: list[str]) -> None:
    """A HUP that arrived after the settings were read but before the loop took the signals over
    is a reload of the file as it is now, never lost (issue 19, item 9); a stop wins."""
    signals.install_early()
    for sig in early:
        signal.raise_signal(sig)
    calls: list[str] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        signals.attach(loop, lambda: calls.append("stop"), lambda: calls.append("reload"))
        signals.detach(loop)

    asyncio.run(run())
    assert calls == acted
