"""The package's layout promises (README "Layout", ../shared/DESIGN.md): small modules, imports
that point one way, a public API of what readers use, and tests that mirror modules (each
module has its test file, :data:`TESTS_OF`).

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


TESTS = Path(__file__).resolve().parent
#: The test file of every module of the package, by path inside ``tutorial_pkg/``: one test
#: file per module, ``test_<module>.py``, but where a file tests a family of modules (the
#: private backend modules, the subpackages' ``__init__``) or a module's tests kept an older
#: name (``test_benchmark.py``: measure's ``cases`` and the ``benchmarks/`` suite that uses it).
#: A module added without its entry, or whose test file is missing, fails
#: :func:`test_every_module_has_its_test_file`.
TESTS_OF = {
    "__init__.py": "test_layout.py",  # the public API (test_public_api_has_what_readers_use)
    "_checks.py": "test_errors.py",  # bad input, named, across the package
    "plotting.py": "test_packaging.py",  # an extra: importable only with matplotlib
    # attention
    "attention/__init__.py": "test_attention.py",
    "attention/_caches.py": "test_backends.py",
    "attention/_flex.py": "test_backends.py",
    "attention/_kernel_rules.py": "test_backends.py",
    "attention/_probe.py": "test_backends.py",
    "attention/backends.py": "test_backends.py",
    "attention/layer.py": "test_attention.py",
    "attention/masks.py": "test_masks.py",
    "attention/positions.py": "test_positions.py",
    # diagnose
    "diagnose/__init__.py": "test_diagnose.py",
    "diagnose/kernel_masks.py": "test_kernel_masks.py",
    "diagnose/kv_cache_check.py": "test_kv_cache_check.py",
    "diagnose/reports.py": "test_stored_records.py",  # what a report prints
    "diagnose/rope_probes.py": "test_rope_probes.py",
    # encodings
    "encodings/__init__.py": "test_encodings.py",
    "encodings/alibi.py": "test_alibi.py",
    "encodings/builtin.py": "test_encodings.py",
    "encodings/registry.py": "test_registry.py",
    "encodings/relative_bias.py": "test_relative_bias.py",
    "encodings/mrope.py": "test_mrope.py",
    "encodings/rope.py": "test_rope.py",
    "encodings/rope_config.py": "test_rope_config.py",
    "encodings/rope_kernels.py": "test_rope_kernels.py",
    "encodings/rope_scaling.py": "test_rope_scaling.py",
    "encodings/schedules.py": "test_schedules.py",
    "encodings/sinusoidal.py": "test_sinusoidal.py",
    # experiments
    "experiments/__init__.py": "test_experiments.py",
    "experiments/context_eval.py": "test_context_eval.py",
    "experiments/data.py": "test_data.py",
    "experiments/distributed.py": "test_ddp.py",  # run under torchrun
    "experiments/retrieval.py": "test_retrieval.py",
    "experiments/stats.py": "test_stats.py",
    "experiments/tasks.py": "test_tasks.py",
    "experiments/evaluation.py": "test_experiments.py",
    "experiments/training.py": "test_experiments.py",
    # measure
    "measure/__init__.py": "test_benchmark.py",
    "measure/cases.py": "test_benchmark.py",
    "measure/memory.py": "test_memory.py",
    "measure/records.py": "test_records.py",
    "measure/timing.py": "test_timing.py",
    # models
    "models/__init__.py": "test_model.py",
    "models/hf.py": "test_hf_loader.py",
    "models/smollm2.py": "test_smollm2.py",
    "models/swap.py": "test_swap.py",
    "models/tiny_lm.py": "test_model.py",
}


def _test_file_problems(package: Path, tests: Path, tests_of: dict[str, str]) -> list[str]:
    """What breaks "one test file per module": a module of ``package`` without an entry in
    ``tests_of``, an entry for no module, an entry whose test file is not in ``tests``."""
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    problems = [f"{m}: not in TESTS_OF" for m in sorted(modules - set(tests_of))]
    problems += [f"{m}: in TESTS_OF, but no such module" for m in sorted(set(tests_of) - modules)]
    problems += [f"{m}: its test file tests/{t} is missing" for m, t in sorted(tests_of.items())
                 if m in modules and not (tests / t).is_file()]
    return problems


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


def test_every_module_has_its_test_file():
    assert _test_file_problems(PACKAGE, TESTS, TESTS_OF) == []


def test_a_module_added_without_a_test_file_is_reported(tmp_path):
    """The check above on a copy of the layout: a new module, a module whose test file is
    gone and an entry left behind by a removed module are each reported."""
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for path in TESTS_OF:
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).touch()
    tests.mkdir()
    for name in set(TESTS_OF.values()):
        (tests / name).touch()
    assert _test_file_problems(package, tests, TESTS_OF) == []
    (package / "measure" / "new_module.py").touch()
    (tests / "test_timing.py").unlink()
    (package / "diagnose" / "reports.py").unlink()
    assert _test_file_problems(package, tests, TESTS_OF) == [
        "measure/new_module.py: not in TESTS_OF",
        "diagnose/reports.py: in TESTS_OF, but no such module",
        "measure/timing.py: its test file tests/test_timing.py is missing",
    ]
