"""The ``palatine`` command line: one module per subcommand.

argparse, imported lazily per subcommand, because worker procs start often and must
import fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "version"]

# subcommand -> (module, help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "system": ("palatine.cli.system", "run the system (registry of worlds and procs)"),
    "host": ("palatine.cli.host", "run a host that starts the procs of a world"),
    "worker": ("palatine.cli.worker", "run a proc that joins a world and waits for spawns"),
    "controller": ("palatine.cli.controller", "create the worker world and run its controller"),
    "serve": ("palatine.cli.serve", "run system/host/controller roles on JSON-lines requests"),
    "ps": ("palatine.cli.ps", "list this user's live jobs on this machine (ids for --job)"),
    "snapshot": ("palatine.cli.snapshot", "print the worlds and procs of a running system"),
    "stacks": ("palatine.cli.stacks", "print the Python stacks of a running job's procs"),
    "top": ("palatine.cli.top", "a live view of a running system's worlds and procs"),
    "dashboard": ("palatine.cli.dashboard", "serve a job's live web page (link with a token)"),
    "stop": ("palatine.cli.stop", "stop worlds (or everything) of a running system"),
    "launch": ("palatine.cli.launch", "run a client program against a job on Slurm or locally"),
    "job": ("palatine.cli.job", "status or cancel of a Slurm job that palatine launched"),
    "demo": (
        "palatine.cli.demo",
        "train a small model data-parallel on a local mesh (or a launched job)",
    ),
    "torchrun": (
        "palatine.cli.torchrun",
        "run a torchrun script on a local mesh, torchrun's flags",
    ),
    "config": ("palatine.cli.config", "print the effective configuration and where it came from"),
    "doctor": ("palatine.cli.doctor", "check this machine for what jobs need, and say what to do"),
}


def version() -> str:
    """The installed package's version (``unknown`` when run from a tree never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("palatine")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``palatine`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="palatine", description="palatine distributed runtime")
    parser.add_argument("--version", action="version", version=f"palatine {version()}",
                        help="print palatine's version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    args_list = sys.argv[1:] if argv is None else argv
    name = next((a for a in args_list if not a.startswith("-")), None)
    for cmd, (mod, help_text) in _COMMANDS.items():
        p = sub.add_parser(cmd, help=help_text, description=help_text)
        if cmd == name:
            importlib.import_module(mod).add_arguments(p)
    args = parser.parse_args(args_list)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(module.run(args) or 0)
