"""Command line: parse, configure, run. main() is the only place that picks an exit code.

Exit codes: 0 clean stop (or check passed), 1 check failed or fatal runtime error,
2 usage or configuration error (one line on stderr naming the setting and value).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Mapping, NoReturn, Optional, Sequence

from . import __version__, config

PROG = "hyperlight-agent"
DESCRIPTION = (
    "Kubernetes device plugin for Hyperlight sandboxes: detects /dev/mshv or /dev/kvm, proves it "
    "usable with a bounded kernel-level check, advertises hyperlight.dev/hypervisor slots to the "
    "kubelet and keeps the CDI spec hyperlight.json exactly right."
)
EPILOG = (
    "Exit status: 0 on a clean stop, 1 on a runtime failure, 2 on a usage or configuration error. "
    "SIGTERM or SIGINT stops gracefully; the CDI spec is kept."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        raise config.ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--device-access", action="store_true",
        help="bootstrap mode: advertise one hyperlight.dev/device-access slot on "
        "hyperlight-access.sock that grants the raw device (DeviceSpec only; never opens it)",
    )
    config.add_arguments(parser)
    return parser


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    # Warnings about lenient environment values must be visible before settings are known.
    setup_logging("info")
    try:
        args = build_parser().parse_args(argv)
        settings = config.load(args, environ)
    except config.ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    from .agent import Agent  # grpc is imported only for the long-running modes

    agent = Agent(settings, device_access=args.device_access)
    try:
        asyncio.run(agent.run())
    except Exception as exc:  # the one place a fatal runtime error becomes an exit code
        logging.getLogger(PROG).error("fatal: %s", exc, exc_info=settings.log_level == "debug")
        return 1
    return 0


def main_exit() -> NoReturn:
    """Console-script entry point."""
    sys.exit(main())
