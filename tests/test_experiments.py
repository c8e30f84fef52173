"""Tests of tutorial_pkg.experiments.training: training, evaluation by length, scaling, records,
seeds."""

from __future__ import annotations

import math

import pytest
import torch

from tutorial_pkg.encodings.builtin import Rotary
from tutorial_pkg.experiments import training as experiments
from tutorial_pkg.experiments.data import load_splits
from tutorial_pkg.experiments.training import (
    ExperimentConfig,
    build_model,
    evaluate,
    evaluation_blocks,
    format_table,
    position_limit,
    run_extrapolation,
    scaled_rope,
    scaling_for,
    train,
    training_batches,
)
from tutorial_pkg.models.tiny_lm import TinyLM

NAMES = ["nope", "sinusoidal", "learned", "rope", "alibi", "hybrid"]
TINY = ExperimentConfig(
    d_model=32, n_layers=1, n_heads=2, train_len=16, steps=20, batch_size=8, lr=1e-2,
    warmup=5, eval_multiples=(1, 2), eval_tokens=512, eval_batch_tokens=256, device="cpu",
)
KEYS = {
    "encoding", "scaling", "factor", "train_len", "eval_len", "ratio", "ppl_all",
    "ppl_last_quarter", "nll_all", "nll_last_quarter", "n_windows", "n_tokens",
    "n_tokens_last_quarter", "note", "final_train_loss",
}


@pytest.fixture(scope="module")
def ids():
    train_ids, heldout_ids = load_splits()
    return train_ids[:100_000], heldout_ids[:20_000]


@pytest.fixture(scope="module")
def run(ids):
    models = {}
    records = run_extrapolation(NAMES, TINY, train_ids=ids[0], heldout_ids=ids[1],
                                models=models, progress=False)
    return records, models


def test_records_are_well_formed(run):
    records, _ = run
    # 6 encodings unscaled + 3 scalings for rope and hybrid, 2 lengths each
    assert len(records) == (6 + 3 + 3) * 2
    combos = [(r["encoding"], r["scaling"], r["eval_len"]) for r in records]
    assert len(set(combos)) == len(combos)
    for r in records:
        assert set(r) == KEYS
        assert r["train_len"] == 16 and r["eval_len"] == 16 * r["ratio"]
        assert r["ratio"] in (1, 2)
        if r["note"]:
            continue
        assert r["ppl_all"] > 1 and math.isfinite(r["ppl_all"])
        assert r["ppl_last_quarter"] > 1 and math.isfinite(r["ppl_last_quarter"])
        assert r["ppl_all"] == pytest.approx(math.exp(r["nll_all"]))
        # the same held-out tokens at every length
        assert r["n_tokens"] == 512 and r["n_windows"] * r["eval_len"] == 512
        assert r["n_tokens_last_quarter"] == 512 // 4
    scaled = {(r["encoding"], r["scaling"]) for r in records if r["scaling"] != "none"}
    assert scaled == {(e, s) for e in ("rope", "hybrid") for s in ("linear", "ntk", "yarn")}
    # training moved the models away from the uniform 256-way guess
    assert all(r["final_train_loss"] < math.log(256) - 0.5 for r in records)


def test_learned_is_none_past_train_len(run):
    records, _ = run
    learned = {r["ratio"]: r for r in records if r["encoding"] == "learned"}
    assert learned[1]["ppl_all"] is not None and learned[1]["note"] == ""
    assert learned[2]["ppl_all"] is None and learned[2]["ppl_last_quarter"] is None
    assert learned[2]["n_tokens"] == 0
    assert "cannot represent positions >= 16" in learned[2]["note"]
    assert all(r["note"] == "" for r in records if r["encoding"] != "learned")


def test_scaling_identity_at_ratio_one_and_effective_beyond(run):
    records, _ = run
    by = {(r["encoding"], r["scaling"], r["ratio"]): r for r in records}
    for enc in ("rope", "hybrid"):
        base1, base2 = by[(enc, "none", 1)], by[(enc, "none", 2)]
        for rule in ("linear", "ntk", "yarn"):
            assert by[(enc, rule, 1)]["factor"] == 1.0 and by[(enc, rule, 2)]["factor"] == 2.0
            assert by[(enc, rule, 1)]["ppl_all"] == pytest.approx(base1["ppl_all"], rel=1e-5)
            assert by[(enc, rule, 2)]["ppl_all"] != base2["ppl_all"]


def test_scaling_restored_after_evaluation(run, ids):
    _, models = run
    for enc in ("rope", "hybrid"):
        model, _ = models[enc]
        rope = model.encoding.rope
        assert rope.scaling is None
        fresh = build_model(enc, TINY).encoding.rope
        assert torch.equal(rope.inv_freq, fresh.inv_freq)
        assert rope.attention_factor == 1.0
    # restored even when the evaluation fails part-way
    model, _ = models["rope"]
    with pytest.raises(RuntimeError, match="boom"), scaled_rope(model, scaling_for("yarn", 64, 16)):
        assert model.encoding.rope.scaling["type"] == "yarn"
        raise RuntimeError("boom")
    assert model.encoding.rope.scaling is None


def test_models_and_losses_returned(run):
    _, models = run
    assert set(models) == set(NAMES)
    for name, (model, losses) in models.items():
        assert isinstance(model, TinyLM) and model.encoding.name == name
        assert not model.training
        assert len(losses) == TINY.steps and all(math.isfinite(v) for v in losses)
        assert sum(losses[-5:]) < sum(losses[:5])


def test_identical_results_when_run_twice(run, ids):
    records, models = run
    again = run_extrapolation(["learned", "hybrid"], TINY, train_ids=ids[0], heldout_ids=ids[1],
                              progress=False)
    first = [r for r in records if r["encoding"] in ("learned", "hybrid")]
    assert again == first


def test_same_batches_for_every_encoding(ids, monkeypatch):
    seen = {}
    real = experiments.training_batches

    def spy(train_ids, cfg):
        batches = list(real(train_ids, cfg))
        seen.setdefault("calls", []).append(batches)
        return iter(batches)

    monkeypatch.setattr(experiments, "training_batches", spy)
    cfg = ExperimentConfig(**{**TINY.to_dict(), "steps": 3, "eval_multiples": (1,)})
    run_extrapolation(["sinusoidal", "alibi"], cfg, (), train_ids=ids[0], heldout_ids=ids[1],
                      progress=False)
    a, b = seen["calls"]
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    other = list(training_batches(ids[0], ExperimentConfig(**{**cfg.to_dict(), "seed": 1})))
    assert not torch.equal(other[0][0], a[0][0])


def test_evaluation_blocks_share_tokens_across_lengths(ids):
    x, y = evaluation_blocks(ids[1], 64, 300)
    assert x.shape == y.shape == (4, 64)  # 300 // 64 blocks, evenly spaced
    assert torch.equal(x[:, 1:], y[:, :-1])
    short = x.reshape(-1, 16)
    assert torch.equal(short.flatten(), x.flatten())


def test_evaluate_keep_positions_and_mode_restored(run, ids):
    _, models = run
    model, _ = models["alibi"]
    model.train()
    rec = evaluate(model, ids[1], 16, (2,), eval_tokens=256, keep_positions=True)
    assert model.training
    model.eval()
    per_pos = rec[0]["nll_by_position"]
    assert len(per_pos) == 32
    assert sum(per_pos) / 32 == pytest.approx(rec[0]["nll_all"])
    assert sum(per_pos[24:]) / 8 == pytest.approx(rec[0]["nll_last_quarter"])


def test_build_model_accepts_an_encoding_instance(ids):
    from tutorial_pkg import Sinusoidal

    model = build_model(Sinusoidal(TINY.d_model), TINY)
    ref = build_model("sinusoidal", TINY)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    trained, losses = train(Sinusoidal(TINY.d_model), TINY, ids[0], progress=False)
    assert len(losses) == TINY.steps and trained.encoding.name == "sinusoidal"
    with pytest.raises(ValueError, match="encoding_kwargs"):
        build_model(Sinusoidal(TINY.d_model), TINY, {"base": 100.0})


def test_position_limit():
    assert position_limit(build_model("learned", TINY)) == 16
    assert position_limit(build_model("alibi", TINY)) is None
    rope = TinyLM(Rotary(16, max_positions=24), d_model=32, n_heads=2, n_layers=1)
    assert position_limit(rope) == 24
    # the model's size is the learned table's: a RoPE takes any position
    assert position_limit(TinyLM("rope", d_model=32, n_heads=2, n_layers=1,
                                 max_positions=24)) is None


def test_scaling_for():
    assert scaling_for(None, 64, 16) is None
    assert scaling_for("linear", 64, 16) == {"type": "linear", "factor": 4.0}
    assert scaling_for("ntk", 32, 16) == {"type": "ntk", "factor": 2.0}
    assert scaling_for("yarn", 128, 16) == {
        "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}


def test_format_table(run):
    records, _ = run
    table = format_table(records)
    lines = table.splitlines()
    assert lines[0].startswith("ppl_last_quarter by evaluation length")
    assert "16 (1x)" in lines[1] and "32 (2x)" in lines[1]
    assert len(lines) == 3 + 12 + 1  # title, header, rule, 12 rows, one note
    learned = next(line for line in lines if line.startswith("learned"))
    assert learned.split()[-1] == "n/a"
    assert "cannot represent positions >= 16" in lines[-1]
    assert "ppl_all" in format_table(records, "ppl_all", digits=1).splitlines()[0]


def test_config_presets_and_dict():
    gpu = ExperimentConfig.gpu()
    assert gpu.device == "cuda" and gpu.train_len == 256
    assert max(gpu.eval_multiples) * gpu.train_len == 2048
    assert ExperimentConfig.larger(steps=10).steps == 10
    d = TINY.to_dict()
    assert d["eval_multiples"] == [1, 2] and ExperimentConfig(**d) == TINY


def test_bad_inputs_raise(run, ids):
    _, models = run
    with pytest.raises(ValueError, match="divisible"):
        ExperimentConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="eval_tokens"):
        ExperimentConfig(train_len=64, eval_multiples=(1, 8), eval_tokens=100)
    with pytest.raises(TypeError, match="steps"):
        ExperimentConfig(steps=1.5)
    with pytest.raises(ValueError, match="schedule"):
        ExperimentConfig(schedule="linear")
    with pytest.raises(ValueError, match="warmup"):
        ExperimentConfig(warmup=-1)
    with pytest.raises(ValueError, match="seed"):
        ExperimentConfig(seed=-1)
    with pytest.raises(TypeError, match="weight_decay"):
        ExperimentConfig(weight_decay="0.1")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        ExperimentConfig(min_lr_ratio=1.5)
    with pytest.raises(TypeError, match="eval_multiples"):
        ExperimentConfig(eval_multiples=())
    with pytest.raises(TypeError, match="cfg"):
        train("rope", {"steps": 3}, ids[0])
    with pytest.raises(ValueError, match="encoding"):
        build_model("absolute", TINY)
    with pytest.raises(ValueError, match="encodings"):
        run_extrapolation(["rope", "alibi2"], TINY, train_ids=ids[0], heldout_ids=ids[1])
    with pytest.raises(TypeError, match="encodings"):
        run_extrapolation("rope", TINY, train_ids=ids[0], heldout_ids=ids[1])
    with pytest.raises(ValueError, match="rope_scalings"):
        run_extrapolation(["rope"], TINY, ("dynamic",), train_ids=ids[0], heldout_ids=ids[1])
    alibi, _ = models["alibi"]
    with pytest.raises(ValueError, match="RoPE"):
        evaluate(alibi, ids[1], 16, (1,), scaling="linear", eval_tokens=64)
    with pytest.raises(ValueError, match="scaling"):
        evaluate(models["rope"][0], ids[1], 16, (1,), scaling="dynamic", eval_tokens=64)
    with pytest.raises(TypeError, match="model"):
        evaluate("rope", ids[1], 16)
    with pytest.raises(ValueError, match="eval_tokens"):
        evaluate(alibi, ids[1], 16, (1, 8), eval_tokens=64)
    with pytest.raises(TypeError, match="records"):
        format_table([])
    with pytest.raises(TypeError, match="multiples"):
        evaluate(alibi, ids[1], 16, 2)


def test_summarize_seeds():
    recs = [{"seed": s, "encoding": "a", "eval_len": 4, "v": v}
            for s, v in ((0, 1.0), (1, 2.0), (2, 3.0))]
    recs.append({"seed": 0, "encoding": "b", "eval_len": 4, "v": None})
    rows = experiments.summarize_seeds(recs, "v", by=("encoding", "eval_len"))
    assert len(rows) == 1
    row = rows[0]
    assert row["encoding"] == "a" and row["mean"] == 2.0 and row["n"] == 3
    assert math.isclose(row["std"], 1.0) and (row["min"], row["max"]) == (1.0, 3.0)
    assert row["seeds"] == [0, 1, 2]
    with pytest.raises(ValueError, match="seed twice"):
        experiments.summarize_seeds(recs + recs[:1], "v", by=("encoding", "eval_len"))
    with pytest.raises(ValueError, match="'w'"):
        experiments.summarize_seeds(recs, "w", by=("encoding",))


def test_build_model_takes_a_schedule_instance():
    # a LayerSchedule is not a PositionEncoding, yet TinyLM takes it: so does build_model
    from tutorial_pkg.encodings.schedules import NoPEEvery
    from tutorial_pkg.experiments.training import ExperimentConfig, build_model

    cfg = ExperimentConfig(d_model=32, n_layers=2, n_heads=4, train_len=16, device="cpu")
    model = build_model(NoPEEvery(8, every=2), cfg)
    assert [type(b.attn.encoding).__name__ for b in model.blocks] == ["Rotary", "NoPE"]
    with pytest.raises(ValueError, match="encoding_kwargs"):
        build_model(NoPEEvery(8), cfg, {"base": 10.0})


# --------------------------------------------------------------------------- fixed targets

from tutorial_pkg.experiments.context_eval import (  # noqa: E402
    all_token_perplexity,
    evaluate_fixed_targets,
    fixed_target_windows,
)

_HELDOUT = torch.arange(5000) % 251  # a deterministic byte stream


def test_fixed_target_windows_score_the_same_targets_at_every_length():
    w = fixed_target_windows(_HELDOUT, (16, 32, 64), target_len=4, n_blocks=5)
    targets = [y[:, -4:] for _, y in w.values()]
    for t in targets[1:]:
        assert torch.equal(t, targets[0])
    for n, (x, y) in w.items():
        assert x.shape == y.shape == (5, n)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    # the context of the shorter window is the end of the longer one's
    assert torch.equal(w[16][0], w[64][0][:, -16:])


def _context_free_model() -> TinyLM:
    """NoPE TinyLM with zero attention outputs: each logit depends on its own token only."""
    model = TinyLM("nope", d_model=16, n_layers=1, n_heads=2, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "out_proj" in name or "o_proj" in name:
                p.zero_()
    return model


def test_a_model_that_ignores_context_gives_the_same_fixed_target_value_at_every_length():
    records = evaluate_fixed_targets(_context_free_model(), _HELDOUT, 16, (1, 2, 4),
                                     target_len=4, n_blocks=6)
    nll = [r["nll"] for r in records]
    assert all(abs(v - nll[0]) < 1e-6 for v in nll)
    assert [r["context_len"] for r in records] == [12, 28, 60]
    r = records[0]
    assert r["n_tokens"] == 24 and len(r["nll_by_block"]) == 6
    assert r["ppl_low"] <= r["ppl"] <= r["ppl_high"]
    # ... while the last-quarter measure of evaluate() scores other tokens at each length
    quarter = [q["nll_last_quarter"] for q in evaluate(_context_free_model(), _HELDOUT, 16,
                                                         (1, 2, 4), eval_tokens=384)]
    assert max(quarter) - min(quarter) > 1e-3


def test_all_token_perplexity_equals_evaluate_ppl_all():
    model = TinyLM("alibi", d_model=16, n_layers=1, n_heads=2, seed=0)
    ours = all_token_perplexity(model, _HELDOUT, 16, (1, 2), eval_tokens=256)
    ref = evaluate(model, _HELDOUT, 16, (1, 2), eval_tokens=256)
    for a, b in zip(ours, ref, strict=True):
        assert a["ppl"] == pytest.approx(b["ppl_all"], rel=1e-9)
        assert a["n_tokens"] == b["n_tokens"] and a["n_windows"] == b["n_windows"]
        assert a["ppl_low"] <= a["ppl"] <= a["ppl_high"]


def test_fixed_targets_respect_position_limits_and_check_arguments():
    learned = TinyLM("learned", d_model=16, n_layers=1, n_heads=2, max_positions=16, seed=0)
    records = evaluate_fixed_targets(learned, _HELDOUT, 16, (1, 2), n_blocks=3)
    assert records[0]["ppl"] is not None and records[1]["ppl"] is None
    assert "cannot represent" in records[1]["note"]
    with pytest.raises(ValueError):
        fixed_target_windows(_HELDOUT, (4, 16), target_len=8, n_blocks=2)
    with pytest.raises(ValueError):
        evaluate_fixed_targets(learned, _HELDOUT, 16, (1,), target_len=32)
    with pytest.raises(TypeError):
        evaluate_fixed_targets("model", _HELDOUT, 16)
    with pytest.raises(ValueError):
        fixed_target_windows(_HELDOUT[:100], (64,), target_len=4, n_blocks=5)


def test_copy_fraction_repeats_the_first_tokens_and_keeps_the_text(ids):
    cfg = ExperimentConfig(**{**TINY.to_dict(), "steps": 6, "batch_size": 64})
    copy_cfg = ExperimentConfig(**{**cfg.to_dict(), "copy_fraction": 0.5, "copy_len": 4})
    plain = list(training_batches(ids[0], cfg))
    copied = list(training_batches(ids[0], copy_cfg))
    assert len(copied) == len(plain) == 6
    s, n_rows, n_copied = 4, 0, 0
    for (xp, yp), (xc, yc) in zip(plain, copied, strict=True):
        assert torch.equal(xc[:, 1:], yc[:, :-1])  # still a shifted window
        wp = torch.cat([xp, yp[:, -1:]], 1)
        wc = torch.cat([xc, yc[:, -1:]], 1)
        for row in range(wp.shape[0]):
            n_rows += 1
            changed = (wp[row] != wc[row]).nonzero().flatten()
            if torch.equal(wp[row], wc[row]):
                continue  # not copied (or the copy equals the text already)
            n_copied += 1
            d = int(changed.min())
            # the only change is a copy of the first s tokens at some d in [s, L + 1 - s]
            starts = [k for k in range(s, wp.shape[1] - s + 1)
                      if torch.equal(wc[row, k:k + s], wc[row, :s])
                      and k <= d < k + s and int(changed.max()) < k + s]
            assert starts, f"row {row}: a change that is not a copy of the first {s} tokens"
            k = starts[0]
            assert torch.equal(torch.cat([wc[row, :k], wc[row, k + s:]]),
                               torch.cat([wp[row, :k], wp[row, k + s:]]))
    assert 0.35 < n_copied / n_rows < 0.65  # about copy_fraction of the windows
    again = list(training_batches(ids[0], copy_cfg))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, copied, strict=True))


@pytest.mark.parametrize("field, value", [("copy_fraction", -0.1), ("copy_fraction", 1.5),
                                          ("copy_len", 9)])
def test_copy_settings_are_checked(field, value):
    params = {**TINY.to_dict(), "copy_fraction": 0.5, field: value}  # train_len 16
    with pytest.raises(ValueError, match=field):
        ExperimentConfig(**params)
