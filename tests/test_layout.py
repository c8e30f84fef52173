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
#: The subpackages, bottom to top, and what each may import (besides ``_checks``).
LAYERS = {
    "encodings": set(),
    "attention": {"encodings"},
    "models": {"encodings", "attention"},
    "measure": set(),
    "experiments": {"encodings", "attention", "models", "measure"},
    "diagnose": {"encodings", "attention"},
}


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts)  # a package's __init__ keeps its name: "diagnose.__init__"


def _modules() -> dict[str, Path]:
    """Every module of the package but the top-level ``__init__``, by dotted name."""
    return {_dotted(p): p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"}


def _resolve(name: str) -> str | None:
    """The module a dotted name inside the package refers to (a package: its __init__)."""
    mods = _modules()
    if name in mods:
        return name
    return f"{name}.__init__" if f"{name}.__init__" in mods else None


def _package_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, relative or absolute, at any depth."""
    here = _dotted(path).split(".")[:-1]  # the package the module sits in
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = [*base, *(node.module.split(".") if node.module else [])]
            elif (node.module or "").split(".")[0] == "tutorial_pkg":
                mod = node.module.split(".")[1:]
            else:
                continue
            if node.module:
                targets.append(".".join(mod))
            targets += [".".join([*mod, a.name]) for a in node.names]  # from . import x
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names
                       if a.name.startswith("tutorial_pkg.")]
        found |= {m for m in map(_resolve, filter(None, targets)) if m}
    return found


def _layer(module: str) -> str:
    return module.split(".")[0] if "." in module else module


def test_no_module_over_the_size_limit():
    sizes = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_every_module_sits_in_a_subpackage_by_concern():
    top = {n for n in _modules() if "." not in n}
    assert top == {"_checks", "plotting"}
    assert {n.split(".")[0] for n in _modules() if "." in n} == set(LAYERS)
    for sub in LAYERS:  # each says what it holds and which chapter explains it
        doc = ast.get_docstring(ast.parse((PACKAGE / sub / "__init__.py").read_text()))
        assert doc and "Chapter" in doc, sub


def test_the_wheel_lists_every_subpackage():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]
    assert sorted(packages) == sorted(["tutorial_pkg", *(f"tutorial_pkg.{s}" for s in LAYERS)])


def test_subpackages_import_one_way():
    upward = sorted((n, m) for n, p in _modules().items() for m in _package_imports(p)
                    if _layer(m) not in (_layer(n), "_checks")
                    and _layer(m) not in LAYERS.get(_layer(n), set(LAYERS)))
    assert upward == []


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
    from tutorial_pkg.models.tiny_lm import TinyLM

    assert "TinyLM" in tp.__all__ and tp.TinyLM is TinyLM
    internals = {"auto_key_bias", "sdpa_key_bias", "flex_blocker", "cached_tensors",
                 "cached_key_bias"}
    assert internals.isdisjoint(tp.__all__)
    assert all(not name.startswith("_") for name in tp.__all__)
    assert sorted(set(tp.__all__)) == sorted(tp.__all__)  # no duplicates
    assert len(tp.__all__) <= 36  # about 30 names: the rest is one import away
    assert all(hasattr(tp, name) for name in tp.__all__)


def test_readme_tree_lists_every_module_bottom_to_top():
    """README's "Layout" tree lists each module once, under its subpackage, and each
    imports only modules listed above it."""
    import re

    text = (PACKAGE.parent / "README.md").read_text()
    block = text[text.index("tutorial_pkg/\n"):text.index("Where this differs")]
    order, sub = [], None
    for line in block.splitlines():
        if m := re.match(r"^  (\w+)/", line):
            sub = m.group(1)
        elif m := re.match(r"^    (\w+)\.py", line):
            order.append(f"{sub}.{m.group(1)}")
        elif m := re.match(r"^  (\w+)\.py", line):
            order.append(m.group(1))
    # the subpackages' __init__ are not listed (their docstring; measure's re-exports
    # compare's names), but diagnose's, the front door
    listed = set(_modules()) - {f"{s}.__init__" for s in LAYERS if s != "diagnose"}
    assert sorted(order) == sorted(listed)
    pos = {n: i for i, n in enumerate(order)}
    for s in LAYERS:
        pos.setdefault(f"{s}.__init__", max(i for n, i in pos.items() if n.startswith(s + ".")))
    upward = [(n, m) for n, p in _modules().items() for m in _package_imports(p) - {n}
              if pos[m] > pos[n]]
    assert upward == []
