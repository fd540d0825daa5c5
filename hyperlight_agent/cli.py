"""Command line: parse, configure, run. main() returns the exit code (--upgrade-in-place passes
on host/upgrade.py's own).

Exit codes: 0 clean stop (or check passed), 1 check failed or fatal runtime error,
2 usage or configuration error (one line on stderr naming the setting and value).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from typing import Mapping, NoReturn, Optional, Sequence

from hyperlight_agent import __version__, config, contracts, modes, text
from hyperlight_agent.host import journal, notify, signals

PROG = "hyperlight-agent"
DESCRIPTION = (
    "Hands the hypervisor device to Hyperlight sandboxes on a Kubernetes node: detects /dev/mshv or "
    "/dev/kvm, proves it usable with a bounded kernel-level check, keeps the CDI spec hyperlight.json "
    "exactly right, and offers the device to the kubelet as hyperlight.dev/hypervisor slots (a device "
    "plugin) or, with --dra, as this node's ResourceSlice (a Dynamic Resource Allocation driver)."
)
EPILOG = (
    "Exit status: 0 on a clean stop, 1 on a runtime failure (also when another agent already serves "
    "our socket), 2 on a usage or configuration error (--upgrade-in-place: 3 when PID cannot upgrade in "
    "place). SIGTERM or SIGINT stops gracefully (also during startup); SIGHUP reloads the config file; "
    "SIGUSR2 upgrades in place under systemd (what --upgrade-in-place sends); the CDI spec is kept."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        # The message quotes arguments as given: escaped and cut like every other error line.
        raise config.ConfigError(text.shown(message, 200) + self._suggestion(message))

    def _suggestion(self, message: str) -> str:
        """A near flag for the first unknown one ("unrecognized arguments: --devce-count 5")."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        unknown = next((a.split("=", 1)[0] for a in message[len(prefix) :].split() if a.startswith("--")), "")
        flags = {flag: flag for action in self._actions for flag in action.option_strings if flag.startswith("--")}
        return config.suggestion(unknown, flags) if unknown else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    which = parser.add_mutually_exclusive_group()  # the mode: the main plugin without either
    which.add_argument(
        "--device-access",
        action="store_true",
        help="bootstrap mode: advertise hyperlight.dev/device-access slots (4: our pods and their surge "
        "successors) on hyperlight-access.sock that grant the raw device (DeviceSpec only; never opens it)",
    )
    which.add_argument(
        "--dra",
        action="store_true",
        help="Dynamic Resource Allocation mode: publish this node's ResourceSlice of driver hypervisor.hyperlight.dev "
        "and prepare claims through the kubelet's plugin watcher (Kubernetes 1.35+; needs API access)",
    )
    actions = parser.add_mutually_exclusive_group()
    actions.add_argument(
        "--health-check",
        choices=("liveness", "readiness"),
        default=None,
        help="exec probe: one gRPC health Check against the running agent's socket (with "
        "--device-access, that mode's socket); exit 0 if SERVING, else 1, with one line why",
    )
    actions.add_argument(
        "--check",
        nargs="?",
        const="node",
        choices=("node", "device"),
        default=None,
        help="one-shot diagnostic of what the mode needs, changing nothing: the runtime, the device (detect, "
        "probe, host identity, the CDI spec; --device-access: lstat only), the kubelet's directories and "
        "(--dra) API access, each FAIL line with what to do; exit 0 when this node can serve Hyperlight. "
        "--check=device: the runtime and the device only (in a workload's container)",
    )
    actions.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration, every setting as a TOML line with its value and where it came "
        "from (default, file, environment, flag), and exit 0 (2 on an invalid one, as the agent); the agent logs "
        "the same at log_level debug when it starts",
    )
    actions.add_argument(
        "--upgrade-in-place",
        type=_pid,
        metavar="PID",
        default=None,
        help="ask the agent running as PID (the unit's main process) to start the code installed now, "
        "hand the kubelet and the unit over to it and leave, without a moment unserved; wait for the "
        "outcome: exit 0 when done, 1 when it failed (the old agent serves on), 3 when PID cannot "
        "upgrade in place (then restart the unit)",
    )
    config.add_arguments(parser)
    return parser


def _mode(settings: config.Settings) -> modes.Mode:
    """The row of the mode the settings name."""
    return modes.of(settings.mode == modes.DEVICE_ACCESS.name, settings.mode == modes.DRA.name)


def _mode_flags(args: argparse.Namespace) -> None:
    """`--device-access` and `--dra` are short for `--mode`: a flag like any setting's (it beats
    HYPERLIGHT_MODE and the file), and never one that says otherwise."""
    named = modes.flagged(args.device_access, args.dra)
    if named is None:
        return
    if args.mode is not None and args.mode.lower() != named:
        raise config.ConfigError(f"--mode {text.quote(args.mode)} and --{named}: different modes, choose one")
    args.mode = named


def _pid(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 0 < int(value) <= contracts.PID_MAX:
        raise argparse.ArgumentTypeError(f"not a process id: {text.quote(value)}")
    return int(value)


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    signals.install_early()  # from here on a signal is remembered, never fatal
    environ = os.environ if environ is None else environ
    # Warnings about lenient environment values must be visible before settings are known.
    journal.setup("info", environ)
    try:
        args = build_parser().parse_args(argv)
        _mode_flags(args)
        settings = config.load(args, environ)
        try:
            notify.watchdog_usec(environ)
        except ValueError as exc:
            value = environ.get(contracts.WATCHDOG_USEC_ENV, "")
            raise config.ConfigError(f"{contracts.WATCHDOG_USEC_ENV}={text.quote(value)}: {exc}") from None
    except config.ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print("\n".join(config.effective(settings)))
        return 0
    if args.health_check or args.check or args.upgrade_in_place:
        return _one_shot(args, settings, environ)
    journal.setup(settings.log_level, environ, log_fields(settings), settings.log_format)
    for line in config.effective(settings):
        logging.getLogger(PROG).debug("config: %s", line)
    try:
        asyncio.run(_serve(settings, args, environ))
    except Exception as exc:  # the one place a fatal runtime error becomes an exit code
        if not isinstance(exc, _Said):
            _say_fatal(exc, settings)
        return 1
    return 0


class _Said(Exception):
    """A fatal error already logged (before the shutdown it caused said "stopping")."""


def _say_fatal(exc: BaseException, settings: config.Settings) -> None:
    from hyperlight_agent.deviceplugin.plugin_server import (
        AlreadyServed,  # grpc is imported only for the long-running modes
    )

    log = logging.getLogger(PROG)
    if isinstance(exc, AlreadyServed):
        journal.last_words(log, str(exc))
    else:
        journal.last_words(log, f"fatal: {exc}", exc if settings.log_level == "debug" else None)


def log_fields(settings: config.Settings) -> dict[str, str]:
    """The fields on every log entry (docs/agent.md's log-fields table): the journal's in upper case."""
    return {
        "resource": _mode(settings).resource,
        "cdi_path": os.path.join(settings.cdi_dir, contracts.CDI_SPEC_FILE),
        "device_dir": settings.device_dir,
    }


def _one_shot(args: argparse.Namespace, settings: config.Settings, environ: Mapping[str, str]) -> int:
    """--health-check, --upgrade-in-place, --check: one answer, then exit."""
    signals.restore_defaults()
    if args.health_check:
        from hyperlight_agent.host.healthcheck import health_check

        ok, line = health_check(_health_socket(_mode(settings), settings), args.health_check)
        print(line)
        return 0 if ok else 1
    if args.upgrade_in_place:
        from hyperlight_agent import parts
        from hyperlight_agent.host.upgrade import upgrade_in_place

        code, line = upgrade_in_place(
            args.upgrade_in_place,
            lambda: [p for m in modes.MODES for p in parts.row(m).instance_sockets(settings, m)],
        )
        print(line)
        return code
    from hyperlight_agent.diagnose import diagnose

    logging.getLogger("hyperlight_agent").setLevel(logging.ERROR)  # the report says it all
    ok, lines = diagnose(settings, _mode(settings), environ, device_only=args.check == "device")
    print("\n".join(lines))
    print("this node can serve Hyperlight" if ok else "this node cannot serve Hyperlight")
    return 0 if ok else 1


async def _serve(settings: config.Settings, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    from hyperlight_agent.agent import Agent

    agent = Agent(settings, _mode(settings), reload=lambda: config.load(args, environ), environ=environ)
    loop = asyncio.get_running_loop()
    signals.attach(loop, agent.stop, agent.reload, agent.upgrade)
    try:
        await agent.start()
        try:
            await agent.wait()
        except Exception as exc:
            # Why the agent stops is said before its shutdown says "stopping".
            _say_fatal(exc, settings)
            raise _Said() from exc
        finally:
            signals.stopping(loop)
            await agent.close()
    finally:
        signals.detach(loop)


def _health_socket(mode: modes.Mode, settings: config.Settings) -> str:
    """The mode's socket for our instance name; once in-place upgrades have put the agent under a
    name derived from ours (host/successor.py), the newest such instance's."""
    from hyperlight_agent import parts

    row = parts.row(mode)
    path = row.health_socket(settings, mode)
    if os.path.lexists(path):
        return path
    from hyperlight_agent.host.upgrade import descendant

    found = asyncio.run(
        descendant(settings.instance, mode.protocol.value, mode.resource, row.instance_sockets(settings, mode))
    )
    return found or path


def exit_now(code: int) -> NoReturn:
    """Leave at once with `code`, skipping the interpreter's teardown.

    By the time main() returns everything is done: the kubelet's stream ended, our socket is
    removed, the helper reaped, files written and fsynced. Tearing down the interpreter (grpc's
    threads, the garbage) still took 50–100 ms, and on a restart every one of them is time in which
    the kubelet has no healthy device; so only the output buffers are flushed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to say there
            stream.flush()
    os._exit(code)
