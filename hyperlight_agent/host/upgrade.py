"""`hyperlight-agent --upgrade-in-place PID`: ask the agent running as PID to upgrade in place
(host/successor.py) and wait for the outcome, so that the unit's ExecReload= and the package
scripts know how it went.

    0  the new agent serves the kubelet and is the unit's main process; the old one has left
    1  the upgrade failed or timed out: the old agent serves on (why is on stdout and in its journal)
    3  PID is no agent of ours that can upgrade in place (not ours, gone, or an earlier release):
       nothing was done, a restart is the way to new code

The agent is found by asking Describe on the sockets every mode's instances serve (the caller
lists them: parts.ProtocolRow.instance_sockets): the one that answers with PID is it. A command
that finds an upgrade of PID already under way (a package script's beside an admin's `systemctl
reload`) sends nothing and answers that upgrade's outcome, and one that finds PID already replaced
by an in-place upgrade (the new agent's Describe says `replaced`) answers 0.

Why: docs/decisions/host-upgrades-in-place.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable, Optional

import grpc

from hyperlight_agent import peers, waits
from hyperlight_agent.host import signals, successor
from hyperlight_agent.identity import Description

DONE, FAILED, CANNOT = 0, 1, 3
# Describe is asked this often while the upgrade runs.
POLL_S = 0.1
# Beyond the child's READY_TIMEOUT_S: the old agent's handover and shutdown.
LEAVE_TIMEOUT_S = 20.0
# This command is started cold, often on a busy host (a package upgrade): an instance gets this
# long to answer it, not the handover's PEER_TIMEOUT_S, which bounds a search with a deadline.
ANSWER_TIMEOUT_S = 5.0
# Once the old agent has left, the new one may be between two sockets: a kubelet before 1.37
# ends the new plugin's stream when the old one's ends, and the agent then serves and registers
# anew. It is asked again for this long before the upgrade is called failed.
SUCCESSOR_WAIT_S = 10.0


def upgrade_in_place(pid: int, sockets: Callable[[], list[str]]) -> tuple[int, str]:
    """(exit code, one line saying what happened)."""
    return asyncio.run(_upgrade(pid, sockets))


async def _answers(sockets: list[str]) -> list[Description]:
    """What the instances of ours on these sockets say (one at a time: a host has a few)."""
    found = []
    for path in sockets:
        try:
            answer = await peers.describe(path, ANSWER_TIMEOUT_S)
        except (OSError, grpc.RpcError, peers.Legacy):  # not an answer of ours
            continue
        if answer is not None:
            found.append(answer)
    return found


async def descendant(instance: Optional[str], protocol: str, resource: str, sockets: list[str]) -> Optional[str]:
    """The socket of the newest live instance that in-place upgrades of `instance` started, if any."""
    found = [
        a
        for a in await _answers(sockets)
        if (a.identity.protocol, a.identity.resource) == (protocol, resource)
        and successor.descends_from(instance, a.identity.instance)
    ]
    return max(found, key=lambda d: d.identity.started).path if found else None


async def _upgrade(pid: int, sockets: Callable[[], list[str]]) -> tuple[int, str]:
    answers = await _answers(sockets())
    found = next((a for a in answers if a.identity.pid == pid), None)
    if found is None or found.upgrade is None:
        return _not_upgrading(pid, found, answers)
    attempts = int(found.upgrade.get("attempts", 0))
    # An upgrade already under way (a package script's beside an admin's `systemctl reload`), or
    # done with the old agent leaving: this command joins it, and its outcome is ours to say.
    joined = found.upgrade.get("state") in (peers.UpgradeState.RUNNING, peers.UpgradeState.DONE)
    before = attempts - 1 if joined else attempts
    try:
        pidfd = os.pidfd_open(pid)
        if not joined:
            signal.pidfd_send_signal(pidfd, signals.UPGRADE[0])
    except ProcessLookupError:
        return CANNOT, f"pid {pid} has exited"
    try:
        failed = await _failed_or_gone(pidfd, found.path, before)
    finally:
        os.close(pidfd)
    if failed is not None:
        return FAILED, f"in-place upgrade of pid {pid} failed: {failed}"
    # Whatever took over started after the old agent did.
    deadline = asyncio.get_running_loop().time() + SUCCESSOR_WAIT_S
    successor_found = await peers.newer_until(found.identity, sockets, deadline)
    if successor_found is None:
        return FAILED, (
            f"pid {pid} exited during the in-place upgrade, and no new agent answered within "
            f"{SUCCESSOR_WAIT_S:g} s (see the journal)"
        )
    return DONE, (
        f"pid {pid} handed over to pid {successor_found.identity.pid} "
        f"(hyperlight-agent {successor_found.identity.version}) and left"
    )


def _not_upgrading(pid: int, found: Optional[Description], answers: list[Description]) -> tuple[int, str]:
    """The answer for a pid that is no agent we can upgrade now."""
    if found is not None:
        return CANNOT, f"pid {pid} runs hyperlight-agent {found.identity.version}, which cannot upgrade in place"
    replacement = next((a for a in answers if a.replaced == pid), None)
    if replacement is not None:  # another command's upgrade of it was over before we asked
        return DONE, (
            f"pid {pid} had already handed over to pid {replacement.identity.pid} "
            f"(hyperlight-agent {replacement.identity.version})"
        )
    return CANNOT, f"pid {pid}: no hyperlight-agent answers as this process"


async def _failed_or_gone(pidfd: int, path: str, before: int) -> Optional[str]:
    """Why the upgrade failed (the old agent serves on), or None once the old agent has left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + successor.READY_TIMEOUT_S + LEAVE_TIMEOUT_S
    gone = asyncio.Event()
    loop.add_reader(pidfd, gone.set)
    try:
        while not await waits.event(gone, POLL_S):
            if loop.time() > deadline:
                return f"not finished within {successor.READY_TIMEOUT_S + LEAVE_TIMEOUT_S:g} s"
            try:
                now = await peers.describe(path, peers.PEER_TIMEOUT_S)
            except (OSError, grpc.RpcError, peers.Legacy):  # the old agent is leaving: its socket goes
                continue
            record = now.upgrade if now is not None and now.upgrade is not None else {}
            if int(record.get("attempts", 0)) > before and record.get("state") == peers.UpgradeState.FAILED:
                return f"{record.get('why')}; it serves on"
        return None
    finally:
        loop.remove_reader(pidfd)
