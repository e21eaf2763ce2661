"""The layer kernels (rmsnorm.py, activation.py, moe/router.py) build for sm_90 at Kimi K2.6 / DeepSeek-V3 shapes
with no GPU: what the interpreted tests cannot check (the atomic ticket, the int1 masks, register use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO


def build_for_sm90() -> list[dict]:
    """Compile every variant (run in a process without TRITON_INTERPRET); registers / stack / shared each."""
    import pathlib
    import re
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from ddtree.kernels.activation import _silu_mul_kernel
    from ddtree.kernels.moe.router import BLOCK_E, BLOCK_M, K_SPLIT, ROUTER_BLOCK_K, _router_kernel, router_tiles
    from ddtree.kernels.rmsnorm import _rms_norm_kernel

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    i32, bf = "i32", "*bf16"
    norm_sig = dict(X=bf, RES=bf, W=bf, OUT=bf, RES_OUT=bf, n_cols=i32, stride_x=i32, stride_r=i32, stride_o=i32,
                    stride_ro=i32, eps="fp32")  # fmt: skip
    bf16 = dict(X_DTYPE=tl.bfloat16, X_BF16=True, OUT_DTYPE=tl.bfloat16, OUT_BF16=True)
    # the router reads the checkpoint's bf16 weight; PARTS holds the K splits' fp32 logits
    router_sig = dict(X=bf, W=bf, BIAS="*fp32", PARTS="*fp32", SCORES="*fp32", TICKETS="*i32", OUT_W="*fp32",
                      OUT_IDS="*i64", M=i32, E=i32, K=i32, stride_xm=i32, stride_we=i32, scaling="fp32",
                      n_tiles=i32)  # fmt: skip
    variants = [
        ("add_rms_norm 7168", _rms_norm_kernel, norm_sig, dict(HAS_RESIDUAL=True, BLOCK=8192, **bf16), 16, 1),
        ("rms_norm 1536", _rms_norm_kernel, norm_sig, dict(HAS_RESIDUAL=False, BLOCK=2048, **bf16), 4, 1),
        ("silu_mul 256", _silu_mul_kernel, dict(GATE=bf, UP=bf, OUT=bf, n_cols=i32, stride_g=i32, stride_u=i32,
                                                stride_o=i32), dict(DTYPE=tl.bfloat16, IS_BF16=True, BLOCK=256), 4, 1),
    ]  # fmt: skip
    for name, experts, e_pad, groups, kept in (("kimi E384 decode", 384, 512, 1, 1),
                                               ("deepseek E256 g8/4 decode", 256, 256, 8, 4)):  # fmt: skip
        _, e_blocks, splits = router_tiles(1, experts, 7168, 132)  # one row on an H200's 132 SMs
        consts = dict(TOP_K=8, K_PAD=8, N_GROUP=groups, G_PAD=groups, TOPK_GROUP=kept, RENORMALIZE=True,
                      E_BLOCKS=e_blocks, SPLITS=splits, N_SPLITS=-(-7168 // K_SPLIT), BLOCK_M=BLOCK_M,
                      BLOCK_E=BLOCK_E, BLOCK_K=ROUTER_BLOCK_K, K_SPLIT=K_SPLIT, E_PAD=e_pad)  # fmt: skip
        variants.append((f"router {name}", _router_kernel, router_sig, consts, 8, 2))
    rows = []
    for name, fn, sig, consts, warps, stages in variants:
        src = ASTSource(fn, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
        k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
        rows.append(dict(kernel=name, registers=regs, stack_bytes=stack, shared_bytes=k.metadata.shared))
    return rows


def test_layer_kernels_build_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from tests.kernels.test_kernels_layer_compile import build_for_sm90; print(json.dumps(build_for_sm90()))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = {r["kernel"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])}
    assert len(rows) == 5 and all(r["registers"] > 0 for r in rows.values())
    assert rows["router kimi E384 decode"]["stack_bytes"] == 0  # Kimi's decode tile: no register spills
