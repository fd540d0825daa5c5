"""A hostile neighbour for a TCP port on this machine (issue 47: 3): it opens `rate` connections a
second, sends nothing on them and closes each `hold` seconds after its connect, for `seconds`, then
stops by itself. It says "flooding" as it starts and, at its end, what it did as JSON
({"connections": N, "refused": N, "seconds": S}). One thread, one non-blocking socket per
connection: a connect the listener's full backlog leaves unanswered is closed at its time like any
other.

    python -m standin.flood 127.0.0.1 8081 --rate 1000 --hold 0.05 --seconds 15

`under_flood` runs it against an agent's probe port while probing as the kubelet does, and reads
the agent's CPU over the flood (the test in tests/test_hostile.py and `python -m bench p`). The
flood outlasts the last probe by the probe's timeout, so each probe is judged as the kubelet judges
it (answered within PROBE_TIMEOUT_S) with the whole of that time inside the flood.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

# Loopback only: a flood is a test's own traffic to its own server (never any other address).
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# The flood of issue 47 (3): 1000 connections a second, none with a request, each closed 50 ms
# after its connect, for 15 s.
RATE, HOLD_S, SECONDS = 1000, 0.05, 15
# The kubelet's httpGet liveness probe as the manifests set it (timeoutSeconds), sent once a
# second here: more often than the chart's period, so 15 s of probes have 15 chances to fail.
PROBE_TIMEOUT_S = 5
OK = "HTTP/1.1 200 OK"


def flood(host: str, port: int, rate: float, hold: float, seconds: float) -> dict[str, float]:
    """Connections made at `rate` a second for `seconds`, each closed `hold` s after its connect."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    total = int(rate * seconds)
    start = time.monotonic()
    opened: collections.deque[tuple[float, socket.socket]] = collections.deque()
    made = refused = 0
    while made < total or opened:
        now = time.monotonic()
        while opened and opened[0][0] <= now:
            opened.popleft()[1].close()
        while made < total and start + made / rate <= now:
            client = socket.socket(family, socket.SOCK_STREAM)
            client.setblocking(False)
            code = client.connect_ex((host, port))
            if code not in (0, errno.EINPROGRESS):
                refused += 1  # out of ports or refused: counted, the schedule goes on
            made += 1
            opened.append((now + hold, client))
        due = [start + made / rate] if made < total else []
        if opened:
            due.append(opened[0][0])
        if due:
            time.sleep(max(0.0, min(due) - time.monotonic()))  # the flood's own pacing
    return {"connections": made, "refused": refused, "seconds": round(time.monotonic() - start, 3)}


def http_probe(host: str, port: int, path: str, timeout: float) -> str:
    """What a kubelet's httpGet of `path` saw within `timeout` (connect to the last byte): the
    status line, or the error that ended it. Its request goes as soon as it is connected, as the
    kubelet's does."""
    deadline = time.monotonic() + timeout
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: kube-probe/1.37\r\n\r\n".encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as client:
            client.sendall(request)
            answer = b""
            while True:
                client.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = client.recv(4096)
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:
        return f"failed: {exc!r}"
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (all its threads; /proc/PID/stat's utime and
    stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces and ")"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Probe:
    at: float  # seconds into the flood
    took: float
    outcome: str  # the status line, or "failed: …"


@dataclass
class Flooded:
    """One flood and the probes sent during it."""

    made: dict[str, float]  # what the flooder said it did
    cpu: float  # the server's CPU seconds from the flood's start to its end
    probes: list[Probe] = field(default_factory=list)

    def failed(self) -> list[Probe]:
        """Probes not answered 200, or answered only after the flood ended (released by its end,
        not served during it)."""
        return [p for p in self.probes if p.outcome != OK or p.at + p.took > self.made["seconds"]]


def under_flood(
    host: str,
    port: int,
    pid: int,
    path: str = "/livez",
    rate: float = RATE,
    hold: float = HOLD_S,
    seconds: int = SECONDS,
) -> Flooded:
    """Probe `path` once a second for `seconds`, each probe on a thread of its own (a slow one
    delays no other), PROBE_TIMEOUT_S each, while a process of its own floods host:port from the
    first probe until the last one's timeout (a flood of `seconds` left the last probe 1 s where
    the kubelet waits 5: on a loaded machine a probe answered in 1-2 s counted as failed). `pid`
    is the server's process, whose CPU is read at the flood's start and end."""
    argv = [sys.executable, "-m", "standin.flood", host, str(port)]
    argv += ["--rate", str(rate), "--hold", str(hold), "--seconds", str(seconds + PROBE_TIMEOUT_S)]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probes: list[Optional[Probe]] = [None] * seconds
    with subprocess.Popen(argv, cwd=here, stdout=subprocess.PIPE, text=True) as flooder:
        try:
            assert flooder.stdout is not None
            if flooder.stdout.readline() != "flooding\n":
                raise RuntimeError(f"{' '.join(argv)}: did not start")
            started, cpu_before = time.monotonic(), cpu_seconds(pid)

            def probe(i: int) -> None:
                at = time.monotonic()
                outcome = http_probe(host, port, path, PROBE_TIMEOUT_S)
                probes[i] = Probe(at - started, time.monotonic() - at, outcome)

            probers = []
            for i in range(seconds):
                time.sleep(max(0.0, started + i - time.monotonic()))  # the kubelet's period
                probers.append(threading.Thread(target=probe, args=(i,)))
                probers[-1].start()
            made = json.loads(flooder.stdout.readline())  # at the flood's end
            cpu = cpu_seconds(pid) - cpu_before
            for prober in probers:
                prober.join(PROBE_TIMEOUT_S + 5)
            if flooder.wait(10) != 0:
                raise RuntimeError(f"{' '.join(argv)}: exit {flooder.returncode}")
        finally:
            if flooder.poll() is None:
                flooder.kill()
    lost = Probe(0, 0, "failed: the probe never returned")
    return Flooded(made, cpu, [p or lost for p in probes])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m standin.flood", description=__doc__.split("\n\n")[0])
    parser.add_argument("host", choices=LOOPBACK)
    parser.add_argument("port", type=int)
    parser.add_argument("--rate", type=float, default=RATE, help="connections a second")
    parser.add_argument("--hold", type=float, default=HOLD_S, help="seconds from a connect to its close")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="how long the flood lasts")
    args = parser.parse_args()
    if not 0 < args.rate <= 100_000 or not 0 <= args.hold <= 60 or not 0 < args.seconds <= 600:
        parser.error(f"rate {args.rate}, hold {args.hold}, seconds {args.seconds}: out of bounds")
    print("flooding", flush=True)
    print(json.dumps(flood(args.host, args.port, args.rate, args.hold, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
