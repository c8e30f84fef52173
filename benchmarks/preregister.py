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
