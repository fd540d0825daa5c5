"""The Hyperlight example (deploy/examples/hyperlight) as built, on this machine's /dev/kvm: the
guest answers; without a hypervisor it says Hyperlight's own error in one line (exit 1); a bad
command line is one line naming the argument (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import hyperlight

pytestmark = [pytest.mark.system, pytest.mark.root]

NEEDS_KVM = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@NEEDS_KVM
def test_the_guest_answers_on_this_machines_kvm() -> None:
    example = hyperlight.example()
    said = run(example.host, "--guest", example.guest)
    assert said.returncode == 0, said.stdout + said.stderr
    assert said.stdout.startswith("hypervisor: kvm") and hyperlight.ANSWER in said.stdout, said.stdout
    assert said.stdout.endswith("ok\n"), said.stdout

    report = run(example.host, "--guest", example.guest, "--json", "--runs", "3")
    assert report.returncode == 0, report.stderr
    figures = json.loads(report.stdout)
    assert (figures["hypervisor"], figures["add"], figures["host_call"], figures["runs"]) == ("kvm", 42, 1337, 3)
    assert figures["build_ms"] > 0 and figures["call_us"] > 0, figures


@NEEDS_KVM
def test_without_a_hypervisor_it_says_hyperlights_error_in_one_line() -> None:
    """/dev/null bound over /dev/kvm in a private mount namespace: the host's node is untouched."""
    example = hyperlight.example()
    script = f"mount --bind /dev/null /dev/kvm && exec {example.host} --guest {example.guest}"
    said = run("unshare", "--mount", "--propagation", "private", "sh", "-c", script)
    assert said.returncode == 1, said.stdout + said.stderr
    (line,) = said.stderr.splitlines()
    assert line.startswith("hyperlight-example: ") and hyperlight.NO_HYPERVISOR in line, line
    assert said.stdout == "", said.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--runs", "0"], '--runs: not a positive whole number: "0"'), (["--frobnicate"], '"--frobnicate"')],
)
def test_a_bad_command_line_is_one_line_naming_it(argv: list[str], named: str) -> None:
    said = run(hyperlight.example().host, *argv)
    assert said.returncode == 2 and said.stdout == "", said
    (line,) = said.stderr.splitlines()
    assert line.startswith("hyperlight-example: ") and named in line, line
