"""The registrar's decisions, without I/O: where a registration stands, when it has ended and how,
what comes after each ending, which stream is the kubelet's, and when a kubelet is still starting.

deviceplugin/registration.py is the shell: it serves, sends Register, stats the two sockets and
waits; everything it decides from what it saw is here, as data and pure functions, so each rule has
a table test (tests/test_deviceplugin_registration_state.py).

Why: docs/decisions/the-kubelets-stream.md.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from hyperlight_agent.files.sockets import Identity

# A stream that lived this long was a healthy registration: the backoff starts over after it.
STABLE_STREAM_S = 30.0
# A new kubelet.sock that does not answer yet: retry this often, for this long, before backing off.
KUBELET_STARTING_RETRY_S = 0.05
KUBELET_STARTING_S = 10.0


class State(str, enum.Enum):
    """Where the registration stands (a str: status lines and metrics show its value)."""

    WAITING = "waiting"  # for a kubelet (serving or registering failed; backing off)
    REGISTERED = "registered"  # Register succeeded; no stream yet
    STREAMED = "streamed"  # the kubelet's ListAndWatch stream is open
    LOST = "lost"  # the stream ended, or never opened: serving and registering again


class Ending(enum.Enum):
    """How a registration ended, and so what comes before serving again (AFTER)."""

    RESTART = "restart"  # the kubelet restarted, or our socket is gone: at once
    REPLACED = "replaced"  # another socket is at our path: serve again (a stale one is swapped out)
    LOST = "lost"  # the kubelet's stream ended: after the loss backoff
    NO_STREAM = "no-stream"  # no stream opened in time after Register: likewise
    RENEW = "renew"  # asked to (Registrar.renew()): end our stream and register again, with no backoff


@dataclasses.dataclass(frozen=True)
class After:
    """What follows an ending: the state said meanwhile, whether the loss backoff is waited first,
    whether it counts as a kubelet restart, and the line logged (at warning when `warn`)."""

    state: State
    backoff: bool
    restart: bool
    said: str
    warn: bool


AFTER: dict[Ending, After] = {
    # Not a kubelet restart: serving again either swaps out a stale socket or finds the live one
    # of another agent (and then the agent exits, never taking it over).
    Ending.REPLACED: After(
        State.WAITING, False, False, "{socket} is no longer our socket: another one was put there; serving again", True
    ),
    Ending.RENEW: After(State.WAITING, False, False, "registering {resource} with the kubelet again", False),
    Ending.RESTART: After(State.WAITING, False, True, "kubelet restart detected; serving and registering again", False),
    # The kubelet never dials a plugin again once its stream ended: serve and register again, after
    # the loss backoff (cut short by a new kubelet.sock).
    Ending.LOST: After(State.LOST, True, False, "{why}; serving and registering again in {delay:.1f} s", True),
    Ending.NO_STREAM: After(State.LOST, True, False, "{why}; serving and registering again in {delay:.1f} s", True),
}


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the registrar saw while registered, at one moment."""

    ours: bool  # our server still serves, and our socket is still at its path
    path_taken: bool  # something is at our socket's path
    kubelet: Optional[Identity]  # kubelet.sock now (None: none)
    registered_with: Optional[Identity]  # the kubelet.sock our Register went through
    stream_ended: bool  # the kubelet's stream opened and has ended
    renew: bool  # renew() was asked for
    stream_due_in: Optional[float]  # seconds left for the kubelet's stream to open (None: not awaited)


def ending(seen: Seen) -> Optional[Ending]:
    """How the registration has ended, if it has; the first rule that applies wins."""
    if not seen.ours:
        return Ending.REPLACED if seen.path_taken else Ending.RESTART
    if seen.kubelet is not None and seen.kubelet != seen.registered_with:
        return Ending.RESTART
    if seen.stream_ended:
        return Ending.LOST
    if seen.renew:
        return Ending.RENEW
    if seen.stream_due_in is not None and seen.stream_due_in <= 0:
        return Ending.NO_STREAM
    return None


def ending_text(outcome: Ending, stream_open_timeout: float) -> str:
    """Why the kubelet's stream is gone (the status line's cause)."""
    if outcome is Ending.NO_STREAM:
        return f"no ListAndWatch stream within {stream_open_timeout:g} s of registering"
    return "the kubelet's ListAndWatch stream ended"


class KubeletStream:
    """Which of a server's ListAndWatch streams is the kubelet's: the first to open after our
    Register was sent (the kubelet dials back inside Register and opens ListAndWatch right after).
    Other clients' streams (a monitoring sidecar, an operator's grpcurl) never stand in for it."""

    def __init__(self) -> None:
        self.since = 0.0  # when the last kubelet stream opened (kept across forget(): AFTER reads it)
        self.forget()

    def forget(self) -> None:
        """The next stream to open after the next Register is the kubelet's."""
        self._sent = False
        self._stream: Optional[object] = None
        self.open = False

    def sent(self) -> None:
        """A Register of ours is on its way."""
        self._sent = True

    def opened(self, stream: object, now: float) -> bool:
        """A stream opened; True when it is the kubelet's."""
        if not self._sent or self._stream is not None:
            return False
        self._stream, self.open, self.since = stream, True, now
        return True

    def closed(self, stream: object) -> bool:
        """A stream ended; True when it was the kubelet's."""
        if self._stream is None or stream is not self._stream:
            return False
        self.open = False
        return True

    @property
    def ended(self) -> bool:
        return self._stream is not None and not self.open

    def stable(self, outcome: Ending, now: float) -> bool:
        """The stream that just ended lived long enough that its loss is no loop: the loss
        backoff starts over."""
        return outcome is Ending.LOST and now - self.since >= STABLE_STREAM_S


class KubeletStarting:
    """A kubelet.sock we have not registered with, for less than KUBELET_STARTING_S: a kubelet
    still starting (its socket exists before it serves), and every moment until we register is
    one in which its admission counts no device."""

    def __init__(self) -> None:
        self._first: Optional[tuple[Identity, float]] = None  # a new kubelet.sock, first failed at

    def starting(self, kubelet: Optional[Identity], registered_with: Optional[Identity], now: float) -> bool:
        if kubelet is None or kubelet == registered_with:
            return False
        if self._first is None or self._first[0] != kubelet:
            self._first = (kubelet, now)
        return now - self._first[1] < KUBELET_STARTING_S


def retry_delay(backoff: float, unanswered: bool, starting: bool) -> float:
    """How long after a failed Register (its backoff's next delay) before the next: a kubelet
    still starting that did not answer yet is asked again soon."""
    return min(backoff, KUBELET_STARTING_RETRY_S) if unanswered and starting else backoff
