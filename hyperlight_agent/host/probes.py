"""The kubelet's httpGet probes (`probe_address`): `/livez`, `/readyz` and `/healthz`, answered
from the agent's own state on its HTTP server (host/httpd.py), so a probe costs the agent one
short request on its loop instead of a process (the exec probe, host/healthcheck.py, starts a
Python interpreter: 0.16-0.19 s of CPU and ~35 MB each time; BENCHMARKS.md "Probe cost").

    /livez, /healthz   200 while the agent's loop answers (what the exec liveness probe's gRPC
                       health Check says: the server runs)
    /readyz            200 when ready, else 503; the body is the status line either way
    /                  the paths this server answers

Both probes answer what the gRPC health service says, from the same state.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from hyperlight_agent.host.httpd import TEXT, HttpServer, Route

LIVEZ = "/livez"
READYZ = "/readyz"
HEALTHZ = "/healthz"  # the older name some tools and people try first


def routes(readiness: Callable[[], tuple[bool, str]]) -> dict[str, Route]:
    """The probes' routes; `readiness()` is (ready, the status line)."""

    def live() -> tuple[int, str, bytes]:
        return 200, TEXT, b"live: serving\n"

    def ready() -> tuple[int, str, bytes]:
        ok, status = readiness()
        return (200 if ok else 503), TEXT, f"{'ready' if ok else 'not ready'}: {status}\n".encode()

    return {LIVEZ: live, HEALTHZ: live, READYZ: ready}


def servers(wanted: Mapping[str, tuple[Optional[str], Mapping[str, Route]]]) -> list[HttpServer]:
    """One HTTP server per address: {setting: (its address or None, its routes)}; settings with
    the same address share one server (e.g. metrics and probes on one port)."""
    by_address: dict[str, tuple[list[str], dict[str, Route]]] = {}
    for setting, (address, served) in wanted.items():
        if address and served:
            names, table = by_address.setdefault(address, ([], {}))
            names.append(setting)
            table.update(served)
    found = []
    for address, (names, table) in by_address.items():
        listing = "".join(f"{path}\n" for path in sorted(table)).encode()
        table.setdefault("/", lambda listing=listing: (200, TEXT, listing))  # type: ignore[misc]
        found.append(HttpServer(address, table, " and ".join(names)))
    return found
