"""The registrar's decisions (deviceplugin/registration_state.py) as tables: how a registration
ends from what was seen, what follows each ending, which stream is the kubelet's, when a kubelet
counts as starting, and how soon a failed Register is retried."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from hyperlight_agent.deviceplugin.registration_state import (
    AFTER,
    KUBELET_STARTING_RETRY_S,
    KUBELET_STARTING_S,
    STABLE_STREAM_S,
    Ending,
    KubeletStarting,
    KubeletStream,
    Seen,
    State,
    ending,
    ending_text,
    retry_delay,
)

KUBELET = (1, 100)
NEW_KUBELET = (1, 101)
# Registered with KUBELET, serving, its stream open, nothing asked: the registration goes on.
STEADY = Seen(
    ours=True,
    path_taken=True,
    kubelet=KUBELET,
    registered_with=KUBELET,
    stream_ended=False,
    renew=False,
    stream_due_in=None,
)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, None),
        ({"ours": False, "path_taken": False}, Ending.RESTART),  # a starting kubelet removed our socket
        ({"ours": False, "path_taken": True}, Ending.REPLACED),
        ({"kubelet": NEW_KUBELET}, Ending.RESTART),
        ({"kubelet": None}, None),  # a kubelet stopping removes its socket first: its stream's end says it
        ({"registered_with": None}, Ending.RESTART),
        ({"stream_ended": True}, Ending.LOST),
        ({"renew": True}, Ending.RENEW),
        ({"stream_due_in": 0.5}, None),
        ({"stream_due_in": 0.0}, Ending.NO_STREAM),
        ({"stream_due_in": -1.0}, Ending.NO_STREAM),
        # The first rule wins: what ended the registration first is what is said.
        ({"ours": False, "path_taken": True, "kubelet": NEW_KUBELET, "stream_ended": True}, Ending.REPLACED),
        ({"kubelet": NEW_KUBELET, "stream_ended": True, "renew": True}, Ending.RESTART),
        ({"stream_ended": True, "renew": True, "stream_due_in": -1.0}, Ending.LOST),
        ({"renew": True, "stream_due_in": -1.0}, Ending.RENEW),
    ],
)
def test_how_a_registration_ends(change: dict[str, object], expected: Optional[Ending]) -> None:
    assert ending(dataclasses.replace(STEADY, **change)) is expected  # type: ignore[arg-type]


def test_what_follows_each_ending() -> None:
    table = {outcome: (after.state, after.backoff, after.restart) for outcome, after in AFTER.items()}
    assert table == {
        Ending.RESTART: (State.WAITING, False, True),
        Ending.REPLACED: (State.WAITING, False, False),
        Ending.RENEW: (State.WAITING, False, False),
        Ending.LOST: (State.LOST, True, False),
        Ending.NO_STREAM: (State.LOST, True, False),
    }
    said = AFTER[Ending.LOST].said.format(why=ending_text(Ending.LOST, 3), delay=0.25)
    assert said == "the kubelet's ListAndWatch stream ended; serving and registering again in 0.2 s"
    said = AFTER[Ending.NO_STREAM].said.format(why=ending_text(Ending.NO_STREAM, 3), delay=2)
    assert said == "no ListAndWatch stream within 3 s of registering; serving and registering again in 2.0 s"
    replaced = AFTER[Ending.REPLACED].said.format(socket="/k/hyperlight.sock")
    assert replaced.startswith("/k/hyperlight.sock is no longer our socket")


def test_the_kubelets_stream_is_the_first_to_open_after_register() -> None:
    stream = KubeletStream()
    sidecar, kubelets, later = object(), object(), object()
    assert not stream.opened(sidecar, 1.0)  # before Register: someone else's
    stream.sent()
    assert stream.opened(kubelets, 2.0) and stream.open and stream.since == 2.0
    assert not stream.opened(later, 3.0)  # only the first
    assert not stream.closed(sidecar) and not stream.closed(later) and not stream.ended
    assert stream.closed(kubelets) and stream.ended and not stream.open
    stream.forget()
    assert not stream.ended and not stream.opened(later, 4.0)  # the next Register's, not this one
    assert stream.since == 2.0  # kept for the backoff's decision after the end


@pytest.mark.parametrize(
    ("outcome", "lived", "stable"),
    [
        (Ending.LOST, STABLE_STREAM_S, True),
        (Ending.LOST, STABLE_STREAM_S - 0.1, False),
        (Ending.NO_STREAM, STABLE_STREAM_S * 10, False),  # a stream that never opened proves nothing
    ],
)
def test_only_a_long_lived_stream_starts_the_loss_backoff_over(outcome: Ending, lived: float, stable: bool) -> None:
    stream = KubeletStream()
    stream.sent()
    stream.opened(object(), 100.0)
    assert stream.stable(outcome, 100.0 + lived) is stable


def test_a_new_kubelet_socket_counts_as_starting_for_a_while() -> None:
    starting = KubeletStarting()
    assert not starting.starting(None, KUBELET, 0.0)  # no socket
    assert not starting.starting(KUBELET, KUBELET, 0.0)  # the kubelet we registered with
    assert starting.starting(NEW_KUBELET, KUBELET, 10.0)
    assert starting.starting(NEW_KUBELET, KUBELET, 10.0 + KUBELET_STARTING_S - 0.1)
    assert not starting.starting(NEW_KUBELET, KUBELET, 10.0 + KUBELET_STARTING_S)  # it refuses us: backed off
    third = (1, 102)
    assert starting.starting(third, KUBELET, 30.0)  # another socket: its own while
    assert starting.starting(KUBELET, None, 31.0)  # never registered: any socket is new


@pytest.mark.parametrize(
    ("backoff", "unanswered", "starting", "delay"),
    [
        (4.0, True, True, KUBELET_STARTING_RETRY_S),
        (4.0, True, False, 4.0),
        (4.0, False, True, 4.0),  # it answered (refused): backed off
        (0.0, True, True, 0.0),
    ],
)
def test_how_soon_a_failed_register_is_retried(backoff: float, unanswered: bool, starting: bool, delay: float) -> None:
    assert retry_delay(backoff, unanswered, starting) == delay
