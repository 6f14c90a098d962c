"""The package's modules import one way (data → encoders → losses → methods → evaluation / export →
CLI): no import circle.

Read from the source with `ast`, without importing anything. What counts as an import:
- every `import` / `from … import` statement, at module level AND inside functions: a lazy import
  only postpones the circle to the first call (and hides it from a module-level check);
- importing `a.b.c` also runs the packages `a.b` above it (their `__init__`), so those count too;
- imports under `if TYPE_CHECKING:` count as well: a type checker follows them, and an annotation that
  needs a module above names a protocol or a base class instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_sentemb

PACKAGE = Path(lightning_sentemb.__file__).parent
NAME = PACKAGE.name


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool, known: dict) -> set[str]:
    """The package's modules that importing (or calling into) `name` runs."""
    tree = ast.parse(path.read_text(), str(path))
    here = name.split(".") if is_package else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    ran = set()
    for target in targets:
        if not (target == NAME or target.startswith(NAME + ".")):
            continue
        while target not in known:
            target = target.rpartition(".")[0]
        parts = target.split(".")
        ran.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))  # the packages above run too
    # a module's own packages are already running when it runs
    return {m for m in ran if m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, is_package, known) for name, (path, is_package) in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, …, a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " → ".join(cycle)


def test_the_checker_finds_a_lazy_cycle_and_counts_type_checking(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # a function-level import counts, and so does one under TYPE_CHECKING (`export` reads methods through a
    # protocol, and the methods' hooks annotate their method as a `LightningModule`)
    module = tmp_path / "annotated.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .methods.base import SentEmbMethod\n")
    assert "lightning_sentemb.methods.base" in imports_of(f"{NAME}.annotated", module, False, modules())
    graph = import_graph()
    assert not any(m.startswith("lightning_sentemb.methods") for m in graph["lightning_sentemb.export.model_card"])
    assert "lightning_sentemb.checkpoint_file" in graph["lightning_sentemb.console"]  # a lazy import inside fit_summary


def test_exports_and_checkpoint_reading_sit_below_the_methods() -> None:
    """Exports take a method through `export.protocol.ExportableMethod`; the console and the checkpoint
    reader never import what builds methods; `loading` (which the methods' guide uses) finds method classes
    by name and builds them with `build.build_method`, importing no method."""
    graph = import_graph()
    below = ("lightning_sentemb.export", "lightning_sentemb.console", "lightning_sentemb.checkpoint_file")
    for name, imported in graph.items():
        if name.startswith(below):
            above = {m for m in imported if m.startswith(("lightning_sentemb.methods", "lightning_sentemb.loading"))}
            assert not above, f"{name} imports {sorted(above)}"
    assert not {m for m in graph["lightning_sentemb.loading"] if m.startswith("lightning_sentemb.methods")}
