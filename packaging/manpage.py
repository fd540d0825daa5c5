"""Render hyperlight-agent(8) from the same parser and settings table as `--help`.

python packaging/manpage.py > hyperlight-agent.8
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyperlight_agent import __version__, cli, config, contracts


def esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace("-", "\\-").replace("'", "\\(aq")


def render() -> str:
    parser = cli.build_parser()
    # A build of another version than the tree's (`make release VERSION=...`) names that one.
    version = os.environ.get("VERSION") or __version__
    out = [
        f'.TH HYPERLIGHT-AGENT 8 "" "hyperlight-agent {version}" "System Administration"',
        ".SH NAME",
        "hyperlight\\-agent \\- the hypervisor device for Hyperlight sandboxes on Kubernetes nodes",
        ".SH SYNOPSIS",
        ".B hyperlight\\-agent",
        "[\\fIOPTIONS\\fR]",
        ".SH DESCRIPTION",
        esc(cli.DESCRIPTION),
        ".SH OPTIONS",
    ]
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = ", ".join(action.option_strings)
        if action.choices:
            flag += "=" + "|".join(action.choices)
        elif action.metavar:
            flag += " " + str(action.metavar)
        out += [".TP", f"\\fB{esc(flag)}\\fR", esc(action.help or "")]
    out += [
        ".SH SETTINGS",
        "Each setting is a TOML key, an environment variable and a flag; a flag beats the "
        "environment, which beats the file, which beats the default.",
    ]
    for s in config.SETTINGS:
        out += [
            ".TP",
            f"\\fB{esc(s.key)}\\fR (\\fB{esc(s.env_text)}\\fR, \\fB{esc(s.flag)}\\fR; default {esc(s.default_text)})",
            esc(s.help),
        ]
    out += [
        ".SH FILES",
        ".TP",
        f"\\fI{esc(config.DEFAULT_CONFIG_FILE)}\\fR",
        "Settings (TOML); a missing file is fine.",
        ".TP",
        f"\\fI{esc(contracts.KUBELET_PLUGIN_DIR)}/{esc(contracts.PLUGIN_SOCKET)}\\fR",
        "The plugin's socket, registered with the kubelet.",
        ".TP",
        f"\\fI{esc(contracts.CDI_DIR)}/{esc(contracts.CDI_SPEC_FILE)}\\fR",
        "The CDI spec the agent owns and keeps exact. It is kept when the agent stops; remove it by hand "
        "after uninstalling.",
        ".SH SIGNALS",
        ".TP",
        "\\fBSIGTERM\\fR, \\fBSIGINT\\fR",
        "Stop gracefully within a bounded grace; the socket is removed.",
        ".TP",
        "\\fBSIGHUP\\fR",
        "Re-read the settings file; an invalid file is refused and the running settings kept "
        "(settings that change only on a restart keep their running value).",
        ".TP",
        "\\fBSIGUSR2\\fR",
        "Under systemd: upgrade in place. Start the code and settings installed now as a "
        "new process, hand the kubelet and the unit over to it once it is registered and ready "
        "(MAINPID=), and exit; if it fails, serve on. \\fB--upgrade-in-place\\fR sends it and waits for the "
        "outcome; the unit's reload and the package upgrades use that.",
        ".SH EXIT STATUS",
        "0 after a clean stop or a passing check; 1 on a runtime failure or a failing check; "
        "2 on a usage or configuration error; with \\fB--upgrade-in-place\\fR, 1 when the upgrade failed "
        "(the running agent serves on) and 3 when the process cannot upgrade in place.",
        ".SH SEE ALSO",
        "\\fBsystemctl\\fR(1), \\fBsystemd.exec\\fR(5), \\fBkubelet\\fR(8)",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
