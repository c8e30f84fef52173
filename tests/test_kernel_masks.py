"""What the backends hand to ``scaled_dot_product_attention``: a mask that is bool or of
q's dtype, 4-D, on every path (issue 34).

PyTorch documents "a float mask of the same type as query". torch 2.13's CPU kernel takes
a float32 mask with float64 queries, and on AVX2 CPUs computes garbage from it (an error
of 2.3 on unit-scale outputs); on AVX-512 CPUs it does not. So the check here is on the
call, not on the output: it fails on a wrong dtype on every CPU. Each case also compares the
output with the float64 textbook form, so that the fix is right, not only well typed.

Every encoding x dtype (float64, float32, bfloat16, float16), with its buffers and
parameters in the module's dtype and in another one, through ``sdpa``, ``auto`` and
``flex`` (whose fallbacks are sdpa), on whole sequences, explicit positions, left padding,
a window, packed documents and a KV-cache decoding step. ``.ci/check`` re-runs this file
under the second CPU-kernel setting (``ATEN_CPU_CAPABILITY``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tutorial_pkg.attention.layer import KVCache, MultiHeadAttention
from tutorial_pkg.diagnose import record_sdpa_masks

from .layer_cases import LAYER_MARKS, D, H, encoding

pytestmark = LAYER_MARKS

ENCODINGS = ["nope", "sinusoidal", "learned", "rope", "alibi", "alibi-key_only", "hybrid",
             "t5"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
#: the other dtype the encoding's tensors are kept in
OTHER = {torch.float64: torch.float32, torch.float32: torch.float64,
         torch.bfloat16: torch.float32, torch.float16: torch.float64}
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}
S = 9


def _encoding(key: str):
    if key == "alibi-key_only":
        from tutorial_pkg.encodings.builtin import ALiBi

        return ALiBi(H, mode="key_only")
    return encoding(key)


@pytest.fixture
def sdpa_calls():
    """Every call of ``F.scaled_dot_product_attention`` by the backends: (q dtype, mask)."""
    with record_sdpa_masks() as report:
        yield report


def _calls(layer: MultiHeadAttention, x: torch.Tensor):
    """The layer on each kind of call: name -> output. Flex calls SDPA only where it falls
    back (the decoding step here) and builds a block mask per call for padding and
    documents (slow): it gets whole sequences and the decoding step."""
    b, s, _ = x.shape
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[0, :3] = True  # left padding
    left = (torch.arange(s) - 3).clamp_min(0).expand(b, s).clone()
    left[1] = torch.arange(s)
    docs = torch.tensor([[0] * 4 + [1] * (s - 4)] * b)
    out = {"whole": layer(x)}
    if layer.backend != "flex":
        out["positions"] = layer(x, positions=torch.arange(100, 100 + s))
        out["left padding"] = layer(x, positions=left, key_padding_mask=pad)
        out["documents"] = layer(x, document_ids=docs)
    cache = KVCache()
    first = layer(x[:, :-1], kv_cache=cache)
    out["decoding step"] = torch.cat([first, layer(x[:, -1:], kv_cache=cache)], dim=1)
    return out


@pytest.mark.parametrize("buffers", ["same", "other"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("key", ENCODINGS)
def test_every_sdpa_mask_is_bool_or_of_q_dtype_and_right(sdpa_calls, key, dtype, buffers):
    torch.manual_seed(0)
    enc = _encoding(key)
    naive = MultiHeadAttention(D, H, enc, backend="naive", n_kv_heads=2).double()
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _calls(naive, x.double())
    for backend in ("sdpa", "auto", "flex"):
        for window in (None, 4) if backend != "flex" else (None,):
            layer = MultiHeadAttention(D, H, _encoding(key), backend=backend, n_kv_heads=2,
                                       window=window)
            layer.load_state_dict(naive.state_dict())
            layer = layer.to(dtype)
            if buffers == "other":
                layer.encoding.to(OTHER[dtype])
            ref = naive
            if window is not None:
                ref = MultiHeadAttention(D, H, _encoding(key), backend="naive", n_kv_heads=2,
                                         window=window).double()
                ref.load_state_dict(naive.state_dict())
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # flex's fallbacks
                got = _calls(layer, x.to(dtype))
                expect = want if window is None else _calls(ref, x.double())
            for name, out in got.items():
                where = f"{backend}, window {window}, {name}"
                scale = expect[name].abs().max().item()
                err = (out.double() - expect[name]).abs().max().item()
                assert err <= TOL[dtype] * max(1.0, scale), (where, err)
    assert sdpa_calls.calls, "no call reached SDPA"
    assert sdpa_calls.ok, sdpa_calls.problems
    assert all(shape is None or len(shape) == 4 for _, _, shape in sdpa_calls.calls)


def test_16_bit_auto_takes_the_shifted_table_not_a_float32_row(sdpa_calls):
    # a key row of 16 bits would lose m j's low bits, one of float32 is not documented
    layer = MultiHeadAttention(D, H, _encoding("alibi"), backend="auto").bfloat16()
    x = torch.randn(1, 300, D).bfloat16()
    with torch.no_grad():
        layer(x)
    assert sdpa_calls.calls == [(torch.bfloat16, torch.bfloat16, (1, H, 300, 300))]


def test_the_probe_names_a_float32_mask_with_float64_q():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with record_sdpa_masks() as report:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(4, 4))
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert not report.ok and len(report.calls) == 2
    assert report.problems == ["call 1: a torch.float32 mask with torch.float64 q "
                               "(documented: bool or q's dtype)"]
    assert torch.nn.functional.scaled_dot_product_attention.__name__ != "recording"


def test_the_probe_keeps_each_mask_as_the_kernel_received_it():
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    bias = torch.randn(1, 2, 4, 4).bfloat16()
    with record_sdpa_masks() as report:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert report.masks[0] is bias and report.masks[1] is None
