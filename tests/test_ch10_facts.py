"""Record checks behind chapter 10's text, kept out of the reader's cells.

The chapter reads chapter 8's record of production configs and chapter 7's real-model record; what
it says about them (class defaults differ from the copied values for most rows, which rows are
pinned, longrope's factor, the mechanisms each row shows, the real model's decisions and when its
claims were written) is checked here against the records themselves and the stored outputs.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

import tutorial_pkg as tp
from tutorial_pkg.experiments.stats import paired_difference

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "book" / "data"
CHAPTER = ROOT / "book" / "10_choosing.ipynb"
RECORD = json.loads((DATA / "model_configs.json").read_text())
SMOL = json.loads((DATA / "smollm2_context.json").read_text())


def output_of(marker):
    cells = [c for c in json.loads(CHAPTER.read_text())["cells"]
             if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(cells) == 1, marker
    parts = []
    for o in cells[0].get("outputs", []):
        md = o.get("data", {}).get("text/markdown", "")
        parts.append("".join(o.get("text", "")) + "".join(md))
    return "\n".join(parts)


def copied(e):
    # a row whose base and length are copied values, not class defaults
    return not {"rope_theta", "max_position_embeddings"} & set(e.get("class_default_keys") or ())


def test_class_defaults_differ_for_most_rows():
    # the chapter's "for most rows they differ in base or length" (cell 12 and the summary)
    transformers = pytest.importorskip("transformers")
    differ = rows = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in RECORD["models"].values():
            if not copied(e):
                continue
            cfg = e["config"]
            cls = type(transformers.AutoConfig.for_model(cfg["model_type"]))()
            quoted = tp.read_rope_config(cfg)
            default = tp.read_rope_config(cls)
            rows += 1
            differ += (default.base != quoted.base
                       or cls.max_position_embeddings != cfg["max_position_embeddings"])
    assert rows >= 10 and differ > rows / 2


def test_longrope_factor_is_the_two_lengths_ratio():
    # the table prints longrope x32 for Phi-4-mini, a factor the file does not state
    (e,) = [e for e in RECORD["models"].values()
            if (e["config"].get("rope_scaling") or {}).get("type") == "longrope"]
    cfg = e["config"]
    assert "factor" not in cfg["rope_scaling"]
    r = tp.read_rope_config(cfg)
    ratio = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
    assert r.scaling["factor"] == ratio
    assert "longrope` x32" in output_of("# The production table:")


def test_pinned_rows_are_the_records_pinned_copies():
    # pinned: a transcription of a copy at a recorded commit, the row's own or chapter 8's entry of
    # the same name that agrees on every key the row quotes
    ch8 = RECORD["chapter8_only"]["models"]

    def pinned(name, e):
        for c in (e, ch8.get(name)):
            if (c and c["checkpoint"] == e["checkpoint"]
                    and c["provenance"].startswith("transcription")
                    and (c.get("copy") or {}).get("commit")
                    and all(c["config"].get(k) == v for k, v in e["config"].items())):
                return True
        return False

    table = output_of("# The production table:")
    for name, e in RECORD["models"].items():
        line = next(s for s in table.splitlines() if s.startswith(f"| {e['checkpoint']} |"))
        assert ("**not pinned**" in line) != pinned(name, e), name
    assert pinned("SmolLM3-3B", RECORD["models"]["SmolLM3-3B"])  # through chapter 8's copy
    assert not pinned("Llama 4 Scout", RECORD["models"]["Llama 4 Scout"])


def test_each_mechanism_row_shows_its_mechanism():
    table = output_of("# The production table:")
    mech = table[table.index("| mechanism (2025-26)"):]
    assert "Llama-4-Scout-17B-16E (not pinned): base 5e+05, `llama3` x16; chunks of 8192" in mech
    assert "Qwen3-Next-80B-A3B-Instruct (not pinned): base 1e+07, rotates 0.25 of 256" in mech
    assert "DeepSeek-V3: base 1e+04, rotates 64 of the 192" in mech
    assert "gpt-oss-20b: base 1.5e+05, `yarn` x32" in mech


def test_one_pair_layout_per_checkpoint():
    for e in RECORD["models"].values():
        cfg = e["config"]
        types = sorted(set(cfg.get("layer_types") or [None]) - {"linear_attention"})
        if e["config"]["model_type"] == "gemma3_text":
            types = ["full_attention", "sliding_attention"]
        layouts = {tp.read_rope_config(cfg, layer_type=t if len(types) > 1 else None).layout
                   for t in types}
        assert len(layouts) == 1, e["checkpoint"]


def test_the_real_models_decisions_recompute_from_its_blocks():
    nll = {(r["rule"], r["length"]): r["nll_by_block"] for r in SMOL["results"]}
    for c, d in zip(SMOL["claims"], SMOL["decided"], strict=True):
        r = paired_difference(nll[c["rule"], c["length"]], nll[c["against"], c["against_length"]],
                              confidence=d["confidence"])
        assert math.isclose(r["low"], d["low"], rel_tol=1e-9)
        assert math.isclose(r["high"], d["high"], rel_tol=1e-9)
        holds = r["high"] < 0 if c["sign"] == "<" else r["low"] > 0
        assert holds == (d["verdict"] == "holds")
        assert math.isclose(d["confidence"], 1 - SMOL["alpha"] / len(SMOL["claims"]))


def _script_history():
    # (commit, commit date, CLAIMS as tuples) for every commit of the record's script, oldest first
    if shutil.which("git") is None:
        pytest.skip("git not available")
    path = "benchmarks/smollm2_context.py"
    try:
        log = subprocess.run(["git", "log", "--reverse", "--format=%H %cI", "--", path], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
    except (subprocess.CalledProcessError, OSError):
        pytest.skip("no git history")
    out = []
    for line in filter(None, log):
        commit, date = line.split()
        src = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        claims = next((ast.literal_eval(n.value) for n in ast.parse(src).body
                       if isinstance(n, ast.Assign)
                       and any(getattr(t, "id", None) == "CLAIMS" for t in n.targets)), ())
        out.append((commit, date, set(claims)))
    if not out:
        pytest.skip("shallow checkout: the script has no history here")
    return out


def test_the_real_models_claims_are_in_its_script_before_the_run():
    # the record stores no time for its claims (the chapter says so); the script's history: five
    # of the six in a commit before the run began, the sixth re-set later but still before the run
    assert "claims_written" not in SMOL
    history = _script_history()
    started = SMOL["hardware"]["date"]
    claims = [(c["claim"], c["rule"], c["length"], c["against"], c["against_length"], c["sign"])
              for c in SMOL["claims"]]
    first = {}
    for _, date, found in history:
        for c in claims:
            if c in found and c not in first:
                first[c] = date
    assert set(first) == set(claims)
    from datetime import datetime
    t = {c: datetime.fromisoformat(d) for c, d in first.items()}
    run = datetime.fromisoformat(started)
    assert all(v < run for v in t.values())
    earliest = min(t.values())
    later = [c for c, v in t.items() if v > earliest]
    assert len(later) == 1 and later[0][0] == "PI costs inside the trained length"
    # no verdict of the chapter reads the sixth: it is no claim past the trained length
    assert later[0][2] <= SMOL["original_max_position_embeddings"]
    # the sixth was moved from 2 048 to 8 192 tokens, after a first run stopped having measured
    # unscaled rows only, as the commit that moved it says (the chapter says only that it changed)
    earlier = ("PI costs inside the trained length", "linear", 2048, "none", 2048, ">")
    assert any(earlier in found for _, _, found in history) and later[0][2] == 8192
    moved = next(commit for commit, _, found in history if later[0] in found)
    message = subprocess.run(["git", "show", "-s", "--format=%B", moved], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert "stopped after the no-scaling rows" in message
    assert "before any scaled rule was measured" in message
