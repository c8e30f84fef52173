"""Tests of tutorial_pkg.encodings.sinusoidal: the table of Vaswani et al. (2017) and its module."""

from __future__ import annotations

import math

import pytest
import torch

from tutorial_pkg.encodings.sinusoidal import (
    SinusoidalPositionalEmbedding,
    sinusoidal_frequencies,
    sinusoidal_table,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def paper_table(n_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)), element by element."""
    rows = []
    for p in range(n_pos):
        row = []
        for i in range(dim // 2):
            angle = p / base ** (2 * i / dim)
            row += [math.sin(angle), math.cos(angle)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("dim, base", [(2, 10000.0), (16, 10000.0), (10, 100.0)])
def test_table_equals_paper_formula(dim, base):
    table = sinusoidal_table(40, dim, base, dtype=torch.float64)
    assert table.shape == (40, dim)
    torch.testing.assert_close(table, paper_table(40, dim, base), rtol=0, atol=1e-12)


def test_default_dtype_is_float32_and_positions_tensor_matches_length():
    table = sinusoidal_table(8, 6)
    assert table.dtype == torch.float32
    torch.testing.assert_close(sinusoidal_table(torch.arange(8), 6), table)
    picked = torch.tensor([5, 0, 7])
    torch.testing.assert_close(sinusoidal_table(picked, 6), table[picked])


def test_frequencies():
    omega = sinusoidal_frequencies(8, 10000.0)
    assert omega.dtype == torch.float64
    expected = torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(omega, expected)
    assert omega[0] == 1.0 and bool((omega.diff() < 0).all())


def test_large_positions_stay_accurate():
    # angles are formed in float64, so p = 10**6 still gives the right sin/cos
    p = 10**6
    table = sinusoidal_table(torch.tensor([p]), 4, dtype=torch.float64)[0]
    expected = torch.tensor(
        [math.sin(p), math.cos(p), math.sin(p / 100.0), math.cos(p / 100.0)], dtype=torch.float64
    )
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-9)


def rotation_matrix(k: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Block-diagonal M_k with PE(p + k) = M_k PE(p): one 2x2 rotation per frequency."""
    m = torch.zeros(dim, dim, dtype=torch.float64)
    for i, w in enumerate(sinusoidal_frequencies(dim, base).tolist()):
        c, s = math.cos(k * w), math.sin(k * w)
        # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
        m[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=m.dtype)
    return m


@pytest.mark.parametrize("k", [1, 3, 17, 250])
def test_shift_is_a_block_diagonal_rotation_independent_of_position(k):
    dim = 12
    table = sinusoidal_table(300, dim, dtype=torch.float64)
    m_k = rotation_matrix(k, dim)
    # the same M_k maps every PE(p) to PE(p + k) ...
    shifted = table[: 300 - k] @ m_k.T
    torch.testing.assert_close(shifted, table[k:], rtol=0, atol=1e-10)
    # ... and it is a rotation: orthogonal with determinant 1
    torch.testing.assert_close(m_k @ m_k.T, torch.eye(dim, dtype=torch.float64))
    assert torch.linalg.det(m_k).item() == pytest.approx(1.0)


def test_dot_product_depends_only_on_offset():
    table = sinusoidal_table(200, 16, dtype=torch.float64)
    dots = table @ table.T
    for k in (0, 1, 5, 40):
        diag = torch.diagonal(dots, offset=k)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=0, atol=1e-10)


def test_module_adds_table_at_offsets_and_positions():
    pe = SinusoidalPositionalEmbedding(8)
    x = torch.randn(2, 5, 8)
    table = sinusoidal_table(20, 8)
    torch.testing.assert_close(pe(x), x + table[:5])
    torch.testing.assert_close(pe(x, offset=7), x + table[7:12])
    positions = torch.tensor([3, 1, 4, 1, 5])
    torch.testing.assert_close(pe(x, positions), x + table[positions])


def test_module_cache_grows_on_demand_and_is_not_saved():
    pe = SinusoidalPositionalEmbedding(4)
    assert pe.table.shape == (0, 4)
    x = torch.zeros(1, 3, 4)
    pe(x)
    first = pe.table.shape[0]
    assert first >= 3
    pe(torch.zeros(1, 100, 4))  # a contiguous extension: the table grows
    assert pe.table.shape[0] >= 100
    grown = pe.table.shape[0]
    out = pe(x, offset=5000)  # far past the cached rows: computed directly, no growth
    assert pe.table.shape[0] == grown
    torch.testing.assert_close(out[0], sinusoidal_table(torch.arange(5000, 5003), 4))
    assert len(pe.state_dict()) == 0


def test_module_keeps_input_dtype():
    pe = SinusoidalPositionalEmbedding(8)
    x = torch.randn(1, 4, 8, dtype=torch.bfloat16)
    out = pe(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x + sinusoidal_table(4, 8).to(torch.bfloat16))


def test_scale_multiplies_the_table_and_one_is_the_formula():
    x = torch.randn(2, 7, 8)
    plain = SinusoidalPositionalEmbedding(8)
    assert torch.equal(plain(x), x + sinusoidal_table(7, 8))  # scale 1: bit for bit
    half = SinusoidalPositionalEmbedding(8, scale=0.25)
    torch.testing.assert_close(half(x), x + 0.25 * sinusoidal_table(7, 8), rtol=0, atol=1e-7)
    meta = torch.empty(2, 7, 8, device="meta")  # rows computed directly: scaled there too
    assert half(meta, torch.arange(7, device="meta")).shape == (2, 7, 8)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            SinusoidalPositionalEmbedding(8, scale=bad)


def test_far_offset_computes_only_the_requested_rows():
    # 4 tokens at position 100000 must not build a (100004, d) table (the old cache did)
    pe = SinusoidalPositionalEmbedding(64)
    out = pe(torch.zeros(1, 4, 64), offset=100_000)
    assert pe.table.shape[0] <= 64
    assert torch.equal(out[0], sinusoidal_table(torch.arange(100_000, 100_004), 64))
    pe(torch.zeros(1, 8, 64))  # a short call afterwards: the cache grows as usual
    assert pe.table.shape == (64, 64)
    jump = torch.tensor([[0, 1, 2, 50_000]])  # a jump inside one call: rows computed directly
    torch.testing.assert_close(pe(torch.zeros(1, 4, 64), jump)[0],
                               sinusoidal_table(jump[0], 64), rtol=0, atol=1e-7)
    assert pe.table.shape == (64, 64)


def test_cache_grows_contiguously_and_stops_at_its_cap():
    pe = SinusoidalPositionalEmbedding(8, max_cached=256)
    for start in range(0, 300):  # token-by-token decoding from 0
        out = pe(torch.zeros(1, 1, 8), offset=start)
        torch.testing.assert_close(out[0], sinusoidal_table(torch.tensor([start]), 8),
                                   rtol=0, atol=1e-7)
    assert pe.table.shape[0] == 256  # doubled 64 -> 128 -> 256, then the cap
    assert SinusoidalPositionalEmbedding(4096).max_cached * 4096 == 2**24  # 64 MiB of float32
    train = SinusoidalPositionalEmbedding(8)
    train(torch.zeros(2, 3000, 8))  # a training length, from an empty cache: cached at once
    assert train.table.shape[0] == 3000
    with pytest.raises(ValueError, match="max_cached"):
        SinusoidalPositionalEmbedding(8, max_cached=0)


class _OldModule(torch.nn.Module):
    # the module before the cap: grows its table to any position asked for
    def __init__(self, dim):
        super().__init__()
        self.dim, self.table = dim, torch.empty(0, dim)

    def forward(self, x, positions):
        if self.table.shape[0] < int(positions.max()) + 1:
            size = max(int(positions.max()) + 1, 2 * self.table.shape[0], 64)
            self.table = sinusoidal_table(size, self.dim)
        return x + self.table[positions]


def test_rows_inside_the_cache_are_bit_identical_to_the_old_cache():
    new, old = SinusoidalPositionalEmbedding(32), _OldModule(32)
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(0))
    calls = [torch.arange(40), torch.arange(30, 70), torch.arange(100, 140),
             torch.arange(200, 240).flip(0), torch.arange(1000, 1040)]
    for positions in calls[:-1]:  # inside the cache (which grows contiguously): bit for bit
        assert torch.equal(new(x, positions), old(x, positions))
        assert torch.equal(new.table, old.table)  # the same rows, built the same way
    held = new.table.shape[0]
    far = calls[-1]  # far past it: the old table grew to 1040 rows, the new one does not
    torch.testing.assert_close(new(x, far), old(x, far), rtol=0, atol=1e-6)
    assert new.table.shape[0] == held < old.table.shape[0] == 1040


def test_a_device_without_float64_gets_float32_rows_built_on_the_cpu():
    # Apple's MPS has no float64: the rows are built in float64 on the CPU, then moved as
    # float32 (a fake MPS tensor shows the path without an Apple machine; before, the
    # float64 angles were made on the device itself)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tutorial_pkg.encodings.sinusoidal import _rows  # the module's cache and far rows

    with FakeTensorMode(allow_non_fake_inputs=True):
        table = sinusoidal_table(6, 8, device="mps")
        assert table.device.type == "mps" and table.dtype == torch.float32
        rows = _rows(torch.tensor([0, 5, 100000], device="mps"), 8, 10000.0)
        assert rows.device.type == "mps" and rows.dtype == torch.float32
    want = sinusoidal_table(6, 8)  # the CPU path is unchanged
    torch.testing.assert_close(want, sinusoidal_table(torch.arange(6), 8), rtol=0, atol=0)
