"""The device path's forward reads nothing back to the host (issue 40): with the Triton attention backend
(the MLA plan and the latent write's slots prepared before the forward), the Triton layer kernels and the
fused MoE over packed INT4 experts, all interpreted on the CPU, a verifier step's forward has 0 host
syncs (tools/step_cost/op_count.py; each Triton launch counts once); a tree verify and an AR decode step.
On CUDA the same kernels run compiled."""

from __future__ import annotations

from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401  (before kernels are imported)

# isort: split
import pytest

from ddtree.models.checkpoint.loader import load_target
from ddtree.tools.step_cost.kernel_route import route_kernels
from tests.support.forward_syncs import sync_report, verifier_step_counts, write_kimi_int4


@pytest.fixture(scope="module")
def kimi_int4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_int4_small")
    return write_kimi_int4(
        out, layers=2, experts=16, hidden=128, vocab=512, heads=2, lora=64, width=64, dense_width=128
    )


@pytest.mark.parametrize("rows, context", [(9, 40), (1, 40)], ids=["verify9", "decode"])
def test_no_host_sync_inside_the_triton_forward(kimi_int4_dir, rows, context):
    model = load_target(kimi_int4_dir, device=DEVICE, attention_backend="triton").eval()
    assert model.attn_backend.name == "triton" and model.layer_kernels.route is not None
    assert model.model.layers[1].mlp.experts.gate_proj.kind == "int4"
    with route_kernels(model, "triton"):  # the fused MoE on the CPU too
        counter = verifier_step_counts(model, rows, context)
    kernels = counter.total().triton_launches
    assert kernels > 0 and counter.names["_moe_gemm_kernel"] > 0 and counter.names["_latent_write_kernel"] > 0
    assert counter.total().host_syncs == 0, sync_report(counter)
