"""Facts chapter 5 states about its two recorded suite runs, checked here rather than in the
reader's cells: how each record was made, when its claim family was fixed, how its case
orders were drawn, what the A/A sign-flip tests give at the randomisation unit, and where the
two records disagree."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUIET = ROOT / "book" / "data" / "benchmark_cpu.json"
LOADED = ROOT / "book" / "data" / "benchmark_cpu_loaded.json"
FAMILY_COMMIT = "5abe3be"  # benchmarks/suite.py with CLAIMS, as both records store them
RULE_COMMIT = "ff2a02e"  # stores the loaded record; its message states the reading rule


def _load(path):
    from tutorial_pkg import measure as bm

    stored = json.loads(path.read_text(encoding="utf-8"))
    _, records = bm.load_results(path)
    return stored, records


def _git(*args):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"git {' '.join(args)}: {out.stderr.strip()[:80]} (a shallow clone?)")
    return out.stdout


def _mean_load(stored):
    values = [v[0] for v in stored["load_by_group"].values()]
    return sum(values) / len(values)


@pytest.mark.parametrize("path", [QUIET, LOADED], ids=["quiet", "loaded"])
def test_each_record_is_one_finished_single_thread_cpu_run(path):
    stored, records = _load(path)
    hw = stored["hardware"]
    assert stored["status"] == "done" and "note" not in hw
    assert hw["num_threads"] == 1 and "--threads 1" in hw["command"]
    assert hw["device"] == "cpu" and hw["gpu_count"] == 0
    assert stored["design"]["order_seed"] is not None
    assert all(len(r.round_positions) == len(r.round_ratios) for r in records if r.ok)
    # the claims are written at the run's start; the file stores no time per case
    assert stored["claims_written"] == hw["date"]
    stamps = {"date", "started", "timestamp", "timed_at", "start_time"}
    assert not any(stamps & set(r) for r in stored["records"])


def test_the_family_was_committed_before_both_runs():
    """Both records store the CLAIMS of commit 5abe3be, dated before either run started."""
    from datetime import datetime

    committed = datetime.fromisoformat(_git("show", "-s", "--format=%cI", FAMILY_COMMIT).strip())
    source = _git("show", f"{FAMILY_COMMIT}:benchmarks/suite.py")
    joined = re.sub(r'"\s*\n\s*"', "", source)  # implicit string concatenation, joined
    for path in (QUIET, LOADED):
        stored, _ = _load(path)
        assert committed < datetime.fromisoformat(stored["claims_written"]), path.name
        for c in stored["claims"]:
            assert f'("{c["id"]}", "{c["claim"]}"' in joined, (path.name, c["id"])


def test_the_reading_rule_was_committed_before_the_quiet_run():
    """The rule (read the run with the lower mean load over its groups) is in the message of
    the commit that stores the loaded record, dated before the quiet run started; the quiet
    record is the one the chapter reads."""
    from datetime import datetime

    message = _git("show", "-s", "--format=%B", RULE_COMMIT)
    assert "the chapter reports the run with the lower load over its groups" in message
    files = _git("show", "--name-only", "--format=", RULE_COMMIT).split()
    assert "book/data/benchmark_cpu_loaded.json" in files
    committed = datetime.fromisoformat(_git("show", "-s", "--format=%cI", RULE_COMMIT).strip())
    quiet, _ = _load(QUIET)
    loaded, _ = _load(LOADED)
    assert committed < datetime.fromisoformat(quiet["claims_written"])
    assert _mean_load(quiet) < _mean_load(loaded)


def _order_sequences(records):
    groups = {}
    for r in records:
        groups.setdefault(r.group, []).append(tuple(r.round_positions))
    return {g: tuple(v) for g, v in groups.items()}


def test_both_records_share_one_sequence_of_case_orders_per_kind_of_group():
    """One order seed for the whole run and no per-group seeds: every group of a kind (the
    attention groups; the RoPE and LM groups) replays the same sequence of orders, in both
    records."""
    from benchmarks import suite as bs

    quiet, q_recs = _load(QUIET)
    loaded, l_recs = _load(LOADED)
    assert quiet["design"]["order_seed"] == loaded["design"]["order_seed"] == 0
    assert "group_order_seeds" not in quiet["design"]
    assert "group_order_seeds" not in loaded["design"]
    orders = {"quiet": _order_sequences(q_recs), "loaded": _order_sequences(l_recs)}
    distinct = {}
    for run, seqs in orders.items():
        for g, seq in seqs.items():
            distinct.setdefault(seq, []).append((run, g))
    assert sum(len(s) for s in orders.values()) == 22
    assert len(distinct) == 2
    kinds = sorted(sorted({g.split(" ")[0] for _, g in users}) for users in distinct.values())
    assert kinds == [["attn"], ["lm", "rope"]]
    assert all({run for run, _ in users} == {"quiet", "loaded"} for users in distinct.values())
    # the attention groups: the A/A timed before the limit in 8 of the 10 rounds
    first = set()
    for g in (g for g in orders["quiet"] if g.startswith("attn")):
        (aa,) = [r for r in q_recs if r.group == g and r.case == bs.ATTENTION_AA]
        (ref,) = [r for r in q_recs if r.group == g and r.case == bs.ATTENTION_LIMIT]
        first.add(sum(a < b for a, b in zip(aa.round_positions, ref.round_positions,
                                             strict=True)))
    assert first == {8}


def test_aa_sign_flips_over_rounds_and_over_orders_agree_with_the_t_verdicts():
    """At the randomisation unit (one flip per order, the mean over the rounds that used it)
    no A/A claim shows a difference at alpha / k, as over rounds and as the t intervals."""
    from benchmarks import suite as bs
    from tutorial_pkg.experiments.stats import sign_flip

    stored, records = _load(QUIET)
    claims, alpha = stored["claims"], stored["alpha"]
    k = len(claims)
    verdicts = {d["id"]: d["verdict"] for d in stored["decided"]}
    p_orders = {}
    for c in (c for c in claims if c["test"] == "A/A"):
        logs = bs.paired_log_ratios(records, c["case"], c["against"], c["groups"])
        values = [x for v in logs.values() for x in v]
        per_order = [sum(col) / len(col) for col in zip(*logs.values(), strict=True)]
        p = sign_flip(values, seed=0)["p_value"]
        p_orders[c["id"]] = sign_flip(per_order, seed=0)["p_value"]
        assert (p >= alpha / k) == (verdicts[c["id"]] == "holds"), c["id"]
        assert p_orders[c["id"]] >= alpha / k, c["id"]
    assert sorted(p_orders) == ["A1", "A2", "L1", "R1", "R2"]
    assert {cid: len(x) for cid, x in ((c["id"], bs.paired_log_ratios(
        records, c["case"], c["against"], c["groups"])) for c in claims
        if c["id"] in ("A1", "R1"))} == {"A1": 4, "R1": 1}  # lengths pooled / one group


def test_the_two_records_disagree_beyond_their_family_intervals_on_a11_and_r5():
    quiet, _ = _load(QUIET)
    loaded, _ = _load(LOADED)
    q = {d["id"]: d for d in quiet["decided"]}
    o = {d["id"]: d for d in loaded["decided"]}
    disjoint = sorted(cid for cid in q
                      if q[cid]["low"] > o[cid]["high"] or o[cid]["low"] > q[cid]["high"])
    assert {"A11", "R5"} <= set(disjoint)
    assert q["A11"]["low"] > 1 > o["A11"]["low"]
    assert q["A11"]["verdict"] == "holds" and o["A11"]["verdict"] == "not resolved"


def test_the_stored_verdicts_follow_from_the_stored_records():
    """Deciding each record's family again from its records gives its stored verdicts and
    intervals, claim for claim; every record a claim reads finished."""
    import math

    from benchmarks import suite as bs

    for path in (QUIET, LOADED):
        stored, records = _load(path)
        claims, alpha = stored["claims"], stored["alpha"]

        def selected(r, groups):
            return all(r.params.get("seq_len") in want if key == "lengths"
                       else r.params.get(key) == want for key, want in groups.items())

        used = [r for c in claims for r in records
                if r.case in (c["case"], c["against"]) and selected(r, c["groups"])]
        assert used and all(r.ok for r in used), path.name
        decided = bs.decide_claims(records, claims, alpha)
        assert [d["id"] for d in decided] == [c["id"] for c in claims]
        assert len(decided) == 24
        for mine, theirs in zip(decided, stored["decided"], strict=True):
            assert mine["verdict"] == theirs["verdict"], (path.name, mine["id"])
            assert all(math.isclose(mine[key], theirs[key], rel_tol=1e-9)
                       for key in ("low", "high")), (path.name, mine["id"])


def test_the_cached_bias_is_built_once():
    """A second request for the (1, 8, 1024, 1024) bias returns the same storage."""
    import tutorial_pkg as tp

    enc = tp.make_encoding("alibi", n_heads=8)
    first = tp.backends.cached_bias(enc, 0, 1024, 1024, causal=True, device="cpu")
    second = tp.backends.cached_bias(enc, 0, 1024, 1024, causal=True, device="cpu")
    assert tuple(first.shape) == (1, 8, 1024, 1024)
    assert second.data_ptr() == first.data_ptr()
    tp.backends.clear_caches(enc)


def test_the_quiet_run_is_a_second_look_from_another_working_tree():
    """The rule's commit message reports the first run's verdicts, the small costs not
    resolved, so the quiet run came after the first was read; the two records ran from
    different dirty working trees, whose difference touches the flex path A11 measures."""
    message = _git("show", "-s", "--format=%B", RULE_COMMIT)
    assert "the small costs" in message and "are not resolved" in message
    quiet, _ = _load(QUIET)
    loaded, _ = _load(LOADED)
    q, o = quiet["hardware"]["commit"], loaded["hardware"]["commit"]
    assert q.startswith("ff2a02e") and o.startswith("8b65bc9")
    assert q.endswith("+dirty") and o.endswith("+dirty")
    assert loaded["hardware"]["date"] < quiet["hardware"]["date"]
    changed = _git("diff", "--name-only", o.removesuffix("+dirty"),
                   q.removesuffix("+dirty")).split()
    assert "tutorial_pkg/attention/_flex.py" in changed
    assert "tutorial_pkg/attention/backends.py" in changed


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_cached_4d_table_is_float32_whatever_q_dtype(dtype):
    """Section 3's byte counts: the sdpa path keeps its (1, H, L, L) table in float32 (16-bit q
    gets a per-call copy), and in 16 bits the auto path caches that same float32 table once."""
    import torch

    import tutorial_pkg as tp

    heads, length, dim = 8, 128, 64
    q = torch.randn(1, heads, length, dim, dtype=getattr(torch, dtype))
    for backend in ("sdpa", "auto"):
        enc = tp.make_encoding("alibi", n_heads=heads)
        layer = tp.MultiHeadAttention(heads * dim, heads, enc, backend=backend)
        with torch.no_grad():
            layer.attend(q, q, q)
            layer.attend(q, q, q)
        tables = [t for t in tp.backends.cached_tensors(enc) if t.dim() == 4
                  and t.shape[-2:] == (length, length)]
        if backend == "auto" and dtype == "float32":
            assert tables == []  # the key row, no table
        else:
            assert [t.dtype for t in tables] == [torch.float32], (backend, dtype)
        tp.backends.clear_caches(enc)


PREVIOUS_SUITE_COMMIT = "26bfe5c"  # stores the suite's run before the family (hardware af44af7)


def test_the_claims_an_earlier_record_had_already_decided():
    """The chapter's claims cell counts as confirmatory only the claims that no record made
    before the family was written had already decided by the same test: it computes those of
    rope_speed_cpu.json and names those of the suite's previous run, which only the
    repository's history keeps; both are re-decided here."""
    from datetime import datetime

    import nbformat

    from benchmarks import suite as bs
    from tutorial_pkg import measure as bm

    quiet, _ = _load(QUIET)
    claims, alpha = quiet["claims"], quiet["alpha"]
    family = datetime.fromisoformat(_git("show", "-s", "--format=%cI", FAMILY_COMMIT).strip())
    previous = json.loads(_git("show", f"{PREVIOUS_SUITE_COMMIT}:book/data/benchmark_cpu.json"))
    assert previous["hardware"]["commit"].startswith("af44af7")  # CLAIMS' docstring names it
    assert datetime.fromisoformat(previous["hardware"]["date"]) < family
    speed = json.loads((ROOT / "book" / "data" / "rope_speed_cpu.json").read_text())
    assert datetime.fromisoformat(speed["hardware"]["date"]) < family

    def held(records, cs):
        return {d["id"] for d in bs.decide_claims(records, cs, alpha) if d["verdict"] == "holds"}

    from_suite = held([bm.BenchRecord.from_dict(r) for r in previous["records"]], claims)
    assert from_suite == {"A3", "A8", "A9", "A10", "A11", "R3", "R6"}
    _, speed_records = bm.load_results(ROOT / "book" / "data" / "rope_speed_cpu.json")
    names = {"complex": "meta complex", bs.ROPE_LIMIT: "copy q,k"}
    renamed = [{**c, "case": names.get(c["case"], c["case"]),
                "against": names.get(c["against"], c["against"])} for c in claims]
    assert held(speed_records, renamed) == {"R3", "R4", "R5", "R6", "R7"}
    nb = nbformat.read(ROOT / "book" / "05_benchmarking.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if 'decided = stored["decided"]' in c.source]
    assert 'known |= {"A3", "A8", "A9", "A10", "A11", "R3", "R6"}' in cell.source
    # what is left: the confirmatory claims, and at alpha / 2 per look L3 drops out
    _, q_records = _load(QUIET)
    known = from_suite | {"R3", "R4", "R5", "R6", "R7"}
    confirm = [c["id"] for c in claims if c["test"] != "A/A" and c["id"] not in known]
    assert confirm == ["A4", "A5", "A6", "A7", "A12", "L2", "L3", "L4", "L5"]
    two = {d["id"]: d["verdict"] for d in bs.decide_claims(q_records, claims, alpha / 2)}
    assert [cid for cid in confirm if two[cid] == "holds"] == ["A7", "L2"]


def test_no_gpu_run_is_recorded_and_the_chapter_says_so():
    import nbformat

    assert not (ROOT / "book" / "data" / "benchmark_gpu.json").exists()
    nb = nbformat.read(ROOT / "book" / "05_benchmarking.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "This book records no GPU run." in text
    assert "No GPU run of the suite is recorded" in text


def _markdown(start: str) -> str:
    import nbformat

    nb = nbformat.read(ROOT / "book" / "05_benchmarking.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "markdown" and c.source.startswith(start)]
    return cell.source


#: The warning box's table: commit -> files it must touch (a path the record timed).
CHANGED_AFTER_RECORD = {
    "a33c79b": ["tutorial_pkg/attention/_probe.py", "tutorial_pkg/attention/backends.py"],
    "1872bf8": ["tutorial_pkg/attention/_kernel_rules.py"],
    "4054b7e": ["tutorial_pkg/encodings/rope_kernels.py"],
    "93075d1": ["tutorial_pkg/attention/backends.py"],
}


def test_the_warning_box_lists_code_changed_after_the_record():
    """Each commit of section 8's table is in HEAD's history, committed after the quiet record
    started, and touches a path the record timed; the box types the record's start."""
    from datetime import datetime

    quiet, _ = _load(QUIET)
    started = datetime.fromisoformat(quiet["hardware"]["date"])
    box = _markdown("```{admonition} Open: a new recording")
    assert f"started on {started:%Y-%m-%d} at {started:%H:%M} UTC" in box
    for commit, files in CHANGED_AFTER_RECORD.items():
        assert f"| `{commit}` |" in box, commit
        _git("merge-base", "--is-ancestor", commit, "HEAD")
        when = datetime.fromisoformat(_git("show", "-s", "--format=%cI", commit).strip())
        assert when > started, commit
        touched = _git("show", "--name-only", "--format=", commit).split()
        assert set(files) <= set(touched), commit
    # the record ran from a working tree at ff2a02e, before all of them
    assert quiet["hardware"]["commit"].startswith(RULE_COMMIT)


def test_the_changed_paths_touch_only_the_verdicts_the_box_names():
    """a33c79b: the key-row check passes on this CPU at the record's head widths (attention
    64, the LM step's d_model / heads), so auto timed the same call; 1872bf8: every GPU type
    answers no without a check (the CPU checks); 4054b7e changed the 16-bit fused path only
    (R6 is the fused claim in bfloat16, R5 in float32); no recorded case has one query."""
    import torch

    from tutorial_pkg.attention._kernel_rules import kernel_rules
    from tutorial_pkg.attention._probe import key_bias_supported

    quiet, records = _load(QUIET)
    widths = {r.params["head_dim"] for r in records if r.params.get("op") == "attention"}
    widths |= {r.params["d_model"] // r.params["heads"] for r in records
               if r.params.get("op") == "lm train step"}
    assert widths == {64, 16}
    assert all(key_bias_supported(torch.device("cpu"), torch.float32, False, w) for w in widths)
    assert kernel_rules("cpu").key_bias is None  # probed
    assert all(kernel_rules(t).key_bias is False for t in ("cuda", "xpu", "hpu", "mps"))
    claims = {c["id"]: c for c in quiet["claims"]}
    assert claims["R6"]["case"] == "rotate fused" and claims["R6"]["groups"]["dtype"] == "bfloat16"
    assert claims["R5"]["case"] == "rotate fused" and claims["R5"]["groups"]["dtype"] == "float32"
    assert all(r.params.get("seq_len", 2) > 1 for r in records)  # no one-query case


def test_the_warning_box_numbers_follow_from_the_record():
    """52 and 86 rounds (cell 'How many attention rounds'), 10 rounds, 63 minutes."""
    import math
    from statistics import NormalDist

    from tutorial_pkg.experiments.stats import t_quantile

    quiet, _ = _load(QUIET)
    alpha, k = quiet["alpha"], len(quiet["claims"])
    by_id = {d["id"]: d for d in quiet["decided"]}
    n_att = quiet["design"]["rounds"]["attention"]
    z_a, z_b = t_quantile(1 - alpha / (2 * k), 10_000), NormalDist().inv_cdf(0.8)
    need = {}
    for cid in ("A4", "A12"):
        hw = (math.log(by_id[cid]["high"]) - math.log(by_id[cid]["low"])) / 2
        need[cid] = math.ceil(n_att * (hw / math.log(1.05)) ** 2 * ((z_a + z_b) / z_a) ** 2)
    box = _markdown("```{admonition} Open: a new recording")
    assert f"{n_att} attention rounds are too few" in box
    assert f"A4 needs about {need['A4']} rounds and A12 about {need['A12']}" in box
    assert f"several times the {round(quiet['hardware']['run_time_s'] / 60)} minutes" in box


def test_the_auto_text_matches_the_kernel_rules_and_bloom():
    """Section 4 says the GPU types never take the key row (no check), and section 1 names
    Bloom's key-only (B*H, 1, L) row, built in every forward pass in the hidden states' dtype."""
    import inspect

    transformers = pytest.importorskip("transformers")
    from transformers.models.bloom import modeling_bloom

    from tutorial_pkg.attention._kernel_rules import KERNEL_RULES

    gpu_types = sorted(t for t, r in KERNEL_RULES.items() if r.key_bias is False)
    assert gpu_types == ["cuda", "hpu", "mps", "xpu"]
    text = _markdown("The backend does this on a CPU")
    assert "for `cuda`, `xpu`, `hpu` and `mps` the package's kernel rules" in text
    src = inspect.getsource(modeling_bloom)
    assert "return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)" in src
    forward = inspect.getsource(modeling_bloom.BloomModel.forward)
    assert "dtype=hidden_states.dtype" in forward and "alibi=alibi" in forward
    assert transformers.__version__ == "5.24.0"
    bloom = _markdown("The claim is backwards")
    assert "$(B \\cdot H, 1, L)$, in the hidden states' dtype" in bloom
