"""The command line explains itself: every flag of every subcommand has help text, and
``palatine --version`` says the version."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from palatine.cli import _COMMANDS, version


def flags_without_help(p: argparse.ArgumentParser, where: str) -> list[str]:
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += flags_without_help(sub, f"{where} {name}")
        elif action.option_strings and not action.help and action.help != argparse.SUPPRESS:
            out.append(f"{where} {'/'.join(action.option_strings)}")
    return out


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_every_flag_of_every_subcommand_has_help(command: str) -> None:
    p = argparse.ArgumentParser(prog=f"palatine {command}")
    importlib.import_module(_COMMANDS[command][0]).add_arguments(p)
    assert flags_without_help(p, f"palatine {command}") == []


def test_version_prints_the_installed_version() -> None:
    out = subprocess.run([sys.executable, "-m", "palatine", "--version"], capture_output=True,
                         text=True, timeout=30, check=True)  # fmt: skip
    assert out.stdout.strip() == f"palatine {version()}"
    assert version() != "unknown"
