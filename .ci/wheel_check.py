"""Stage `wheel` of .ci/check: the package as a reader installs it, not the editable checkout.

Every other stage tests the editable install of this checkout. This one:

1. builds the sdist and, from the sdist, the wheel (``python -m build``, in an isolated
   build environment), and fails if the build prints any warning;
2. creates a fresh virtual environment ``.venv-wheel`` next to the test one and installs
   the wheel there, with the same torch as the running interpreter (its exact version,
   e.g. ``torch==2.13.0+cpu``, so pip cannot pick another build; ``TORCH_SPEC`` overrides
   it, as in the Makefile), using the test environment's pip and its cache;
3. from a temporary directory outside the repository (and ``python -I``, so neither the
   checkout nor the current directory is importable), runs the README's "use the
   package" snippet, loads the chapter-7 corpus (package data, checksum verified), and
   checks the installed version, the ``py.typed`` marker and the licence metadata.

It fails if package data is missing from the wheel (the corpus load raises
``CorpusNotFoundError``). Run by the test environment's Python:

    python .ci/wheel_check.py          # or: make wheel-check
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-wheel"

# Run in the fresh environment, from a directory outside the repository.
SMOKE = r'''
import importlib.metadata as md
import importlib.resources
import sys
import time
from pathlib import Path

expected_version, venv = sys.argv[1], Path(sys.argv[2]).resolve()
t0 = time.perf_counter()
import tutorial_pkg
from tutorial_pkg.experiments.data import list_plays, load_corpus

where = Path(tutorial_pkg.__file__).resolve()
assert venv in where.parents, f"tutorial_pkg imported from {where}, not from {venv}"
assert tutorial_pkg.__version__ == md.version("tutorial_pkg") == expected_version, (
    tutorial_pkg.__version__, md.version("tutorial_pkg"), expected_version)

meta = md.metadata("tutorial_pkg")
assert meta["License-Expression"] == "MIT", meta["License-Expression"]
assert any(str(f).endswith("licenses/LICENSE") for f in md.files("tutorial_pkg")), "no LICENSE"
package = importlib.resources.files("tutorial_pkg")
assert package.joinpath("py.typed").is_file(), "py.typed is missing from the wheel"

exec(compile(Path("readme_snippet.py").read_text(), "README.md", "exec"), {})

text = load_corpus()  # verifies the pinned SHA-256 of the shipped plays
plays = list_plays()
assert len(plays) == 38 and len(text) > 4_000_000, (len(plays), len(text))
print(f"installed tutorial_pkg {tutorial_pkg.__version__} from {where.parent}")
print(f"README snippet ran; corpus: {len(plays)} plays, {len(text):,} characters; "
      f"{time.perf_counter() - t0:.1f}s")
'''


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", shlex.join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def _pyproject_version() -> str:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- readme-snippet.*?-->\n```python\n(.*?)```", readme, re.S)
    if match is None:
        sys.exit("README.md has no snippet after <!-- readme-snippet -->")
    return match.group(1)


def _torch_spec() -> list[str]:
    if os.environ.get("TORCH_SPEC"):
        return shlex.split(os.environ["TORCH_SPEC"])
    import torch

    return [f"torch=={torch.__version__}"]


def build(outdir: Path) -> tuple[Path, Path]:
    """The sdist, then the wheel built from it; any warning in the output fails."""
    try:
        import build  # noqa: F401
    except ImportError:
        sys.exit("the `build` package is missing: pip install -e '.[test]'")
    env = dict(os.environ)
    # PYTHONDONTWRITEBYTECODE only makes setuptools warn that byte-compiling is skipped.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, "-m", "build", "--outdir", str(outdir), str(ROOT)]
    print("+", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    warnings = [line for line in proc.stdout.splitlines() if re.search(r"warn", line, re.I)]
    if proc.returncode != 0 or warnings:
        print(proc.stdout)
        sys.exit(f"the build failed (rc={proc.returncode})" if proc.returncode else
                 "the build printed warnings:\n  " + "\n  ".join(warnings))
    print(proc.stdout.strip().splitlines()[-1])
    (sdist,), (wheel,) = outdir.glob("*.tar.gz"), outdir.glob("*.whl")
    for path in (sdist, wheel):
        print(f"  {path.name}: {path.stat().st_size / 1e6:.1f} MB")
    return sdist, wheel


def main() -> None:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wheel-check-") as tmp:
        tmp = Path(tmp)
        _, wheel = build(tmp / "dist")
        t_build = time.monotonic()

        shutil.rmtree(VENV, ignore_errors=True)
        # No pip inside (ensurepip is slow): this environment's pip installs into it.
        _run([sys.executable, "-m", "venv", "--without-pip", str(VENV)])
        python = VENV / "bin" / "python"
        # --no-compile: byte-compiling torch's files would take most of the stage's time.
        _run([sys.executable, "-m", "pip", "--python", str(python), "--quiet", "install",
              "--no-compile", str(wheel), *_torch_spec()])
        t_install = time.monotonic()

        work = tmp / "work"
        work.mkdir()
        (work / "readme_snippet.py").write_text(_readme_snippet())
        (work / "smoke.py").write_text(SMOKE)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        _run([str(python), "-I", "smoke.py", _pyproject_version(), str(VENV)], cwd=work,
             env=env)
    t1 = time.monotonic()
    print(f"wheel check passed: build {t_build - t0:.0f}s, fresh venv + install "
          f"{t_install - t_build:.0f}s, smoke {t1 - t_install:.0f}s, total {t1 - t0:.0f}s")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as err:
        sys.exit(f"failed (rc={err.returncode}): {shlex.join(str(c) for c in err.cmd)}")
