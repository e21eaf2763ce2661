"""The op counter of `ddtree bench step` (tools/step_cost/op_count.py, triton_launches.py) on hand-made
functions: views and other metadata-only ops launch nothing, value reads are host syncs, a Triton
launch counts once (and nothing inside it), a torch reference counts its own ops, and on a CUDA step
CPU bookkeeping counts nothing."""

from __future__ import annotations

import pytest
import torch

from ddtree.tools.step_cost.op_count import (  # noqa: E402
    HOST_SYNC_OPS,
    NOT_LAUNCHED,
    OpCounter,
    is_host_sync,
    is_host_to_device,
)
from ddtree.tools.step_cost.triton_launches import count_triton_launches  # noqa: E402
from tests.support.triton_env import INTERPRET, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def count(fn, device_type: str = "cpu") -> OpCounter:
    counter = OpCounter(device_type)
    with counter.value_reads(), count_triton_launches(counter), counter:
        fn()
    return counter


def test_the_metadata_list_is_explicit():
    views = {"view", "_unsafe_view", "as_strided", "expand", "t", "transpose", "permute", "squeeze", "unsqueeze",
             "slice", "select", "alias", "detach", "detach_", "size", "stride", "sym_size", "sym_stride", "split", "unbind",
             "empty", "empty_like", "empty_strided", "lift_fresh"}  # fmt: skip
    assert views <= NOT_LAUNCHED
    assert {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "unique", "masked_select"} <= HOST_SYNC_OPS
    assert not NOT_LAUNCHED & HOST_SYNC_OPS


def test_views_are_not_launches():
    x = torch.arange(12.0)

    def views():
        y = x.view(3, 4).t().transpose(0, 1).permute(1, 0)[1:, :2].unsqueeze(0).squeeze(0)
        y.expand(2, *y.shape).select(0, 1).detach().split(1)
        x.as_strided((2, 2), (1, 1))
        torch.empty_like(x)

    c = count(views)
    assert c.total().launches == 0 and not c.names


def test_compute_ops_count_once_each():
    x = torch.arange(12.0).view(3, 4)
    c = count(lambda: (x.t().contiguous() * 2 + 1).sum(dim=0))
    assert dict(c.names) == {"clone": 1, "mul": 1, "add": 1, "sum": 1}
    assert c.total().launches == 4 and c.total().host_syncs == 0


@pytest.mark.parametrize(
    "read, op",
    [
        (lambda x: x[0].item(), "_local_scalar_dense"),
        (lambda x: int(x.sum()), "_local_scalar_dense"),
        (lambda x: bool((x > 3).any()), "_local_scalar_dense"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: x.numpy(), "numpy"),
        (lambda x: torch.nonzero(x), "nonzero"),
        (lambda x: x[x > 2], "index"),
        (lambda x: torch.repeat_interleave(x.long()), "repeat_interleave"),
        (lambda x: x.unique(), "_unique2"),
        (lambda x: torch.equal(x, x), "equal"),
    ],
)
def test_value_reads_are_host_syncs(read, op):
    x = torch.arange(6.0)
    c = count(lambda: read(x))
    assert c.total().host_syncs == 1, dict(c.names)
    assert [o for (_, o) in c.sync_sites] == [op]
    site = next(iter(c.sync_sites))[0]
    assert site.startswith("tests/tools/test_op_count.py:"), site


def test_composite_ops_count_what_they_launch_under_inference_mode():
    x = torch.arange(6.0)
    with torch.inference_mode():
        c = count(lambda: (x.to(torch.float32), x.flatten(), x.reshape(2, 3), x.to(torch.float64), x[0].item()))
    assert dict(c.names) == {"_to_copy": 1, "_local_scalar_dense": 1}
    assert c.total().host_syncs == 1


def test_shapes_given_ahead_are_not_syncs():
    x = torch.tensor([1, 2, 3])
    c = count(lambda: torch.repeat_interleave(x, x, output_size=6))
    assert c.total().host_syncs == 0 and dict(c.names) == {"repeat_interleave": 1, "index_select": 1}


def test_a_cuda_step_counts_nothing_on_cpu_tensors():
    """On CUDA, bookkeeping on CPU tensors (page tables, plans built on the host) launches nothing."""
    x = torch.arange(6.0)
    c = count(lambda: (x * 2).tolist() and x[0].item(), device_type="cuda")
    assert c.total().launches == 0 and c.total().host_syncs == 0


def test_copies_between_host_and_device():
    """A device -> CPU copy is a sync, a CPU -> device copy is not (it is reported apart); the meta device
    stands in for CUDA (the rules look at devices only)."""
    aten = torch.ops.aten
    host, dev = torch.zeros(3), torch.zeros(3, device="meta")
    assert is_host_sync(aten.copy_.default, (host, dev), {}, host, "meta")
    assert not is_host_sync(aten.copy_.default, (dev, host), {}, dev, "meta")
    assert is_host_to_device(aten.copy_.default, (dev, host), dev, "meta")
    assert is_host_sync(aten._to_copy.default, (dev,), {"device": "cpu"}, host, "meta")
    assert not is_host_sync(aten._to_copy.default, (host,), {"device": "meta"}, dev, "meta")
    assert is_host_to_device(aten._to_copy.default, (host,), dev, "meta")
    assert not is_host_sync(aten.copy_.default, (host, host), {}, host, "cpu")  # on a CPU step: a plain copy


def test_scopes_attribute_innermost():
    x = torch.arange(4.0)
    counter = OpCounter("cpu")
    with counter:
        x + 1
        with counter.scope(("forward",)):
            x * 2
            with counter.scope(("forward", "layer", 0)):
                x - 1
                x.sum().item()
    assert counter.total().launches == 5
    assert counter.total(("forward",)).launches == 4
    assert counter.total(("forward", "layer", 0)).launches == 3
    assert counter.total(("forward", "layer", 0)).host_syncs == 1


@pytest.mark.skipif(not INTERPRET, reason="the CPU path of the count (interpreted kernels)")
def test_a_triton_launch_counts_once_and_its_reference_its_own_ops():
    @triton.jit  # decorated here, under the fixture's TRITON_INTERPRET=1
    def _add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    def add_one(x):
        out = torch.empty_like(x)
        _add_one_kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), BLOCK=16)
        return out

    def reference(x):
        return x + 1.0

    x = torch.arange(40.0)
    kernel = count(lambda: add_one(x))
    assert dict(kernel.names) == {"_add_one_kernel": 1}
    t = kernel.total()
    assert (t.launches, t.triton_launches, t.host_syncs) == (1, 1, 0)
    ref = count(lambda: reference(x))
    assert dict(ref.names) == {"add": 1} and ref.total().triton_launches == 0
    assert torch.equal(add_one(x), reference(x))
