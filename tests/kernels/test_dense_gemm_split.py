"""The row-invariant dense GEMM (kernels/gemm/dense.py) with its split-K active, interpreted on a CPU (8 SMs
there, kernels/mla_plan.num_sms): a row computed among M = 9, 17, 40 rows equals, bit for bit, the row
computed alone (M = 1); the result matches the torch fp32 reference; the chunk rule depends on the weight's
shape and the SM count only, and covers K once."""

from __future__ import annotations

import pytest
import torch
import triton

from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

# isort: split
from ddtree.kernels.gemm import dense as dg
from ddtree.kernels.mla.plan import num_sms
from ddtree.tools.selftest.compare import assert_close

SIZES = (1, 9, 17, 40)
PROBE = (0, 5, 8)  # rows compared with their solo twin


def _t(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def _rows_differing(fn, x: torch.Tensor) -> list[tuple[int, int]]:
    """(M, row) where fn(x[:M])[row] differs from fn(x[row:row + 1])."""
    solo = {r: fn(x[r : r + 1]).cpu() for r in PROBE}
    return [(M, r) for M in SIZES[1:] for r in PROBE if not torch.equal(fn(x[:M]).cpu()[r : r + 1], solo[r])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_split_dense_gemm_is_row_invariant_and_matches_torch(dtype):
    N, K = 130, 1100  # 3 column tiles, K no multiple of the 64-column tile nor of the chunk
    _, splits, _ = dg.gemm_tiles(1, N, K, num_sms(torch.device(DEVICE)))
    assert splits > 1, "the split must be active at this shape"
    x = _t(max(SIZES), K, seed=0, dtype=dtype, scale=2.0)
    w = _t(N, K, seed=1, dtype=dtype, scale=1 / 16)
    b = _t(N, seed=2, dtype=dtype)
    assert _rows_differing(lambda v: dg.dense_gemm(v, w, b), x) == []
    y = dg.dense_gemm(x, w, b)
    expected = (x.float().cpu() @ w.float().cpu().T + b.float().cpu()).to(dtype)
    assert y.dtype == dtype and y.shape == (max(SIZES), N)
    assert_close(f"split dense gemm {dtype}", y.cpu(), expected)


def test_split_head_gemm_is_row_invariant_and_matches_torch():
    """Per-head weights as MLA's absorption passes them (a transposed view: strides, not contiguous)."""
    H, N, K = 2, 64, 1100
    assert dg.gemm_tiles(H, N, K, num_sms(torch.device(DEVICE)))[1] > 1
    w = _t(H, K, N, seed=3, dtype=torch.bfloat16, scale=1 / 16).transpose(1, 2)  # [H, N, K] view
    x = _t(max(SIZES), H, K, seed=4, dtype=torch.bfloat16, scale=2.0)
    assert _rows_differing(lambda v: dg.head_gemm(v, w), x) == []
    y = dg.head_gemm(x, w)
    expected = torch.einsum("thk,hnk->thn", x.float().cpu(), w.float().cpu()).to(torch.bfloat16)
    assert_close("split head gemm", y.cpu(), expected)


def test_split_launches_two_kernels_with_the_chunks_in_the_grid(monkeypatch):
    """The GEMM over S chunks (grid z = batch x S) then the ordered sum; one launch when unsplit."""
    launched = []
    cls = type(dg._dense_gemm_kernel)
    real = cls.__getitem__
    monkeypatch.setattr(
        cls, "__getitem__", lambda self, grid, real=real: launched.append((self, grid)) or real(self, grid)
    )
    x = _t(3, 1100, seed=5, dtype=torch.float32)
    dg.dense_gemm(x, _t(130, 1100, seed=6, dtype=torch.float32))
    block_n, splits, _ = dg.gemm_tiles(1, 130, 1100, num_sms(torch.device(DEVICE)))
    sum_programs = triton.cdiv(3 * 130, dg.SUM_BLOCK)
    assert [(k, tuple(g)) for k, g in launched] == [(dg._dense_gemm_kernel, (1, triton.cdiv(130, block_n), splits)),
                                                    (dg._dense_gemm_sum_kernel, (sum_programs,))]  # fmt: skip
    launched.clear()
    dg.dense_gemm(x[:, :200], _t(130, 200, seed=7, dtype=torch.float32))  # K < 2 chunks: no split
    assert [k for k, _ in launched] == [dg._dense_gemm_kernel]


@pytest.mark.parametrize("sms", [8, 132, 188])
@pytest.mark.parametrize("batch,N,K", [(1, 2112, 7168), (1, 512, 7168), (1, 7168, 1024), (1, 7168, 256),
                                       (1, 20480, 7168), (8, 128, 512), (8, 512, 128), (1, 130, 1000)])  # fmt: skip
def test_tile_rule_covers_k_once_and_fills_the_sms(batch, N, K, sms):
    block_n, splits, chunk = dg.gemm_tiles(batch, N, K, sms)
    wide = batch * triton.cdiv(N, 128)  # programs of 128-column tiles
    assert block_n == (64 if N <= 64 or wide < sms else 128)
    programs = batch * triton.cdiv(N, block_n)
    if splits == 1:
        assert chunk == K
        assert programs >= sms or K < 2 * dg.K_CHUNK_MIN or triton.cdiv(sms, programs) <= 1
        return
    assert chunk % dg.BLOCK_K == 0 and chunk >= dg.K_CHUNK_MIN  # whole K tiles, none too short
    assert (splits - 1) * chunk < K <= splits * chunk  # every column in exactly one chunk, no empty chunk
    assert programs < sms and programs * (splits - 1) < sms  # no more chunks than the SMs ask for
