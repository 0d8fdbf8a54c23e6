"""The package's folders are its layers: imports go only downward, and nothing imports in a circle.

One test walks every module's imports (function-level ones and those made only for type
annotations under ``if TYPE_CHECKING:`` too) and fails on an import of a higher layer;
another fails on any cycle between modules, a package's ``__init__`` included. A type
named across layers is a dependency like any other: where a lower module must name
something built above it, it names a small protocol of its own (`ProcLink`, `MeshView`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import palatine

ROOT = Path(palatine.__file__).parent

# Lower number = lower layer. A module may import its own layer and those below.
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("errors", "ids", "config", "output")),
    (1, ("wire",)),
    (2, ("channel",)),
    (3, ("core",)),
    (4, ("fastpath",)),
    (5, ("mesh",)),
    (6, ("protocol",)),
    (7, ("hosting",)),
    (8, ("system",)),
    (9, ("tensor",)),
    (10, ("job",)),
    (11, ("cli", "__main__")),
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


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def imports_of(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The palatine modules ``module`` imports (``from pkg import sub`` counts as importing
    the submodule ``pkg.sub``, not what ``pkg/__init__`` defines)."""
    tree = ast.parse(path.read_text(), str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & known.keys()
            targets |= submodules
            if len(submodules) < len(node.names):  # a name defined in the module itself
                targets.add(target)
    out = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target.startswith("palatine.") and target != module:
            out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(p, m, known) for m, p in known.items()}


def test_every_import_goes_downward() -> None:
    upward = []
    for module, targets in sorted(graph().items()):
        mine = layer_of(module)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_module_imports_itself_in_a_circle() -> None:
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
