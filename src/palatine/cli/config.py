"""``palatine config``: every tunable, its value here and where that value came from.

One line per key of `palatine.config.Config`: the key, its ``PALATINE_*`` variable, the
effective value in this environment, and its source (``default`` or the variable that
set it). ``--json`` prints the same as one JSON document. A value that cannot be used is
a usage error naming the variable (exit 2), as it is for every role.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from palatine import config
from palatine.errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")


def run(args: argparse.Namespace) -> int:
    try:
        settings = config.describe()
    except ConfigError as e:
        print(f"palatine config: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            s.key: {"variable": s.variable, "value": s.value, "source": s.source} for s in settings
        }
        print(json.dumps(doc, indent=2))
        return 0
    rows = [(s.key, s.variable, _text(s.value), s.source) for s in settings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        f"{k:<{widths[0]}}  {v:<{widths[1]}}  {x:<{widths[2]}}  {src}" for k, v, x, src in rows
    ]
    try:
        print("\n".join(lines))
        sys.stdout.flush()
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return config.format_seconds(value)
    return str(value)
