"""Stored outputs another x86-64 CPU reproduces (nbval compares every stored text output).

A residual such as ``3.81e-06`` has digits that depend on how the CPU's kernels round, and
a trained model's perplexity on how its training rounded: the chapters print the claim (a
bound, a verdict, a value recorded in ``book/data``), and the diagnose reports print a
passing residual as the bound it passed.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import tutorial_pkg as tp
from tutorial_pkg import diagnose as dg
from tutorial_pkg.models.tiny_lm import TinyLM

ROOT = Path(__file__).resolve().parents[1]
# the pattern of the repository's notebook hook: 1.23e-05 and smaller, in scientific notation
RESIDUAL = re.compile(r"\b\d\.\d+e-(?:0[5-9]|1\d|[2-9]\d)\b")


def compared_text(nb_path):
    """(cell index, text) of every output nbval compares (cells without nbval-ignore-output)."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or "nbval-ignore-output" in cell["metadata"].get("tags", []):
            continue
        for out in cell.get("outputs", []):
            plain = out.get("data", {}).get("text/plain", "")
            yield i, "".join(out.get("text", "")) + "".join(plain)


@pytest.mark.parametrize("nb_path", sorted((ROOT / "book").glob("*.ipynb")), ids=lambda p: p.name)
def test_compared_outputs_print_no_rounding_residual(nb_path):
    found = [(i, m) for i, text in compared_text(nb_path) for m in RESIDUAL.findall(text)]
    assert not found, f"print the bound the claim needs, not the residual (cell, value): {found}"


def test_debugging_reference_records_values_a_tolerance_and_how_it_was_made():
    ref = json.loads((ROOT / "book/data/debugging_reference.json").read_text())
    assert 0 < ref["rtol"] <= 0.05
    assert ref["values"] and all(isinstance(v, float) and math.isfinite(v) and v > 0
                                 for v in ref["values"].values())
    made = ref["produced_by"]
    assert "RECORD_REFERENCE=1" in made["command"] and "09_debugging.ipynb" in made["command"]
    assert made["device"] == "cpu" and made["cpu_capability"] and made["torch"]


def rope_fn(layout):
    rope = tp.RotaryEmbedding(32, layout=layout)
    return lambda x: rope(x, x)[0]


def passing_reports():
    torch.manual_seed(0)
    model = TinyLM(tp.make_encoding("rope", d_model=32, n_heads=4), d_model=32, n_layers=1,
                   n_heads=4).eval()
    ids = torch.randint(0, 256, (2, 12))
    docs = torch.repeat_interleave(torch.arange(2), 6)[None].expand(2, 12)
    w_q, w_k = torch.randn(4 * 8, 32), torch.randn(4 * 8, 32)
    return {
        "rope": dg.probe_rope(rope_fn("half"), 32),
        "kv cache": dg.check_kv_cache(model, ids),
        "masking": dg.probe_masking(
            lambda x, document_ids: model(x, positions=tp.positions_from_documents(document_ids),
                                          document_ids=document_ids), ids, document_ids=docs),
        "alibi": dg.probe_alibi(lambda n: tp.alibi_bias(tp.alibi_slopes(6), n), 6, seq_len=64),
        "conversion": dg.check_weight_conversion(
            w_q, w_k, tp.interleaved_to_half(w_q, 4), tp.interleaved_to_half(w_k, 4), n_heads=4),
    }


def test_passing_reports_print_the_bound_they_passed_not_the_residual():
    reports = passing_reports()
    for name, report in reports.items():
        text = str(report)
        assert report.ok, text
        assert not RESIDUAL.search(text), (name, text)
    assert "max deviation <= 1e-05" in str(reports["rope"])
    assert "within atol 0.0001 + rtol 0.001" in str(reports["kv cache"])
    assert "packed vs alone: max |diff| <= 0.0001" in str(reports["masking"])
    assert "bias rounding: max <= 0.05 nats" in str(reports["alibi"])
    assert "score error per head: max <= 1e-06" in str(reports["conversion"])


def test_failing_reports_print_two_significant_digits():
    w_q, w_k = torch.randn(4 * 8, 32), torch.randn(4 * 8, 32)
    bad = dg.check_weight_conversion(w_q, w_k, w_q, w_k, n_heads=4)
    worst = max(bad.head_errors)
    assert not bad.ok and f"score error per head: max {worst:.2g}" in str(bad)

    def angles_in_x_dtype(x):  # the bug of chapter 9: angles in bfloat16
        s, d = x.shape[-2:]
        angles = torch.outer(torch.arange(s, dtype=x.dtype), tp.inv_freq(d).to(x.dtype))
        emb = torch.cat((angles, angles), dim=-1)
        return x * emb.cos() + tp.rotate_half(x) * emb.sin()

    drift = dg.probe_rope_precision(angles_in_x_dtype, 32, seq_len=1024)
    assert not drift.ok
    assert all(f"{e:.2g}" in str(drift) for _, _, e in drift.buckets), str(drift)


def test_recorded_benchmark_runs_carry_their_spread_and_their_stored_family():
    """Every stored benchmark file loads and every ratio measured in several rounds has its
    range. A file that stores a family of claims (written by ``benchmarks/suite.py`` before it
    timed anything) holds the verdicts that family gets from its records, its cases were
    timed in a recorded random order, and every group has its A/A control; the CPU record's
    family is the script's (a changed ``CLAIMS`` needs a new record)."""
    from benchmarks import suite as bs
    from tutorial_pkg import measure as bm

    files = sorted((ROOT / "book" / "data").glob("benchmark_*.json"))
    assert files
    for path in files:
        hardware, records = bm.load_results(path)
        assert hardware.get("device") and records
        for r in records:
            if r.ok and r.ratio is not None and len(r.round_ratios) > 1:
                low, high = r.ratio_range
                assert low <= r.ratio <= high, (path.name, r.group, r.case)
        stored = json.loads(path.read_text(encoding="utf-8"))
        if "claims" not in stored:
            continue
        assert stored["status"] == "done"
        decided = bs.decide_claims(records, stored["claims"], stored["alpha"])
        assert [d["verdict"] for d in decided] == [d["verdict"] for d in stored["decided"]]
        assert all(len(r.round_positions) == len(r.round_ratios) for r in records if r.ok)
        twins = {"attention": bs.ATTENTION_AA, "rope": bs.ROPE_AA, "lm train step": bs.LM_AA}
        groups = {r.group: r.params["op"] for r in records}
        for group, op in groups.items():
            assert any(r.group == group and r.case == twins[op] for r in records), group
    stored = json.loads((ROOT / "book/data/benchmark_cpu.json").read_text(encoding="utf-8"))
    assert stored["claims"] == bs.claim_dicts() and stored["alpha"] == bs.ALPHA


def test_the_recorded_lm_step_is_chapter_7s_model():
    from tutorial_pkg import measure as bm

    _, records = bm.load_results(ROOT / "book/data/benchmark_cpu.json")
    config = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())["config"]
    for r in records:
        if r.params.get("op") == "lm train step":
            p = r.params
            assert (p["d_model"], p["layers"], p["heads"]) == (
                config["d_model"], config["n_layers"], config["n_heads"]), r.case
            assert (p["batch"], p["seq_len"]) == (config["batch_size"], config["train_len"])
