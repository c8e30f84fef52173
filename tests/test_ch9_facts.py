"""The facts chapter 9 states about the pinned transformers' source.

Chapter 9 quotes lines of transformers' code (bug 10: how BLOOM and Falcon build the ALiBi bias;
bug 18: where Falcon's eager path adds the bias a second time) and says which RoPE pairing the
DeepSeek-V3.2 and GLM-MoE-DSA indexers use and that no file of either model reads the config key
``indexer_rope_interleave`` (bug 17). Reading installed sources is no reader's cell, so these tests
hold the prose true: each quoted line must be in the function the chapter names, and each line the
chapter quotes must be one of these.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.bloom import modeling_bloom  # noqa: E402
from transformers.models.deepseek_v32 import (  # noqa: E402
    configuration_deepseek_v32,
    modeling_deepseek_v32,
)
from transformers.models.falcon import modeling_falcon  # noqa: E402
from transformers.models.glm_moe_dsa import (  # noqa: E402
    configuration_glm_moe_dsa,
    modeling_glm_moe_dsa,
)

CHAPTER = Path(__file__).resolve().parents[1] / "book" / "09_debugging.ipynb"

# (function, the line the chapter quotes from it)
ALIBI_LINES = [  # bug 10
    (modeling_bloom.build_alibi_tensor,
     "return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)"),
    (modeling_bloom.BloomModel.forward,
     "alibi = self.build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)"),
    (modeling_falcon.build_alibi_tensor, "alibi = slopes[..., None].bfloat16() * arange_tensor"),
]
FALCON_TWICE_LINES = [  # bug 18
    (modeling_falcon.FalconModel.forward,
     "alibi / math.sqrt(self.config.hidden_size // self.num_heads),"),
    (modeling_falcon.FalconAttention.forward,
     "attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)"),
    (modeling_falcon.FalconAttention.forward, "attention_logits *= self.inv_norm_factor"),
    (modeling_falcon.FalconAttention.forward,
     "attention_probs = F.softmax(attention_logits + attention_mask, dim=-1, "
     "dtype=hidden_states.dtype)"),
]


def _lines(function):
    return [line.strip() for line in inspect.getsource(function).splitlines()]


def _cell(cell_id):
    cells = json.loads(CHAPTER.read_text())["cells"]
    return "".join(next(c["source"] for c in cells if c.get("id") == cell_id))


def test_the_pinned_transformers_is_installed():
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    assert (major, minor) == (5, 24)  # pyproject.toml: transformers>=5.24,<5.25


@pytest.mark.parametrize("function, line", ALIBI_LINES + FALCON_TWICE_LINES)
def test_each_quoted_line_is_in_the_named_function(function, line):
    assert line in _lines(function)


def test_falcon_eager_scales_the_bias_before_adding_the_mask_that_holds_it():
    """Bug 18's order: the bias is added, the sum scaled, then the mask (bias / sqrt(d)) added."""
    lines = _lines(modeling_falcon.FalconAttention.forward)
    at = [lines.index(line) for _, line in FALCON_TWICE_LINES[1:]]
    assert at == sorted(at) and at[-1] - at[0] == 2


@pytest.mark.parametrize("cell_id, quoted", [("4dc1220d", ALIBI_LINES),
                                             ("27d0781c", FALCON_TWICE_LINES)])
def test_the_chapter_quotes_exactly_these_lines(cell_id, quoted):
    block = _cell(cell_id).split("```python\n")[1].split("```")[0]
    written = [line.strip() for line in block.splitlines()
               if line.strip() and not line.lstrip().startswith("#")]
    assert written == [line for _, line in quoted]


def test_the_indexers_rotate_as_the_chapter_says():
    glm = _lines(modeling_glm_moe_dsa.GlmMoeDsaIndexer.forward)
    ds = _lines(modeling_deepseek_v32.DeepseekV32Indexer.forward)
    rope_call = "q_rot, k_rot = apply_rotary_pos_emb{}(q_rot, k_rot, cos, sin, unsqueeze_dim=2)"
    assert rope_call.format("_interleave") in glm and rope_call.format("") not in glm
    assert rope_call.format("") in ds and rope_call.format("_interleave") not in ds
    assert ("# The indexer uses NON-interleaved (half-split) RoPE — unlike the main MLA attention"
            in ds)


@pytest.mark.parametrize("module", [configuration_deepseek_v32, modeling_deepseek_v32,
                                    configuration_glm_moe_dsa, modeling_glm_moe_dsa])
def test_no_file_of_either_model_reads_indexer_rope_interleave(module):
    assert "indexer_rope_interleave" not in inspect.getsource(module)


def test_sdpa_masks_torch_fix_is_retired():
    """Bug 4: transformers' own correction of rows that see no key is documented as a no-op."""
    from transformers import masking_utils

    doc = inspect.getdoc(masking_utils.sdpa_mask)
    at = doc.index("allow_torch_fix")
    assert "Deprecated and has no effect" in doc[at:at + 120]


def _bug_numbers():
    cells = json.loads(CHAPTER.read_text())["cells"]
    return [int(m.group(1)) for c in cells if c["cell_type"] == "markdown"
            for m in re.finditer(r"^## (\d+)\. ", "".join(c["source"]), re.M)]


def test_the_map_the_headings_and_the_summary_count_the_same_bugs():
    """Cell 0 names the count in words; each bug has a heading and one summary row, in order."""
    numbers = _bug_numbers()
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) == 21
    intro = _cell("1c1fa85f")
    assert "reproduces twenty-one bugs of these kinds" in intro and "the twenty-one bugs" in intro
    cells = json.loads(CHAPTER.read_text())["cells"]
    table = next(c for c in cells if c.get("id") == "ch9-summary-table")
    assert table["cell_type"] == "markdown"
    rows = [int(m.group(1)) for m in re.finditer(r"^\| (\d+)\. ", "".join(table["source"]), re.M)]
    assert rows == numbers


def test_the_split_of_reported_bugs():
    """Cell 0 and the summary: nineteen bugs cite a report (seventeen an issue or pull request,
    bug 14 Qwen's model cards, bug 19 an article's layer); bug 5 is the book's illustration, bug 18
    was found here. Counted from the summary's "reported in" column and the bugs' own cells."""
    table = _cell("ch9-summary-table")
    cited = {int(m.group(1)): m.group(2) for m in
             re.finditer(r"^\| (\d+)\. [^|]+\| ([^|]+) \|", table, re.M)}
    assert len(cited) == 21
    assert cited[5].startswith("no report found; this book's illustration")
    assert cited[18].startswith("found here")
    assert cited[14] == "Qwen model cards" and cited[19].startswith("article 002's")
    issues = {n for n, text in cited.items() if re.search(r"#\d+", text)} - {18}
    assert issues == set(range(1, 22)) - {5, 14, 18, 19}
    cells = json.loads(CHAPTER.read_text())["cells"]
    bug = {int(m.group(1)): "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
           for m in re.finditer(r"^## (\d+)\. ", "".join(c["source"]), re.M)}
    assert "**The bug, the book's illustration** (no issue or pull request is cited" in bug[5]
    assert "Confirmed by this chapter's probes" in bug[18] and "we found no report" in bug[18]
    assert all(re.search(r"^\*\*Reports?\.\*\*", bug[n], re.M) for n in set(bug) - {5})
    intro = " ".join(_cell("1c1fa85f").split())
    assert ("Nineteen cite a report: seventeen an issue or pull request" in intro
            and len(issues) == 17 and len(cited) - 2 == 19)
    assert "bug 5 is the book's illustration" in intro and "bug 18 was found by this" in intro
    summary = " ".join(_cell("2e2e24cd").split())
    assert "Nineteen bugs cite a report; bug 5 is the book's illustration and bug 18 was found" \
        in summary


def test_qwen2_5_vl_keeps_the_rope_delta_for_decoding():
    """Bug 21's fix: get_rope_index returns the delta, the model keeps it as rope_deltas and adds
    it to the cache length when it decodes."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    model = modeling_qwen2_5_vl.Qwen2_5_VLModel
    doc = inspect.getdoc(model.get_rope_index)
    assert "position_ids (`torch.LongTensor` of shape `(3, batch_size, sequence_length)`)" in doc
    assert "mrope_position_deltas" in doc
    lines = _lines(model.compute_3d_position_ids)
    assert "self.rope_deltas = rope_deltas" in lines
    assert "position_ids = torch.arange(cache_length, cache_length + seq_length)" in lines
    assert "position_ids = position_ids + delta.to(device=position_ids.device)" in lines


def test_get_rope_index_reads_the_token_types_not_the_ids():
    """Bug 21's detection passes zeros for the ids: only their shape and device are read."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    source = inspect.getsource(modeling_qwen2_5_vl.Qwen2_5_VLModel.get_rope_index)
    body = source.split('"""')[2]  # after the docstring
    uses = [line.strip() for line in body.splitlines() if "input_ids" in line]
    assert uses and all(re.search(r"input_ids\.(shape|dtype|device)|enumerate\(input_ids\)|"
                                  r"current_input_ids\b", u) for u in uses)
    assert "input_token_type = mm_token_type_ids[batch_idx]" in _lines(
        modeling_qwen2_5_vl.Qwen2_5_VLModel.get_rope_index)


def test_qwen3_norms_before_rotating_and_hunyuan_after():
    """The QK-norm section: Qwen3 normalises q and k, then rotates; HunYuan-V1-Dense rotates, then
    normalises (the order each model's attention forward runs them in)."""
    from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense
    from transformers.models.qwen3 import modeling_qwen3

    rope = "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
    qwen3 = _lines(modeling_qwen3.Qwen3Attention.forward)
    norm = next(i for i, line in enumerate(qwen3) if line.startswith("query_states = self.q_norm("))
    assert norm < qwen3.index(rope)
    hunyuan = _lines(modeling_hunyuan_v1_dense.HunYuanDenseV1Attention.forward)
    assert hunyuan.index(rope) < hunyuan.index("query_states = self.query_layernorm(query_states)")


# ---- the prose's readings of stored records and stored outputs -------------------------------
# The chapter's cells print what a record or a probe holds; the readings the prose gives of them
# are checked here, so that a changed record (or a changed run) fails a test, not a reader's cell.

DATA = CHAPTER.parent / "data"


def _text(cell_id):
    """A cell's source with its line breaks and runs of spaces folded to one space."""
    return " ".join(_cell(cell_id).split())


def _output(cell_id):
    cells = json.loads(CHAPTER.read_text())["cells"]
    cell = next(c for c in cells if c.get("id") == cell_id)
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def _signed(x, digits=3):
    """A difference as the prose writes it: explicit sign, Unicode minus."""
    return f"{x:+.{digits}f}".replace("-", "\u2212")


def test_the_empty_row_reading_of_the_cpu_kernels():
    """Bug 4 (cells 4e67aa1c / ef86a8eb): on the CPU that stored the outputs, the two kernels that
    take the mask, math and flash_attention, give the padded row zeros in every dtype tried."""
    out = _output("4e67aa1c")
    assert "SDPA on cpu, the padded row's first query:" in out
    rows = [line.split() for line in out.split("the padded row's first query:\n")[1].splitlines()]
    assert {kernel for kernel, _, _ in rows} == {"math", "flash_attention"}
    assert {dtype for _, dtype, _ in rows} == {"float32", "float16", "bfloat16"} and len(rows) == 6
    assert {verdict for _, _, verdict in rows} == {"zeros"}
    text = _text("ef86a8eb")
    assert ("(`math` and `flash_attention`) give the empty row zeros in every dtype tried" in text)


def _alibi_rounding(report):
    m = re.search(r"bias rounding: max ([\d.]+) nats, above tol from distance (\d+)", report)
    return float(m.group(1)), int(m.group(2))


def test_the_bf16_alibi_readings():
    """Bug 10 (cells e16c6cf7, 347744d3 -> 2e1265e1): the key-only bias is off from distance 1 by
    up to 1.5; the mask the package hands SDPA for bfloat16 q is exact up to distance 256 and off by
    up to 1 at the longest distances of 16L."""
    key_only = _alibi_rounding(_output("e16c6cf7"))
    handed = _alibi_rounding(
        _output("347744d3").split("bfloat16 q, the package's sdpa backend:")[1])
    assert key_only == (1.5, 1) and handed == (1.0, 257)
    text = _text("2e1265e1")
    assert f"exact up to distance {handed[1] - 1}" in text
    assert f"off by up to {handed[0]:g} score unit" in text
    assert f"off from distance {key_only[1]} on, by up to {key_only[0]:g}" in text


def _nll(record):
    return {(r["rule"], r["length"]): r["nll_by_block"] for r in record["results"]}


def _mean(xs):
    return sum(xs) / len(xs)


def test_the_yarn_factor_reading():
    """Bug 12 (cell b0c59513 -> 63a3e826): the verdicts, differences, intervals, blocks and
    perplexities the text gives, from smollm2_yarn_factor.json and chapter 7's record."""
    import math

    yarn = json.loads((DATA / "smollm2_yarn_factor.json").read_text())
    context = json.loads((DATA / "smollm2_context.json").read_text())
    decided = {d["claim"]: d for d in yarn["decided"]}
    dropped, twice = (decided["dropping the factor costs at 2x"],
                      decided["applying it twice costs at 2x"])
    assert (dropped["verdict"], twice["verdict"]) == ("not resolved", "holds")
    nll, unscaled = _nll(yarn), _nll(context)
    higher = {}
    for c in yarn["claims"]:
        d = [a - b for a, b in zip(nll[c["rule"], c["length"]],
                                   nll[c["against"], c["against_length"]], strict=True)]
        higher[c["claim"]] = sum(x > 0 for x in d)
    assert higher == {"dropping the factor costs at 2x": 1, "applying it twice costs at 2x": 4}
    text = _text("63a3e826")
    ppl = lambda key, table=nll: f"{math.exp(_mean(table[key])):.1f}"  # noqa: E731
    assert (f"the unscaled model's perplexity is {ppl(('none', 16384), unscaled)} and YaRN as "
            f"configured brings it to {ppl(('yarn', 16384))}") in text
    assert (f"moves the loss by {_signed(dropped['difference'])} nats per token, interval "
            f"[{_signed(dropped['low'])}, {_signed(dropped['high'])}], which includes 0: not "
            "resolved (the loss rises in 1 of the 4 blocks and falls in the other 3)") in text
    assert (f"costs {_signed(twice['difference'])} nats per token, interval "
            f"[{_signed(twice['low'])}, {_signed(twice['high'])}]: the claim holds, and the loss "
            "rises in all 4 blocks") in text
    assert (f"the perplexities are {ppl(('yarn', 512))} as configured, "
            f"{ppl(('yarn, factor dropped', 512))} without the factor and "
            f"{ppl(('yarn, factor twice', 512))} with it twice") in text


def test_the_yarn_inside_the_trained_length_reading():
    """Bug 14, the real model (cell bb8235c0 -> 6defe489): YaRN costs in every block at both
    lengths the record has inside the trained length."""
    context = json.loads((DATA / "smollm2_context.json").read_text())
    nll = _nll(context)
    inside = sorted(n for rule, n in nll if rule == "none"
                    and n <= context["original_max_position_embeddings"])
    assert len(inside) == 2
    assert all(a > b for n in inside for a, b in zip(nll["yarn", n], nll["none", n], strict=True))
    assert "YaRN costs in every block at both lengths" in _text("6defe489")


def test_the_cpu_sdpa_mask_reading():
    """Bug 16 (cell 6560500f, text ch9-sdpa-cpu-md): avx2 and default off by 3.54 where outputs
    reach 2.53, the CPU's own AVX512 kernels within the tolerance, the mask in q's dtype right at
    every level."""
    record = json.loads((DATA / "sdpa_avx2_mask.json").read_text())
    runs = {r["ATEN_CPU_CAPABILITY"]: r for r in record["runs"]}
    assert set(runs) == {"avx2", "default", None}
    wrong = {runs[c]["max_error"] for c in ("avx2", "default")}
    assert all(not runs[c]["right"] for c in ("avx2", "default")) and len(wrong) == 1
    scale = {r["output_scale"] for r in runs.values()}
    assert len(scale) == 1 and all(r["right_fixed"] for r in runs.values())
    assert runs[None]["right"] and record["tolerance"] == 1e-12
    text = _text("ch9-sdpa-cpu-md")
    assert (f"the outputs are off from float64 math by up to {wrong.pop():g}, where the outputs "
            f"themselves reach at most {scale.pop():g}") in text
    assert f"with the CPU's own kernels ({runs[None]['capability']}) they are within $10^{{-12}}$" \
        in text
    assert "with the mask cast to q's dtype the call is right at every level" in text


def test_the_yarn_record_pairs_with_chapter_7s():
    """Bug 12 (cell b0c59513): both records score the same targets, and each recorded difference
    is the mean of the per-block differences the cell prints."""
    yarn = json.loads((DATA / "smollm2_yarn_factor.json").read_text())
    context = json.loads((DATA / "smollm2_context.json").read_text())
    assert yarn["block_ends"] == context["block_ends"] and yarn["targets"] == context["targets"]
    nll, decided = _nll(yarn), {d["claim"]: d for d in yarn["decided"]}
    for c in yarn["claims"]:
        d = [a - b for a, b in zip(nll[c["rule"], c["length"]],
                                   nll[c["against"], c["against_length"]], strict=True)]
        assert abs(_mean(d) - decided[c["claim"]]["difference"]) < 1e-6


def test_the_live_window_reproduces_the_record():
    """Bug 12 (cell bc782103): the live NLL of each rule on the first block's shortest window, as
    stored, equals the record's to the printed digits, and the record's is printed right."""
    yarn = json.loads((DATA / "smollm2_yarn_factor.json").read_text())
    nll = _nll(yarn)
    found = re.findall(r"^(.+?)\s+N=(\d+): NLL ([\d.]+) nats live, ([\d.]+) in the record$",
                       _output("bc782103"), re.M)
    assert [variant for variant, *_ in found] == list(yarn["rules"])
    for variant, n, live, recorded in found:
        assert abs(float(live) - float(recorded)) <= 2e-3
        assert recorded == f"{nll[variant, int(n)][0]:.3f}"


def test_the_seed_family_reading():
    """Bugs 10, 13, 14 over five seeds (cell ch9-seeds-family -> ch9-seeds-reading): the four
    claims, their tests and the confidence are fixed in the cell's source; the stored output has
    each claim held with every seed in its direction, as the reading says."""
    source = _cell("ch9-seeds-family")
    assert "SEEDS = range(5)" in source and "stats.bonferroni(0.95, len(FAMILY))" in source
    number = r"([+-]\d\.\d\d)"
    rows = re.findall(rf"^  (bug \d+: .+?)\s+{number} \[{number}, {number}\] "
                      r"(\w[\w ]*?) \((\d) of (\d) seeds agree\)$", _output("ch9-seeds-family"),
                      re.M)
    assert len(rows) == 4
    for claim, _, low, high, verdict, agree, n in rows:
        assert verdict == "holds" and agree == n == "5"
        assert (float(low) > 0) if "helps" not in claim else (float(high) < 0)
    assert "All four claims hold, and every seed" in _text("ch9-seeds-reading")
    for cell_id in ("ch9-seeds-plan", "ch9-seeds-reading", "123bb967"):  # not pre-registered
        text = " ".join(_cell(cell_id).split())
        assert "not a pre-registered test" in text and "check across seeds" in text
    assert "decides the four on fresh seeds is open" in " ".join(_cell("ch9-seeds-plan").split())
    assert "five seeds)" not in _cell("ch9-summary-table")


def test_the_serving_section_says_what_it_reproduces():
    """Cell ch9-serving-md: only the chunked prefill has a cell; the other three are described."""
    text = _text("ch9-serving-md")
    assert "the first is reproduced below, the other three are described from the cited sources, " \
        "not reproduced here" in text
    assert "(described from their sources, not reproduced)" in _text("1c1fa85f")
