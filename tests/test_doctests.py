"""The examples in the package's docstrings run, and show what they say (`# doctest: +SKIP` marks
the ones that need a running system)."""

from __future__ import annotations

import doctest
import importlib
import os

import pytest

from tests.test_layers import MODULES, PACKAGE


def has_examples(module: str) -> bool:
    """Whether the module's source holds an example that is not skipped."""
    with open(os.path.join(PACKAGE, *module.split(".")) + ".py") as f:
        return any(">>>" in line and "doctest: +SKIP" not in line for line in f)


WITH_EXAMPLES = [m for m in MODULES if has_examples(m)]


def test_the_examples_are_found() -> None:
    assert {
        "files.cdi",
        "text",
        "device.hypervisors",
        "files.labels",
        "host.httpd",
        "host.journal",
        "reload",
        "deviceplugin.side",
        "files.watcher",
        "dra.side",
    } <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_docstring_examples_hold(module: str) -> None:
    result = doctest.testmod(
        importlib.import_module(f"hyperlight_agent.{module}"),
        report=True,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 0, f"{module}: no example ran"
    assert result.failed == 0, f"{module}: {result.failed} of {result.attempted} examples failed (output above)"
