"""The kubelets the registrar met: a restart told from the socket's identity, a new socket ending a
backoff, and the settle only before registering again with the kubelet whose stream we ended."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from hyperlight_agent.deviceplugin import kubelets
from hyperlight_agent.deviceplugin.kubelets import Kubelets


def kubelet_socket(path: str) -> socket.socket:
    """A fresh socket at path (the old one removed): a kubelet that (re)started."""
    if os.path.lexists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    return s


def test_a_new_kubelet_is_one_whose_socket_differs_from_the_last_we_registered_with(tmp: str) -> None:
    path = os.path.join(tmp, "kubelet.sock")
    met = Kubelets(path)
    assert met.trying() is None and met.registered_with is None, "no kubelet yet"
    first = kubelet_socket(path)
    pin = met.trying()
    assert pin is not None
    assert not met.registered(pin), "the first kubelet we meet is no restart"
    os.chmod(path, 0o600)  # metadata: the same kubelet
    again = met.trying()
    assert again is not None and not met.registered(again)
    second = kubelet_socket(path)
    pin = met.trying()
    assert pin is not None and met.registered(pin), "a new socket: the kubelet restarted"
    assert met.registered_with == met.now()
    first.close()
    second.close()


async def test_a_backoff_ends_when_a_socket_other_than_our_attempts_appears(tmp: str) -> None:
    path = os.path.join(tmp, "kubelet.sock")
    met, wake = Kubelets(path), asyncio.Event()
    old = kubelet_socket(path)
    met.trying()
    assert not await met.wait_for_new(0.05, wake, lambda: True), "the same kubelet: the whole delay"
    waiting = asyncio.ensure_future(met.wait_for_new(3600, wake, lambda: True))
    await asyncio.sleep(0)
    assert not waiting.done()
    new = kubelet_socket(path)
    wake.set()  # the watcher's event
    assert await asyncio.wait_for(waiting, 10)
    old.close()
    new.close()


async def test_the_settle_is_only_for_the_kubelet_whose_stream_we_ended(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubelets, "STREAM_SETTLE_S", 3600.0)
    path = os.path.join(tmp, "kubelet.sock")
    met = Kubelets(path)
    old = kubelet_socket(path)
    met.trying()
    await asyncio.wait_for(met.settle(), 10)  # no stream ended: nothing to wait for
    met.stream_ended()
    settling = asyncio.ensure_future(met.settle())
    for _ in range(3):  # yields: a settle with nothing to wait for ends in its first step
        await asyncio.sleep(0)
    assert not settling.done(), "the same kubelet: it gets its time to handle the stream's end"
    settling.cancel()
    met.stream_ended()
    new = kubelet_socket(path)  # restarted meanwhile: it never knew that stream
    await asyncio.wait_for(met.settle(), 10)
    old.close()
    new.close()
