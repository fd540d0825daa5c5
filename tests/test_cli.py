"""The command line (cli.py) as the process runs it: the flags that exclude each other, a process id
where one is asked for, and every refusal one line with exit code 2; `--version`; and exit_now
leaving with its code and its output flushed, without the interpreter's teardown. (Each setting's
refusal, through the same exit: test_config.py; --help against docs/settings.md: test_docs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hyperlight_agent import __version__
from tests.conftest import REPO, run_agent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device-access", "--dra"], "argument --dra: not allowed with argument --device-access"),
        (["--check", "--health-check", "liveness"], "argument --health-check: not allowed with argument --check"),
        (["--mode", "plugin", "--dra"], "--mode 'plugin' and --dra: different modes, choose one"),
        (["--health-check", "sometimes"], "argument --health-check: invalid choice: 'sometimes'"),
        (["--devce-count", "5"], "unrecognized arguments: --devce-count 5 (did you mean --device-count?)"),
    ],
)
def test_a_refused_command_line_is_one_line_and_exit_code_2(argv: list[str], expected: str) -> None:
    result = run_agent(*argv)
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"hyperlight-agent: error: {expected}"), line
    assert result.stdout == ""


def test_version_says_the_package_version() -> None:
    result = run_agent("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"hyperlight-agent {__version__}")


EXIT_NOW = """
import atexit, sys
from hyperlight_agent import cli
atexit.register(print, "teardown ran")
print("said before leaving", end="")
sys.stderr.write("and on stderr")
cli.exit_now(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 1, 3])
def test_exit_now_leaves_with_its_code_and_its_output_but_no_teardown(code: int) -> None:
    result = subprocess.run(
        [sys.executable, "-c", EXIT_NOW, str(code)], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == code
    assert (result.stdout, result.stderr) == ("said before leaving", "and on stderr"), "flushed, and no teardown"


@pytest.mark.parametrize("value", ["0", "-1", "12ab", "99999999999"])
def test_upgrade_in_place_needs_a_process_id(value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--config", "/dev/null", f"--upgrade-in-place={value}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"hyperlight-agent: error: argument --upgrade-in-place: not a process id: '{value}'"
    ), result.stderr
