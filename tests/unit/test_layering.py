"""The package's folders are its layers: imports go only downward, and nothing imports in a circle.

One test walks every module's imports (function-level ones and those made only for type
annotations under ``if TYPE_CHECKING:`` too) and fails on an import of a higher layer;
another fails on any cycle between modules, a package's ``__init__`` included. A type
named across layers is a dependency like any other: where a lower module must name
something built above it, it names a small protocol of its own (`ProcLink`, `MeshView`).
"""

from __future__ import annotations

import ast
import re
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
    (6, ("protocol", "rdma")),
    (7, ("hosting",)),
    (8, ("system",)),
    (9, ("tensor",)),
    (10, ("job", "spmd")),
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


# -- the documented layers -------------------------------------------------------------------

DOC = ROOT.parents[1] / "docs" / "architecture.md"
_TABLE_HEAD = "| layer | folder | imports |"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|(.*)\|\s*$")
_DOC_LINE = re.compile(r"^\s+(\d+)\.\s+(\w+(?:,\s*\w+)*)\s*$")
_DIAGRAM_ROW = re.compile(r"^\s{0,3}(\d{1,2})\s{2}(\w+(?:\s+\w+)*?)\s+│")


def folder_imports() -> dict[str, set[str]]:
    """Which top-level entries of the package (folders, ``__main__``) import which others,
    the package facade and ``testing`` left out."""
    table: dict[str, set[str]] = {names: set() for _, group in LAYERS for names in group}
    for module, targets in graph().items():
        if layer_of(module) is None:
            continue
        mine = module.split(".")[1]
        for target in targets:
            if layer_of(target) is not None and (theirs := target.split(".")[1]) != mine:
                table[mine].add(theirs)
    return table


def doc_table(text: str) -> tuple[list[tuple[int, tuple[str, ...]]], dict[str, set[str]]]:
    """The layers and the import table of architecture.md's table headed ``_TABLE_HEAD``:
    one row per folder, ``| layer | `folder` | `a`, `b` |`` (``—`` for none)."""
    lines = text.splitlines()
    assert _TABLE_HEAD in lines, f"{DOC.name}: no table headed {_TABLE_HEAD!r}"
    start = lines.index(_TABLE_HEAD) + 2
    layers: dict[int, list[str]] = {}
    imports: dict[str, set[str]] = {}
    for number, line in enumerate(lines[start:], start + 1):
        if not line.startswith("|"):
            break
        row = _ROW.match(line)
        assert row, f"{DOC.name}:{number}: not a row of the layer table: {line!r}"
        level, folder, cell = int(row[1]), row[2], row[3]
        layers.setdefault(level, []).append(folder)
        imports[folder] = set(re.findall(r"`([\w.]+)`", cell))
    return [(level, tuple(names)) for level, names in sorted(layers.items())], imports


def diagram_layers(text: str) -> list[tuple[int, tuple[str, ...]]]:
    """The layers of the drawing (top down) in architecture.md's section on layers, bottom up."""
    section = text.split("## 3. The layers of the package", 1)[-1].split("```", 2)[1]
    rows = [_DIAGRAM_ROW.match(line) for line in section.splitlines()]
    return [(int(m[1]), tuple(m[2].split())) for m in rows if m][::-1]


def docstring_layers(doc: str) -> list[tuple[int, tuple[str, ...]]]:
    """The ``N. a, b`` lines of the package docstring."""
    out = []
    for line in doc.splitlines():
        if m := _DOC_LINE.match(line):
            out.append((int(m[1]), tuple(n.strip() for n in m[2].split(","))))
    return out


def layer_mismatches(
    where: str, theirs: list[tuple[int, tuple[str, ...]]], ours: list[tuple[int, tuple[str, ...]]]
) -> list[str]:
    mine = {level: set(names) for level, names in ours}
    other = {level: set(names) for level, names in theirs}
    out = []
    for level in sorted(mine.keys() | other.keys()):
        a, b = mine.get(level, set()), other.get(level, set())
        if a != b:
            out.append(f"layer {level}: LAYERS has {sorted(a)}, {where} has {sorted(b)}")
    if [level for level, _ in theirs] != sorted(other):
        out.append(f"{where}: layers not listed bottom up: {[level for level, _ in theirs]}")
    return out


def table_mismatches(documented: dict[str, set[str]], actual: dict[str, set[str]]) -> list[str]:
    out = []
    for folder in sorted(documented.keys() | actual.keys()):
        if folder not in documented:
            out.append(f"{folder}: no row in the table (it imports {sorted(actual[folder])})")
        elif folder not in actual:
            out.append(f"{folder}: a row in the table, but no such folder in LAYERS")
        elif documented[folder] != actual[folder]:
            missing = sorted(actual[folder] - documented[folder])
            extra = sorted(documented[folder] - actual[folder])
            said = [f"imports {missing}, not in its row"] if missing else []
            said += [f"does not import {extra}, named in its row"] if extra else []
            out.append(f"{folder}: " + "; ".join(said))
    return out


def documented_layer_mismatches(doc: str, docstring: str) -> list[str]:
    """Where architecture.md's table and drawing, or the package docstring, differ from
    `LAYERS` and the imports of the code."""
    layers, imports = doc_table(doc)
    wrong = layer_mismatches(f"{DOC.name}'s table", layers, LAYERS)
    wrong += [f"{DOC.name}: {w}" for w in table_mismatches(imports, folder_imports())]
    folders = [(level, tuple(n for n in names if n != "__main__")) for level, names in LAYERS]
    wrong += layer_mismatches(f"{DOC.name}'s drawing", diagram_layers(doc), folders)
    wrong += layer_mismatches("palatine's docstring", docstring_layers(docstring), LAYERS)
    return wrong


def test_documented_layers_match_the_code() -> None:
    wrong = documented_layer_mismatches(DOC.read_text(), palatine.__doc__ or "")
    assert not wrong, "the documented layers differ from the code:\n" + "\n".join(wrong)


def test_the_layer_checks_catch_a_broken_fact() -> None:
    doc, docstring = DOC.read_text(), palatine.__doc__ or ""

    def broken(old: str, new: str, *, in_doc: bool = True) -> list[str]:
        text = doc if in_doc else docstring
        assert text.count(old) == 1, old
        text = text.replace(old, new)
        return documented_layer_mismatches(*((text, docstring) if in_doc else (doc, text)))

    # the docstring putting tensor below system
    assert broken(
        "    8. system\n    9. tensor\n", "    8. tensor\n    9. system\n", in_doc=False
    ) == [
        "layer 8: LAYERS has ['system'], palatine's docstring has ['tensor']",
        "layer 9: LAYERS has ['tensor'], palatine's docstring has ['system']",
    ]
    # a row leaving out an import the code makes, and one naming an import it does not
    assert broken("| 10 | `job` | `channel`, ", "| 10 | `job` | ") == [
        f"{DOC.name}: job: imports ['channel'], not in its row"
    ]
    assert broken(
        "| 1 | `wire` | `errors`, `ids` |", "| 1 | `wire` | `core`, `errors`, `ids` |"
    ) == [f"{DOC.name}: wire: does not import ['core'], named in its row"]
    # a folder in the wrong layer of the table, a folder missing from it
    assert broken("| 4 | `fastpath` |", "| 5 | `fastpath` |") == [
        f"layer 4: LAYERS has ['fastpath'], {DOC.name}'s table has []",
        f"layer 5: LAYERS has ['mesh'], {DOC.name}'s table has ['fastpath', 'mesh']",
    ]
    row = next(line for line in doc.splitlines() if line.startswith("| 4 | `fastpath` |"))
    assert f"{DOC.name}: fastpath: no row in the table" in "\n".join(broken(row + "\n", ""))
    # the drawing with two layers swapped
    assert broken("  9  tensor ", "  9  cli    ")[:1] == [
        f"layer 9: LAYERS has ['tensor'], {DOC.name}'s drawing has ['cli']"
    ]
