"""The one-launch router (kernels/moe/router.py) against its reference and the model's DeepseekV3TopkRouter.

Selected ids are compared as sets per row; inputs are continuous random values, so exact ties (whose
order torch.topk leaves open) do not occur."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.kernels.layer_reference import route_ref
from ddtree.kernels.moe import router as router_module
from ddtree.kernels.moe.router import route
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.moe import DeepseekV3TopkRouter
from ddtree.tools.selftest.compare import assert_close
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    rows: int
    hidden: int
    experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scaling: float = 2.827
    x_dtype: torch.dtype = torch.float32
    w_dtype: torch.dtype = torch.float32
    bias_shift: float = 0.0

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("decode_kimi_like", 1, 96, 64, 8),
    Case("tree17_groups", 17, 72, 32, 4, n_group=4, topk_group=2),
    Case("ragged_rows_bf16_x", 23, 50, 48, 6, n_group=8, topk_group=3, x_dtype=torch.bfloat16),
    Case("bf16_weight", 9, 64, 16, 2, n_group=2, topk_group=1, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16),
    Case("no_renorm", 5, 40, 24, 3, renormalize=False, scaling=1.0),
    Case("negative_biased_scores", 12, 64, 16, 3, n_group=4, topk_group=2, bias_shift=-1.5),
    Case("odd_experts", 4, 33, 20, 5),
    Case("many_rows_one_program_per_block", 70, 32, 16, 2, n_group=2, topk_group=1),
    Case("split_e_ragged", 20, 48, 100, 6, n_group=4, topk_group=2),  # 4 programs per row block, E % 32 != 0
]


def _inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.rows, case.hidden, generator=g).to(case.x_dtype)
    w = (torch.randn(case.experts, case.hidden, generator=g) * 0.2).to(case.w_dtype)
    bias = torch.randn(case.experts, generator=g) * 0.05 + case.bias_shift
    return [t.to(DEVICE) for t in (x, w, bias)]


def _check(name: str, got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    (w, ids), (ref_w, ref_ids) = got, ref
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    ids, order = ids.cpu().sort(dim=-1)
    ref_ids, ref_order = ref_ids.cpu().sort(dim=-1)
    assert torch.equal(ids, ref_ids), f"{name}: selected experts differ"
    assert_close(f"{name} weights", w.cpu().gather(1, order), ref_w.cpu().gather(1, ref_order))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_route_matches_reference(case):
    x, w, bias = _inputs(case)
    args = (case.top_k, case.n_group, case.topk_group, case.renormalize, case.scaling)
    _check(case.name, route(x, w, bias, *args), route_ref(x, w, bias, *args))


def test_route_matches_the_model_router():
    config = DeepseekV3Config.from_dict({**DEFAULT_TARGET_CONFIG, "n_group": 4, "topk_group": 2})
    gate = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.1)
        gate.e_score_correction_bias.copy_(torch.randn(gate.n_experts, generator=g) * 0.05)
        x = torch.randn(13, config.hidden_size, generator=g).to(torch.bfloat16)
        expected = gate(x)
    got = route(x.to(DEVICE), gate.weight.detach().to(DEVICE), gate.e_score_correction_bias.to(DEVICE), gate.top_k,
                gate.n_group, gate.topk_group, gate.norm_topk_prob, gate.routed_scaling_factor)  # fmt: skip
    _check("model router", got, expected)


def test_tickets_are_left_at_zero_for_the_next_launch():
    case = CASES[0]  # 64 experts: 2 programs per row block
    for seed in range(2):  # twice: the second launch must find the tickets reset
        x, w, bias = _inputs(case, seed)
        args = (case.top_k, case.n_group, case.topk_group, case.renormalize, case.scaling)
        _check(f"launch {seed}", route(x, w, bias, *args), route_ref(x, w, bias, *args))
    assert not any(t.any() for t in router_module._TICKETS[x.device])


def test_a_larger_call_keeps_the_earlier_ticket_buffer_alive(monkeypatch):
    """A CUDA graph keeps the address of the ticket buffer it was captured with: a larger call must add a
    buffer, not free the one in use (the caching allocator would hand its memory to another tensor)."""
    monkeypatch.setattr(router_module, "_TICKETS", {})
    first = router_module._tickets(torch.device(DEVICE), 10)
    address = first.data_ptr()
    assert router_module._tickets(torch.device(DEVICE), 10) is first
    larger = router_module._tickets(torch.device(DEVICE), first.numel() + 1)
    assert larger is not first and larger.numel() > first.numel() and not larger.any()
    assert [id(t) for t in router_module._TICKETS[torch.device(DEVICE)]] == [id(first), id(larger)]
    assert first.data_ptr() == address


def test_ties_go_to_the_lower_expert():
    x = torch.zeros(2, 16, device=DEVICE)  # every score sigmoid(0) = 0.5: all tied
    w = torch.randn(8, 16, device=DEVICE)
    weights, ids = route(x, w, torch.zeros(8, device=DEVICE), top_k=3, n_group=4, topk_group=2, scaling=1.0)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]  # groups 0 and 1 kept, then experts by index
    assert_close("tied weights", weights, torch.full((2, 3), 1 / 3))


def test_route_rejects_bad_inputs():
    x, w, bias = _inputs(CASES[0])
    with pytest.raises(ValueError, match="must be"):
        route(x, w[:, :-1], bias, 2)
    with pytest.raises(ValueError, match="groups must split E evenly"):
        route(x, w, bias, 2, n_group=5)
    with pytest.raises(ValueError, match="top_k"):
        route(x, w, bias, 9, n_group=8, topk_group=1)


@pytest.fixture
def small_splits(monkeypatch):
    """K splits of 32 columns (BLOCK_K 16), so the test shapes' hidden sizes cut into several, the last ragged."""
    monkeypatch.setattr(router_module, "K_SPLIT", 32)
    monkeypatch.setattr(router_module, "ROUTER_BLOCK_K", 16)


def _spread(monkeypatch, sms: int) -> None:
    """The device's SMs as route() sees them: many -> every K split its own program; 1 -> one program per tile."""
    monkeypatch.setattr(router_module, "num_sms", lambda device: sms)


SPLIT_CASES = [
    Case("split_decode_kimi_experts", 1, 100, 384, 8),  # 4 splits (the last 4 wide), E_PAD 512
    Case("split_tree17_groups", 17, 72, 64, 6, n_group=8, topk_group=3, x_dtype=torch.bfloat16),
    Case("split_ragged_bf16_weight", 23, 50, 48, 6, n_group=4, topk_group=2, x_dtype=torch.bfloat16,
         w_dtype=torch.bfloat16),
]  # fmt: skip


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_split_programs_match_reference(case, small_splits, monkeypatch):
    _spread(monkeypatch, 1000)
    x, w, bias = _inputs(case)
    args = (case.top_k, case.n_group, case.topk_group, case.renormalize, case.scaling)
    assert router_module.router_tiles(case.rows, case.experts, case.hidden, 1000)[2] > 1  # the split path runs
    _check(case.name, route(x, w, bias, *args), route_ref(x, w, bias, *args))
    assert not any(t.any() for t in router_module._TICKETS[x.device])  # both ticket regions left at zero


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_split_programs_equal_one_program_per_tile_bitwise(case, small_splits, monkeypatch):
    """The splits summed in order by the tile's last program are the one-program path's sum, bit for bit."""
    x, w, bias = _inputs(case, seed=3)
    args = (case.top_k, case.n_group, case.topk_group, case.renormalize, case.scaling)
    _spread(monkeypatch, 1000)
    split_w, split_ids = route(x, w, bias, *args)
    _spread(monkeypatch, 1)
    assert router_module.router_tiles(case.rows, case.experts, case.hidden, 1)[2] == 1
    one_w, one_ids = route(x, w, bias, *args)
    assert torch.equal(split_ids, one_ids) and torch.equal(split_w, one_w)


@pytest.mark.parametrize("sms", [1000, 4], ids=["device_of_1000_sms", "device_of_4_sms"])
def test_a_rows_result_does_not_depend_on_the_launch(sms, small_splits, monkeypatch):
    """Row invariance: each row routed alone, in a 17-row tree and in 70 rows (past the split threshold of a
    4-SM device) gives the same weights and ids, bit for bit."""
    _spread(monkeypatch, sms)
    case = Case("invariance", 70, 100, 64, 6, n_group=4, topk_group=2, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16)
    x, w, bias = _inputs(case, seed=7)
    args = (case.top_k, case.n_group, case.topk_group, case.renormalize, case.scaling)
    all_w, all_ids = route(x, w, bias, *args)
    tree_w, tree_ids = route(x[20:37], w, bias, *args)
    assert torch.equal(tree_w, all_w[20:37]) and torch.equal(tree_ids, all_ids[20:37])
    for i in (0, 21, 69):
        one_w, one_ids = route(x[i : i + 1], w, bias, *args)
        assert torch.equal(one_w, all_w[i : i + 1]) and torch.equal(one_ids, all_ids[i : i + 1]), i
