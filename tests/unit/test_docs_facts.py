"""The facts README.md and docs/ state about the code are true.

Four scanners, each yielding ``file:line: ...`` for every mismatch:

* `command_mismatches`: every ``palatine SUBCOMMAND [--flag ...]`` in a code span or a
  shell code block names a subcommand of the real argparse parser, every ``--flag``
  after it is a flag of that subcommand, and a code span that is a ``--flag`` alone is
  a flag of some subcommand;
* `variable_mismatches`: every ``PALATINE_*`` name is a variable the code reads (a config
  key's, a `Handoff` field's, or a name written out in the source);
* `module_mismatches`: every dotted ``palatine.x.y`` (or ``palatine.x.y.Name``, and the
  ``.z`` siblings listed after it in the same line) imports or resolves, or is the name a
  class registers under (``__palatine_name__``);
* `extra_mismatches`: every ``palatine[extra]`` (and ``pip install '.[extra]'``) names an
  extra of pyproject.toml, in the docs and in the source's strings alike.

Each scanner has a test of its own that feeds it a broken line and sees it flagged.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import palatine
from palatine import config
from palatine.hosting.child_env import Handoff

SRC = Path(palatine.__file__).parent
REPO = SRC.parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# -- reading markdown --------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
# code blocks in these languages hold no shell commands
_NOT_SHELL = {"python", "py", "pycon", "toml", "json", "yaml", "ini", "text", "diff", "c"}


def code_blocks(text: str) -> Iterator[tuple[int, str, str]]:
    """``(first line number, language, body)`` of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m[2], m[3].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        yield i + 2, lang, "\n".join(body)
        i = j + 1


def without_blocks(text: str) -> str:
    """The text with every fenced block's lines blanked (line numbers kept)."""
    out: list[str] = []
    fence = ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = ""
            out.append("")
        elif m:
            fence = m[2]
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, content)`` of each inline code span (one may run over a line end)."""
    prose = without_blocks(text)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S):
        yield prose.count("\n", 0, m.start()) + 1, m[2].replace("\n", " ")


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, logical line)`` of shell code blocks: a line ending in ``\\`` and an
    indented line that goes on with ``[`` or ``-`` (a usage summary) join the line above."""
    for first, lang, body in code_blocks(text):
        if lang in _NOT_SHELL:
            continue
        logical: list[tuple[int, str]] = []
        joining = False
        for k, line in enumerate(body.splitlines()):
            goes_on = line[:1].isspace() and line.lstrip()[:1] in ("[", "-")
            if logical and (joining or goes_on):
                number, head = logical[-1]
                logical[-1] = (number, head.rstrip("\\ ") + " " + line.strip())
            else:
                logical.append((first + k, line))
            joining = line.rstrip().endswith("\\")
        yield from logical


def doc_files() -> Iterator[tuple[str, str]]:
    for path in DOCS:
        yield str(path.relative_to(REPO)), path.read_text()


# -- (a) subcommands and their flags -------------------------------------------------------------


def cli_parser() -> dict[str, set[str]]:
    """Each subcommand of ``palatine`` and its option strings, from the parsers the CLI
    builds (`palatine.cli.main` adds only the chosen subcommand's arguments; here all)."""
    from palatine import cli

    parser = argparse.ArgumentParser(prog="palatine")
    sub = parser.add_subparsers(dest="command")
    out: dict[str, set[str]] = {}
    for name, (module, help_text) in cli._COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p)
        out[name] = set(p._option_string_actions)
    return out


_COMMAND = re.compile(r"(?<![\w./\[-])palatine\s+(?![-.])(\S+)")
_TOKEN = re.compile(r"\"[^\"]*\"|'[^']*'|\S+")
_ENDS = {"|", "||", "&", "&&", ";", "--", ">", "2>", "<"}


def commands_in(line: str) -> Iterator[tuple[list[str], list[str]]]:
    """``(subcommands, flags)`` of each ``palatine SUB ...`` in a line of shell or a code
    span: ``a|b`` names two subcommands; the flags run to the end of the command (a shell
    operator, ``--``, a comment, or a quote that closes around the command)."""
    for m in _COMMAND.finditer(line):
        before = line[: m.start()].rstrip()
        if before.endswith(("import", "install", "from")):
            continue
        word = m[1]
        closing = re.search(r"[\"'`)]", word)
        subs = re.sub(r"[\"'`),;:.]+.*$", "", word)
        if not re.fullmatch(r"[a-z][a-z-]*(?:\|[a-z][a-z-]*)*", subs):
            continue  # a placeholder (``palatine COMMAND``), not a subcommand
        flags: list[str] = []
        if not closing:
            for token in _TOKEN.findall(line[m.end() :]):
                if token in _ENDS or token.startswith("#"):
                    break
                if token[0] in "\"'`":
                    if len(token) > 1 and token[-1] == token[0]:
                        continue  # a quoted argument
                    break  # the quote this command stands in closes
                flag = re.match(r"[\[(]*(--[a-z][a-z0-9-]*)", token)
                if flag:
                    flags.append(flag[1])
                if re.search(r"[\"'`]", token):
                    break
        yield subs.split("|"), flags


def command_mismatches(files: Iterator[tuple[str, str]], parsers: dict[str, set[str]]) -> list[str]:
    out = []
    every_flag = set().union(*parsers.values())
    for name, text in files:
        spans = [*code_spans(text)]
        for number, span in spans:  # `--flag` or `--flag VALUE` alone: some subcommand's
            alone = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =].*)?", span)
            if alone and alone[1] not in every_flag:
                out.append(f"{name}:{number}: `{alone[1]}`: no subcommand has this flag")
        for number, line in [*spans, *shell_lines(text)]:
            for subs, flags in commands_in(line):
                for sub in subs:
                    if sub not in parsers:
                        out.append(f"{name}:{number}: `palatine {sub}`: no such subcommand")
                        continue
                    for flag in flags:
                        if flag not in parsers[sub]:
                            out.append(f"{name}:{number}: `palatine {sub} {flag}`: no such flag")
    return out


# -- (b) PALATINE_* variables ---------------------------------------------------------------------

_VARIABLE = re.compile(r"\bPALATINE_[A-Z0-9_]*(?:[A-Z0-9]|_\*|\*)|\bPALATINE_\b")


def known_variables() -> set[str]:
    """What the code reads: each config key's variable, each `Handoff` field's, and every
    string in the source that is a whole ``PALATINE_*`` name (docstrings aside)."""
    out = {config.env_var(key) for key in config.Config.__struct_fields__}
    out |= {Handoff.variable(field) for field in Handoff.__struct_fields__}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Expr):
                continue  # a docstring (its text is not a read)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Constant) and re.fullmatch(
                    r"PALATINE_[A-Z0-9_]*[A-Z0-9]", str(child.value)
                ):
                    out.add(str(child.value))
    return out


def variable_mismatches(files: Iterator[tuple[str, str]], known: set[str]) -> list[str]:
    out = []
    for name, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for m in _VARIABLE.finditer(line):
                var = m[0]
                if var.endswith("*") or var.endswith("_"):  # a family: PALATINE_TLS_*
                    prefix = var.rstrip("*")
                    if not any(k.startswith(prefix) for k in known):
                        out.append(f"{name}:{number}: {var}: no variable is named so")
                elif var not in known:
                    out.append(f"{name}:{number}: {var}: the code reads no such variable")
    return out


# -- (c) module paths -----------------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w./@-])palatine(?:\.[A-Za-z_]\w*)+(?![\w/-])")
_SIBLING = re.compile(r"`\.([A-Za-z_]\w*)`")


def instance_attribute(cls: type, attr: str) -> bool:
    """Whether ``cls`` (or a base) sets or declares ``self.<attr>``."""
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=", source):
            return True
    return False


def unresolved(dotted: str) -> str | None:
    """Why ``palatine.a.b.Name.attr`` does not resolve (None where it does): the longest
    importable module, then attributes."""
    parts = dotted.split(".")
    if "__main__" in parts:  # importing it would run the CLI
        found = SRC.joinpath(*parts[1 : parts.index("__main__")], "__main__.py").is_file()
        return None if found and parts[-1] == "__main__" else "no such module or name"
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):
                continue  # no such module: try its parent
            return f"{module} fails to import: {e!r}"
        except Exception as e:  # noqa: BLE001 - the mismatch says why
            return f"{module} fails to import: {e!r}"
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                if isinstance(obj, type) and instance_attribute(obj, attr):
                    return None
                return "no such module or name"
            obj = getattr(obj, attr)
        return None
    return "no such module or name"


def registered_names() -> set[str]:
    """The names classes register under (``__palatine_name__``: actor types, wire types),
    which the docs may name as they are sent, not as they are imported."""
    constants: dict[str, str] = {}
    given: list[ast.expr] = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                        constants[target.id] = node.value.value
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__palatine_name__"
                        for t in stmt.targets
                    ):
                        given.append(stmt.value)
    out = set()
    for value in given:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.add(value.value)
        elif isinstance(value, ast.Name) and value.id in constants:
            out.add(constants[value.id])
    return out


def module_mismatches(
    files: Iterator[tuple[str, str]], registered: frozenset[str] = frozenset()
) -> list[str]:
    out = []
    seen: dict[str, str | None] = {name: None for name in registered}
    for name, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for m in _DOTTED.finditer(line):
                paths = [m[0]]
                # `palatine.system.registry`, `.worlds`: siblings of the path before them
                rest = line[m.end() :]
                stop = _DOTTED.search(rest)
                for sibling in _SIBLING.finditer(rest[: stop.start() if stop else None]):
                    paths.append(m[0].rpartition(".")[0] + "." + sibling[1])
                for path in paths:
                    if path not in seen:
                        seen[path] = unresolved(path)
                    if seen[path]:
                        out.append(f"{name}:{number}: {path}: {seen[path]}")
    return out


# -- (d) extras -----------------------------------------------------------------------------------

_EXTRA = re.compile(r"palatine\[([a-z][a-z0-9_,\s-]*)\]|(?<![\w/])\.\[([a-z][a-z0-9_,\s-]*)\]")


def known_extras() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


def source_files() -> Iterator[tuple[str, str]]:
    for path in sorted(SRC.rglob("*.py")):
        yield str(path.relative_to(REPO)), path.read_text()


def extra_mismatches(files: Iterator[tuple[str, str]], extras: set[str]) -> list[str]:
    out = []
    for name, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for m in _EXTRA.finditer(line):
                if m[2] is not None and "pip install" not in line:
                    continue  # ``.[`` outside an install line is not an extra
                for extra in (m[1] or m[2]).split(","):
                    if extra.strip() not in extras:
                        out.append(f"{name}:{number}: palatine[{extra.strip()}]: no such extra")
    return out


# -- the tests ------------------------------------------------------------------------------------


def test_commands_and_flags_exist() -> None:
    wrong = command_mismatches(doc_files(), cli_parser())
    assert not wrong, "commands the docs name that the CLI lacks:\n" + "\n".join(wrong)


def test_variables_exist() -> None:
    wrong = variable_mismatches(doc_files(), known_variables())
    assert not wrong, "variables the docs name that the code does not read:\n" + "\n".join(wrong)


def test_module_paths_resolve() -> None:
    wrong = module_mismatches(doc_files(), frozenset(registered_names()))
    assert not wrong, "module paths the docs name that do not resolve:\n" + "\n".join(wrong)


def test_extras_exist() -> None:
    wrong = extra_mismatches(iter([*doc_files(), *source_files()]), known_extras())
    assert not wrong, "extras named that pyproject.toml lacks:\n" + "\n".join(wrong)


def one(text: str) -> Iterator[tuple[str, str]]:
    return iter([("doc.md", text)])


def test_a_wrong_subcommand_or_flag_is_flagged() -> None:
    parsers = cli_parser()
    assert not command_mismatches(one("Run `palatine stacks --native --json`.\n"), parsers)
    assert command_mismatches(one("Run `palatine stacks --natve`.\n"), parsers) == [
        "doc.md:1: `palatine stacks --natve`: no such flag"
    ]
    assert command_mismatches(one("`palatine snapshots`\n"), parsers) == [
        "doc.md:1: `palatine snapshots`: no such subcommand"
    ]
    assert command_mismatches(one("a `palatine system|hots` b\n"), parsers) == [
        "doc.md:1: `palatine hots`: no such subcommand"
    ]
    # a flag of another subcommand, a usage line going on below, a command in quotes
    block = (
        "text\n\n```\n"
        "palatine stop --system-addr ADDR [--world W ...]\n"
        "               [--json]\n"
        "palatine controller --program 'python -m palatine worker --once' \\\n"
        "    --is-cpu-worker --no-such-flag\n"
        "palatine launch --hosts 2 -- python train.py --steps 3   # --anything\n"
        "```\n"
    )
    assert command_mismatches(one(block), parsers) == [
        "doc.md:4: `palatine stop --json`: no such flag",
        "doc.md:6: `palatine controller --no-such-flag`: no such flag",
        "doc.md:6: `palatine worker --once`: no such flag",
    ]
    assert command_mismatches(one("goes on (`--submit` submits) `--stimuli W`\n"), parsers) == (
        []
        if "--stimuli" in parsers["snapshot"]
        else ["doc.md:1: `--stimuli`: no subcommand has this flag"]
    )
    assert command_mismatches(one("`--natve`\n"), parsers) == [
        "doc.md:1: `--natve`: no subcommand has this flag"
    ]
    # python code and prose are not commands
    python = "```python\nfrom palatine import remote\n```\npalatine is a runtime\n"
    assert not command_mismatches(one(python), parsers)


def test_a_wrong_variable_is_flagged() -> None:
    known = known_variables()
    assert "PALATINE_CALL_TIMEOUT" in known and "PALATINE_CALL_TIMEOUT_S" not in known
    text = "`PALATINE_CALL_TIMEOUT_S` and `PALATINE_TLS_*` and `PALATINE_NOPE_*`\n"
    assert variable_mismatches(one(text), known) == [
        "doc.md:1: PALATINE_CALL_TIMEOUT_S: the code reads no such variable",
        "doc.md:1: PALATINE_NOPE_*: no variable is named so",
    ]


def test_a_wrong_module_path_is_flagged() -> None:
    text = (
        "| wire | `palatine.wire.frames`, `.detection`, `.handshake` | x |\n"
        "See palatine.core.actor.current_rank and palatine.core.actor.no_such_name.\n"
        "`palatine.core.proc.Proc.counters` is set in `__init__`.\n"
        "A label `world.palatine.dev/worker` is no module.\n"
    )
    registered = frozenset(registered_names())
    assert "palatine.tensor.controller.ControllerActor" in registered
    text += "Registered as `palatine.tensor.controller.ControllerActor`, `palatine.nope.Actor`.\n"
    assert module_mismatches(one(text), registered) == [
        "doc.md:1: palatine.wire.detection: no such module or name",
        "doc.md:2: palatine.core.actor.no_such_name: no such module or name",
        "doc.md:5: palatine.nope.Actor: no such module or name",
    ]


def test_a_wrong_extra_is_flagged() -> None:
    text = "pip install 'palatine[debug]' or pip install -e '.[test,nope]'; worker[3] is a rank\n"
    assert extra_mismatches(one(text), {"test", "torch"}) == [
        "doc.md:1: palatine[debug]: no such extra",
        "doc.md:1: palatine[nope]: no such extra",
    ]
    src = "    print(\"(pip install 'palatine[debug]' for native frames)\")\n"
    assert extra_mismatches(iter([("stacks.py", src)]), {"test"}) == [
        "stacks.py:1: palatine[debug]: no such extra"
    ]


def test_current_rank_is_annotated_as_the_point_the_docs_promise() -> None:
    import typing

    from palatine.core.shape import Point

    returned = typing.get_type_hints(palatine.current_rank)["return"]
    assert Point in typing.get_args(returned) or returned is Point
