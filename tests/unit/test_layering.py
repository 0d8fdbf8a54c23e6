"""Layers import strictly downward (60-style.md): one test walks every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import palatine

ROOT = Path(palatine.__file__).parent

# Lower number = lower layer. A module may import its own layer and those below.
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("errors", "ids", "config", "console", "limits", "logs")),
    (1, ("wire",)),
    (2, ("channel",)),
    (3, ("mailbox", "router")),
    (4, ("actor", "instance", "proc", "comm", "future", "runtime", "supervision_hook")),
    (5, ("mesh", "lane", "lane_calls", "lane_conn")),
    (
        6,
        (
            "supervision",
            "children",
            "child_proc",
            "child_env",
            "forkserver",
            "forkserver_main",
            "debug",
            "heartbeat",
        ),
    ),
    (7, ("system", "agent", "host")),
    (8, ("hostmesh",)),
    (9, ("controller", "worker")),
    (10, ("client", "serve", "serve_pipes")),
    (11, ("cli", "__main__", "demo")),
]


def layer_of(module: str) -> int | None:
    """The layer of ``palatine.<first>...`` (None for the package itself and testing)."""
    parts = module.split(".")
    if parts[0] != "palatine" or len(parts) == 1:
        return None
    first = parts[1]
    if first == "testing":
        return None
    for level, names in LAYERS:
        if first in names:
            return level
    raise AssertionError(f"module palatine.{first} is in no layer; add it to LAYERS")


def imports_of(path: Path, module: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out: list[str] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")[: len(module.split(".")) - node.level + 1]
                out.append(".".join([*base, node.module or ""]).rstrip("."))
            elif node.module:
                out.append(node.module)
    return [m for m in out if m.startswith("palatine")]


def test_every_import_goes_downward() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        mine = layer_of(module)
        if mine is None:
            continue
        for target in imports_of(path, module):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "upward imports:\n" + "\n".join(upward)
