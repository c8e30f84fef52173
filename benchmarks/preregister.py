"""Pre-registration for the record scripts: claims written and committed before the run.

A script writes its header (design and claims, ``status: "claims"``) with
:func:`write_claims`; the author commits that file; the run starts only through
:func:`committed_header`, which refuses unless both the file and its committed version hold
exactly the script's claims, and returns the header with the commit that holds them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """A git command's output in the repository (stripped)."""
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()


def write_claims(out: Path, header: dict) -> None:
    """Write the record's header before anything runs; it must be committed next."""
    out.write_text(json.dumps(header, indent=1) + "\n")
    print(f"wrote {len(header['claims'])} claims into {out}; commit it before the run")


def committed_header(out: Path, claims: list) -> dict:
    """The header of ``out`` if it and its committed version hold ``claims`` (status
    ``"claims"``), with ``claims_commit`` added; else ``SystemExit``."""
    pre = json.loads(out.read_text())
    rel = str(out.relative_to(ROOT))
    committed = json.loads(git("show", f"HEAD:{rel}"))
    if pre["claims"] != claims or committed["claims"] != claims or pre["status"] != "claims":
        raise SystemExit("the committed record does not hold these claims: --claims-only, "
                         "commit, then run")
    pre["claims_commit"] = git("log", "-1", "--format=%H", "--", rel)
    return pre


def start_header(out: Path, header: dict, *, quick: bool) -> dict:
    """The header a run starts from: the committed one (:func:`committed_header`, which
    refuses otherwise), or for a ``--quick`` smoke run the script's own, with no claim times."""
    if quick:
        return {**header, "claims_written": None, "claims_commit": None}
    return committed_header(out, header["claims"])


def run_fields(script: str, argv, device: str = "cpu") -> dict:
    """What every run records as it starts: its command, commit, start time, status
    ``"running"``, versions and hardware."""
    import shlex
    import sys
    from datetime import datetime, timezone

    import torch

    import tutorial_pkg
    from tutorial_pkg.measure.cases import hardware_info

    return {"command": f"python benchmarks/{script} "
                       + shlex.join(sys.argv[1:] if argv is None else argv),
            "commit": git("rev-parse", "HEAD"),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "status": "running", "tutorial_pkg_version": tutorial_pkg.__version__,
            "torch_version": torch.__version__, "hardware": hardware_info(device)}
