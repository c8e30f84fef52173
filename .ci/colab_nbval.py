"""Stage `nbval-colab` of .ci/check: every chapter run as a Colab reader runs it, then compared.

A reader on Colab opens one chapter in a fresh machine: no checkout, no ``tutorial_pkg``,
only Colab's preinstalled packages. The chapter's first cell sees ``google.colab``, clones
the repository, ``pip install``s the package from the clone and moves into the clone's
``book/`` folder, where the recorded results are. This stage reproduces exactly that, with
the network pointed at the local checkout:

1. a fresh virtual environment ``.venv-colab`` with pip, the same torch as the running
   interpreter (``TORCH_SPEC`` overrides it) and what Colab preinstalls that the chapters
   use (numpy, matplotlib, tqdm, ipykernel, transformers), plus nbval to compare; *no*
   ``tutorial_pkg``;
2. a snapshot of this working tree (tracked and untracked, not ignored files) committed to
   a temporary git repository, and a git configuration in which the configured repository
   URL (``_config.yml``: ``repository.url``) is ``insteadOf`` that snapshot: the cell's own
   ``git clone`` and ``pip install`` run unchanged;
3. an IPython startup file that registers a ``google.colab`` module in the kernel, so the
   cell takes its Colab branch;
4. each chapter copied alone into its own folder outside the repository, then
   ``pytest --nbval`` on those copies with this environment's kernel. After the run, each
   folder must hold the chapter's clone, and ``tutorial_pkg`` must be installed in
   ``.venv-colab`` (not the checkout): proof that the Colab branch ran.

The stored outputs are compared as in the plain nbval stage (the Colab cell itself carries
``nbval-ignore-output``: its output is pip's). Run by the test environment's Python, with
optional chapter paths (default: every chapter):

    python .ci/colab_nbval.py [book/03_alibi.ipynb ...]
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-colab"
# Preinstalled on Colab and used by the chapters (transformers: chapter 8's oracle cell);
# the Colab cell installs the rest.
COLAB_PACKAGES = ["numpy", "matplotlib", "tqdm", "ipykernel", "transformers>=5.24,<5.25"]
CHECK_PACKAGES = ["pytest", "nbval"]

FAKE_COLAB = """\
# Written by .ci/colab_nbval.py: the kernel believes it runs on Colab.
import importlib.machinery
import sys
import types

# with specs, as real modules have: importlib.util.find_spec("google.colab") (accelerate's
# Colab check) raises ValueError on a module whose __spec__ is None
for _name in ("google", "google.colab"):
    _module = sys.modules.get(_name) or types.ModuleType(_name)
    _module.__spec__ = importlib.machinery.ModuleSpec(_name, None)
    sys.modules[_name] = _module
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", shlex.join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def _torch_spec() -> list[str]:
    if os.environ.get("TORCH_SPEC"):
        return shlex.split(os.environ["TORCH_SPEC"])
    import torch

    return [f"torch=={torch.__version__}"]


def make_venv() -> Path:
    shutil.rmtree(VENV, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(VENV)])  # with pip: the cell's %pip uses it
    python = VENV / "bin" / "python"
    # --no-compile: byte-compiling torch would take most of the stage's set-up time.
    _run([str(python), "-m", "pip", "--quiet", "install", "--no-compile", *_torch_spec(),
          *COLAB_PACKAGES, *CHECK_PACKAGES])
    return python


def snapshot(dest: Path) -> Path:
    """The working tree as the remote: tracked and untracked files git does not ignore."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():  # a deleted but still tracked file is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=ci", "-c", "user.email=ci@localhost"]
    _run([*git, "init", "-q"])
    _run([*git, "add", "-A"])
    _run([*git, "commit", "-q", "-m", "snapshot of the working tree"])
    return dest


def main(chapters: list[Path]) -> int:
    t0 = time.monotonic()
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].rstrip("/")
    python = make_venv()
    t_venv = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="colab-") as tmp:
        tmp = Path(tmp)
        remote = snapshot(tmp / "remote")
        gitconfig = tmp / "gitconfig"
        gitconfig.write_text(f'[url "file://{remote}"]\n\tinsteadOf = {url}\n')
        startup = tmp / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-google-colab.py").write_text(FAKE_COLAB)
        shutil.copy(ROOT / "tests" / "sanitize.cfg", tmp / "sanitize.cfg")
        copies = []
        for chapter in chapters:
            folder = tmp / "content" / chapter.stem  # a fresh Colab /content per chapter
            folder.mkdir(parents=True)
            copies.append(shutil.copy(chapter, folder / chapter.name))

        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GIT_DIR", "GIT_WORK_TREE")}
        env.update(GIT_CONFIG_GLOBAL=str(gitconfig), GIT_CONFIG_NOSYSTEM="1",
                   IPYTHONDIR=str(tmp / "ipython"), PATH=f"{VENV / 'bin'}:{env['PATH']}")
        cmd = [str(python), "-m", "pytest", "--nbval", "--nbval-current-env",
               "--nbval-sanitize-with", str(tmp / "sanitize.cfg"), "-q", "-p", "no:cacheprovider",
               "--rootdir", str(tmp), *map(str, copies)]
        print("+", shlex.join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=tmp, env=env).returncode

        # Proof that the chapters took the Colab branch and ran on the installed package.
        missing = [c.parent.name for c in map(Path, copies)
                   if not (c.parent / "pe-book" / "book" / "data").is_dir()]
        where = subprocess.run(
            [str(python), "-I", "-c", "import tutorial_pkg; print(tutorial_pkg.__file__)"],
            cwd=tmp, env=env, capture_output=True, text=True).stdout.strip()
        installed = Path(where).resolve().is_relative_to(VENV.resolve()) if where else False
    problems = []
    if missing:
        problems.append(f"no clone of the repository next to: {', '.join(missing)}")
    if not installed:
        problems.append(f"tutorial_pkg is not installed in {VENV.name} ({where or 'not found'})")
    for p in problems:
        print(f"colab check: {p}", file=sys.stderr)
    t1 = time.monotonic()
    print(f"colab nbval: fresh venv {t_venv - t0:.0f}s, chapters {t1 - t_venv:.0f}s, "
          f"{'passed' if rc == 0 and not problems else 'FAILED'}")
    return 1 if rc or problems else 0


if __name__ == "__main__":
    args = [Path(a).resolve() for a in sys.argv[1:]]
    sys.exit(main(args or sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))))
