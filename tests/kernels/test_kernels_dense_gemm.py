"""Dense quantized GEMMs (kernels/gemm/fp8.py, kernels/gemm/int4.py) against their torch references
(kernels/gemm/dense_reference.py) at ragged shapes, interpreted on a CPU (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import DEVICE, INTERPRET, triton_interpret_env  # noqa: F401  (sets up triton first)

# isort: split
# tests/support/triton_env.py imported the kernel modules with the interpreter set; these are those modules.
from ddtree.kernels.gemm import dense_reference as ref
from ddtree.kernels.gemm import fp8 as fp8_gemm
from ddtree.kernels.gemm import int4 as int4_gemm
from ddtree.kernels.quant_formats import FP8_MAX, quantize_fp8_block, quantize_int4_group
from ddtree.tools.selftest.compare import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 40, 96), (7, 130, 203), (33, 256, 384)]  # (M, N, K): none a multiple of the tiles / of 128


def _x(M: int, K: int, dtype: torch.dtype, seed: int = 0, strided: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 8 * strided, generator=gen) * 3
    x[:, :: max(1, K // 7)] *= 40  # outliers: groups with very different scales
    if M > 1:
        x[1, : min(K, 130)] = 0.0  # an all-zero group (amax floor)
    return x.to(dtype).to(DEVICE)[:, :K]  # strided: a row stride > K


def _fp8_weight(N: int, K: int, block=(128, 128), seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-3, -1, N)[:, None]  # per-block scales differ
    q, s = quantize_fp8_block(w, block)
    return q.to(DEVICE), s.to(DEVICE)


def _int4_weight(N: int, K: int, group: int, scale_dtype=torch.bfloat16, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-2, 0, N)[:, None]
    packed, scale, _ = quantize_int4_group(w, group)
    return packed.to(DEVICE), scale.to(scale_dtype).to(DEVICE)


# --- activation quantization (inside the FP8 GEMM) ---------------------------------------------------------


def _quantized_by_the_gemm(x: torch.Tensor, group: int) -> torch.Tensor:
    """What the FP8 GEMM's activation quantization gives, read through an identity weight with unit scales:
    y[:, j] = q[:, j] · s[:, j // group] (the other K groups add exact zeros), in x's dtype."""
    K = x.shape[1]
    eye = torch.eye(K).to(torch.float8_e4m3fn).to(DEVICE)
    ones = torch.ones(-(-K // 128), -(-K // group), device=DEVICE)
    return fp8_gemm.fp8_block_gemm(x, eye, ones, (128, group))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,group", [(1, 96, 128), (7, 203, 128), (33, 384, 128), (5, 200, 64)])
def test_group_quant_matches_its_torch_twin(M, K, group, dtype):
    x = _x(M, K, dtype, strided=M == 7)
    y = _quantized_by_the_gemm(x, group)
    q_ref, s_ref = ref.per_token_group_quant_fp8_reference(x, group)
    assert ref.FP8_EPS == fp8_gemm.FP8_EPS
    assert y.dtype == dtype and y.shape == (M, K)
    want = ref.dequantize_activations_fp8(q_ref, s_ref, group)  # fp32 q · s, rounded to x's dtype as y is
    assert torch.equal(y, want.to(dtype)), (y.float() - want).abs().max()
    # and the quantization itself is right: x ≈ q · s within half an e4m3 step (2^-4 relative)
    assert_close("dequantized", want, x.float(), abs_tol=s_ref.max().item() * 2**-9 * 1.01, rel_tol=2**-4,
                 cos_tol=2e-3)  # fmt: skip


def test_group_quant_rounds_every_e4m3_tie_to_even():
    """Scale 1 (each group holds a 448), so the identity GEMM gives q = e4m3(x) itself: every value halfway
    between two e4m3 numbers, its neighbours one fp32 ulp away, all e4m3 values and zeros (the interpreter's
    own cast gets carries wrong; the kernel rounds itself there). A -0 comes out +0 (0 + -0 in the sum)."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()].unique()  # sorted, -448 .. 448 (-0.0 folds into 0.0)
    mids = (finite[1:] + finite[:-1]) / 2  # exact in fp32
    vals = torch.cat([finite, mids, mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9)),
                      torch.tensor([-0.0, 2**-12, -(2**-12), 2**-10, -(2**-10), 3 * 2**-11])])  # fmt: skip
    group = 128
    rows = -(-vals.numel() // (group - 1))
    x = torch.full((rows, group - 1), 0.0)
    x.view(-1)[: vals.numel()] = vals
    x = torch.cat([torch.full((rows, 1), FP8_MAX), x], dim=1).to(DEVICE)  # [rows, 128]
    y = _quantized_by_the_gemm(x, group)
    q_ref, s_ref = ref.per_token_group_quant_fp8_reference(x, group)
    assert torch.equal(s_ref, torch.ones_like(s_ref))
    bad = (y != q_ref.float()).nonzero()
    assert bad.numel() == 0, [(x[i, j].item(), y[i, j].item(), q_ref[i, j].float().item()) for i, j in bad[:5]]


# --- FP8 block GEMM ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", SHAPES, ids=lambda v: str(v))
def test_fp8_block_gemm_matches_reference_at_ragged_shapes(M, N, K, dtype):
    x = _x(M, K, dtype, strided=M == 7)
    w, ws = _fp8_weight(N, K)
    y = fp8_gemm.fp8_block_gemm(x, w, ws)
    assert y.dtype == dtype and y.shape == (M, N) and y.device == x.device
    assert_close(f"fp8 gemm {M}x{N}x{K} {dtype}", y, ref.fp8_block_gemm_reference(x, w, ws))


@pytest.mark.parametrize("block", [(32, 64), (200, 32)], ids=str)
def test_fp8_block_gemm_other_block_sizes(block):
    """Weight scale blocks smaller / larger than the N tile, and a 32-wide K step (the least an fp8 dot takes)."""
    M, N, K = 9, 150, 100
    x = _x(M, K, torch.float32)
    w, ws = _fp8_weight(N, K, block)
    y = fp8_gemm.fp8_block_gemm(x, w, ws, block)
    assert_close(f"fp8 gemm block {block}", y, ref.fp8_block_gemm_reference(x, w, ws, block))


def test_fp8_gemm_in_fp32_and_quantization_error():
    """fp32 x (fp32 out: no output rounding hides a difference) against the reference; and against the
    unquantized-activation linear, the error of per-token-group quantization stays small (e4m3: 3 mantissa
    bits)."""
    M, N, K = 17, 130, 384
    x = _x(M, K, torch.bfloat16).float()
    w, ws = _fp8_weight(N, K)
    y = fp8_gemm.fp8_block_gemm(x, w, ws)
    assert y.dtype == torch.float32
    assert_close("fp8 gemm fp32", y, ref.fp8_block_gemm_reference(x, w, ws))
    linear = ref.fp8_block_linear_reference(x, w, ws)
    assert_close("vs unquantized activations", y, linear, abs_tol=0.05 * linear.abs().max().item(), rel_tol=0.1,
                 cos_tol=1e-3)  # fmt: skip


def test_fp8_empty_batch():
    w, ws = _fp8_weight(40, 96)
    y = fp8_gemm.fp8_block_gemm(torch.zeros(0, 96, device=DEVICE), w, ws)
    assert y.shape == (0, 40)


# --- INT4 W4A16 GEMM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("M,N,K", SHAPES, ids=lambda v: str(v))
def test_int4_gemm_matches_reference_at_ragged_shapes(M, N, K, group, dtype):
    x = _x(M, K, dtype, strided=M == 7)
    packed, scale = _int4_weight(N, K, group)
    y = int4_gemm.int4_gemm(x, packed, scale, group, K)
    assert y.dtype == dtype and y.shape == (M, N)
    assert_close(f"int4 gemm {M}x{N}x{K} g{group} {dtype}", y, ref.int4_gemm_reference(x, packed, scale, group, K))


@pytest.mark.parametrize("group,scale_dtype", [(24, torch.float32), (8, torch.float16), (512, torch.bfloat16)],
                         ids=["g24_fp32_scale", "g8_fp16_scale", "per_channel"])  # fmt: skip
def test_int4_gemm_other_groups(group, scale_dtype):
    """Groups that are no multiple of 16 (dequantize per element) and one group over all of K."""
    M, N, K = 7, 130, 203
    x = _x(M, K, torch.bfloat16)
    packed, scale = _int4_weight(N, K, group, scale_dtype)
    y = int4_gemm.int4_gemm(x, packed, scale, group)
    assert_close(f"int4 gemm g{group}", y, ref.int4_gemm_reference(x, packed, scale, group))


# --- the kernels really run --------------------------------------------------------------------------------


def test_no_silent_fallback_to_a_reference(monkeypatch):
    """With every reference and torch's matmuls raising, the wrappers still give the reference's answer, and
    each GEMM is exactly one launch of its kernel (FP8's activation quantization inside it)."""
    M, N, K = 7, 130, 203
    x = _x(M, K, torch.bfloat16)
    w, ws = _fp8_weight(N, K)
    packed, scale = _int4_weight(N, K, 32)
    expected_fp8 = ref.fp8_block_gemm_reference(x, w, ws)
    expected_int4 = ref.int4_gemm_reference(x, packed, scale, 32)

    def boom(*args, **kwargs):
        raise AssertionError("a reference / torch matmul ran inside a kernel wrapper")

    for name in dir(ref):
        if name.endswith("_reference") or name.startswith("dequantize"):
            monkeypatch.setattr(ref, name, boom)
    for module in (fp8_gemm, int4_gemm):
        for name in ("dequantize_fp8_block", "dequantize_int4", "unpack_int4"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, boom)
    for name in ("matmul", "mm", "bmm", "addmm", "einsum"):
        monkeypatch.setattr(torch, name, boom)
    monkeypatch.setattr(torch.nn.functional, "linear", boom)
    monkeypatch.setattr(torch.Tensor, "__matmul__", boom)
    kernels = {"fp8": fp8_gemm._fp8_gemm_kernel, "int4": int4_gemm._int4_gemm_kernel}
    launched = []  # every `kernel[grid](...)` of any Triton kernel (the class is shared; JITFunction on a GPU)
    for cls in {type(k) for k in kernels.values()}:
        real = cls.__getitem__
        monkeypatch.setattr(cls, "__getitem__", lambda self, grid, real=real: launched.append(self) or real(self, grid))

    y_fp8 = fp8_gemm.fp8_block_gemm(x, w, ws)
    y_int4 = int4_gemm.int4_gemm(x, packed, scale, 32)
    monkeypatch.undo()

    assert [next(n for n, k in kernels.items() if k is kernel) for kernel in launched] == ["fp8", "int4"]
    assert_close("fp8 (kernel path)", y_fp8, expected_fp8)
    assert_close("int4 (kernel path)", y_int4, expected_int4)


def test_the_kernels_run_interpreted_here():
    """On a machine without CUDA the kernels must be the interpreter's (not a CPU torch path)."""
    from ddtree.kernels.checks import is_interpreted

    for kernel in (fp8_gemm._fp8_gemm_kernel, int4_gemm._int4_gemm_kernel):
        assert is_interpreted(kernel) == INTERPRET


# --- validation --------------------------------------------------------------------------------------------


def test_fp8_wrappers_reject_bad_inputs():
    M, N, K = 3, 130, 200
    x = _x(M, K, torch.bfloat16)
    w, ws = _fp8_weight(N, K)
    ok = dict(x=x, weight=w, weight_scale_inv=ws)
    bad = [
        (dict(x=x[:, :-1]), "do not fit"),
        (dict(x=x.to(torch.int32)), "x dtype torch.int32 not supported"),
        (dict(x=x[0]), "x must be 2-D"),
        (dict(x=x.t().contiguous().t()), "contiguous in its last dim"),
        (dict(weight=w.float()), "weight dtype torch.float32 not supported"),
        (dict(weight_scale_inv=ws[:1]), "weight_scale_inv must be \\[ceil\\(N/128\\), ceil\\(K/128\\)\\] = \\[2, 2\\]"),
        (dict(weight_scale_inv=ws.double()), "weight_scale_inv dtype torch.float64"),
        (dict(block_size=(128, 96)), "block_k a power of two"),
        (dict(block_size=128), "block_size must be"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            fp8_gemm.fp8_block_gemm(**{**ok, **change})


def test_int4_wrapper_rejects_bad_inputs():
    M, N, K, g = 3, 40, 203, 32
    x = _x(M, K, torch.bfloat16)
    packed, scale = _int4_weight(N, K, g)
    ok = dict(x=x, weight_packed=packed, weight_scale=scale, group_size=g, in_features=K)
    bad = [
        (dict(in_features=200), "in_features = 200 but x has K = 203"),
        (dict(weight_packed=packed[:, :-1]), "weight_packed must be \\[N, ceil\\(K/8\\)\\] = \\[40, 26\\]"),
        (dict(weight_packed=packed.to(torch.int64)), "weight_packed dtype torch.int64"),
        (dict(weight_scale=scale[:, :-1]), "weight_scale must be \\[N, ceil\\(K/group_size\\)\\] = \\[40, 7\\]"),
        (dict(group_size=64), "= \\[40, 4\\]"),
        (dict(group_size=0), "group_size must be a positive int"),
        (dict(weight_scale=scale.to(torch.int8)), "weight_scale dtype torch.int8"),
        (dict(x=x.t().contiguous().t()), "contiguous in its last dim"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            int4_gemm.int4_gemm(**{**ok, **change})
