"""The package's layout promises (README "Layout", ../shared/DESIGN.md): small modules, imports
that point one way, and a public API of what readers use.

These read the source with :mod:`ast`, so they hold for imports inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tutorial_pkg as tp

PACKAGE = Path(tp.__file__).resolve().parent
MAX_LINES = 750  # "no module over ~700 lines"


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def _package_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (``from .x import``, ``from . import x``, absolute)."""
    names = set(_modules())
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1 and not mod:  # from . import x, y
                found |= {a.name for a in node.names if a.name in names}
            elif node.level == 1:
                found.add(mod.split(".")[0])
            elif mod.startswith("tutorial_pkg."):
                found.add(mod.split(".")[1])
            elif mod == "tutorial_pkg":
                found |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tutorial_pkg."):
                    found.add(a.name.split(".")[1])
    return found & names


def test_no_module_over_the_size_limit():
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_package_imports_form_no_cycle():
    graph = {name: _package_imports(p) - {name} for name, p in _modules().items()}
    # depth-first search for a back edge; report the cycle it closes
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert cycles == []


def test_public_api_has_what_readers_use_and_no_backend_internals():
    assert "TinyLM" in tp.__all__ and tp.TinyLM is __import__("tutorial_pkg.model").model.TinyLM
    internals = {"auto_key_bias", "sdpa_key_bias", "flex_blocker", "cached_tensors",
                 "cached_key_bias"}
    assert internals.isdisjoint(tp.__all__)
    assert all(not name.startswith("_") for name in tp.__all__)
    assert sorted(set(tp.__all__)) == sorted(tp.__all__)  # no duplicates
    assert all(hasattr(tp, name) for name in tp.__all__)


def test_readme_lists_every_module_bottom_to_top():
    """README's "Layout" lists each module once, and each imports only modules listed above it."""
    import re

    text = (PACKAGE.parent / "README.md").read_text()
    block = text[text.index("The package, bottom to top"):text.index("Where this differs")]
    order = []
    for line in block.splitlines():
        m = re.match(r"^([a-z_]+(?:, [a-z_]+)*)(?:\s{2,}|$)", line)
        if m:
            order += [n.strip() for n in m.group(1).split(",")]
    assert sorted(order) == sorted(_modules())
    pos = {n: i for i, n in enumerate(order)}
    upward = [(n, m) for n, p in _modules().items() for m in _package_imports(p) - {n}
              if pos[m] > pos[n]]
    assert upward == []
