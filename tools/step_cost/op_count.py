"""Counting what a step asks of its device: launches (aten ops and Triton kernels) and host syncs.

`OpCounter` is a torch dispatch mode: every aten op that reaches the dispatcher while it is active is
classified once:
- view / metadata-only (`NOT_LAUNCHED`: views, size and stride queries, allocation without a fill):
  not counted, since on CUDA they launch nothing;
- a host sync (`HOST_SYNC_OPS`, a boolean-mask index, a copy of a device tensor to the CPU): an op that
  reads a tensor's value to the host, so on CUDA the host waits for the stream;
- anything else: one launch.
Only ops on the step's device count (on CUDA, bookkeeping on CPU tensors launches nothing); on the CPU
every op is on the device, and a sync is any op that reads a tensor's value to the host.

Composite ops (`to`, `flatten`, `linear`, `item`, ... which reach the mode whole under inference mode)
are decomposed with the mode on, so a `.to()` that changes nothing counts nothing and `item` counts as
the `_local_scalar_dense` it runs.
`Tensor.tolist()` and `Tensor.numpy()` read values without reaching the dispatcher on the CPU, so
`value_reads()` wraps them: each call counts as one sync (and one launch: on CUDA it is a copy); on
CUDA it also counts the explicit waits (torch.cuda.synchronize, Event / Stream.synchronize) as syncs.
A device -> CPU copy counts as a sync even when non_blocking (its reader must wait for it anyway).
A Triton kernel counts through `launch(name)` (tools/step_cost/triton_launches.py): one launch, and the ops
the launch path runs meanwhile (the interpreter's copies on the CPU) are not counted: a kernel counts
once, and nothing else stands in for it.

Ops are attributed to the innermost open scope (`scope(key)`, tools/step_cost/layer_scopes.py), and each
sync remembers where it was asked for (the innermost frame in the repository, outside this folder).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops that launch nothing: views, metadata queries, allocation without a fill. By packet name (aten.X).
NOT_LAUNCHED = frozenset(
    {
        # views
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "expand_as", "t", "transpose",
        "permute", "squeeze", "unsqueeze", "slice", "select", "alias", "detach", "detach_", "split", "split_with_sizes",
        "unbind", "chunk", "narrow", "diagonal", "unfold", "movedim", "view_as", "view_as_real",
        "view_as_complex", "_conj", "_neg_view", "resolve_conj", "resolve_neg", "numpy_T", "lift_fresh",
        # size / stride / layout queries
        "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "storage_offset",
        "sym_storage_offset", "dim", "is_contiguous", "is_same_size", "_has_compatible_shallow_copy_type",
        # allocation without a fill
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_empty_affine_quantized",
    }
)  # fmt: skip
# Ops that read a tensor's value to the host (the host waits for the device on CUDA).
HOST_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "argwhere",
        "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
        "bincount", "tolist",
    }
)  # fmt: skip
# Indexing with a boolean mask (x[mask], x[mask] = v) has a data-dependent shape: a nonzero inside.
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
COPY_OPS = frozenset({"_to_copy", "copy_", "to"})
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]  # tools/step_cost/ -> the repository
THIS_FOLDER = pathlib.Path(__file__).resolve().parent


def op_name(func) -> str:
    """aten.view.default -> "view" (the overload packet's name, no namespace)."""
    return func.overloadpacket.__name__


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of nested args / outputs, in order."""
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def is_host_sync(func, args, kwargs, out, device_type: str) -> bool:
    """Does this op read a value of a `device_type` tensor to the host?"""
    name = op_name(func)
    inputs = _tensors((args, kwargs))
    on_device = [t for t in inputs if t.device.type == device_type]
    if name in HOST_SYNC_OPS:
        return bool(on_device)
    if name == "repeat_interleave":  # the output size comes from the repeats' values unless given
        return bool(on_device) and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name in MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [t for t in _tensors(indices) if t.dtype in (torch.bool, torch.uint8)]
        return any(t.device.type == device_type for t in masks)
    if name in COPY_OPS and device_type != "cpu":  # device -> CPU copies wait for the device
        outs = _tensors(out)
        src = inputs[1] if name == "copy_" and len(inputs) > 1 else (inputs[0] if inputs else None)
        dst = inputs[0] if name == "copy_" else (outs[0] if outs else None)
        return src is not None and dst is not None and src.device.type == device_type and dst.device.type == "cpu"
    return False


def is_host_to_device(func, args, out, device_type: str) -> bool:
    """A copy from the CPU onto a non-CPU device (counted as a launch; reported apart)."""
    if device_type == "cpu" or op_name(func) not in COPY_OPS:
        return False
    inputs, outs = _tensors(args), _tensors(out)
    if op_name(func) == "copy_":
        return len(inputs) > 1 and inputs[1].device.type == "cpu" and inputs[0].device.type == device_type
    return bool(inputs and outs) and inputs[0].device.type == "cpu" and outs[0].device.type == device_type


def sync_site() -> str:
    """path:line of the innermost frame in the repository outside this folder (or '?')."""
    frame = sys._getframe(1)
    while frame is not None:
        # resolved: a module imported through the checkout's `ddtree -> services` link has its file there
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(PACKAGE_ROOT) and not path.is_relative_to(THIS_FOLDER) and ".venv" not in path.parts:
            return f"{path.relative_to(PACKAGE_ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclasses.dataclass
class Tally:
    launches: int = 0  # aten ops that launch + Triton kernels (+ value reads)
    host_syncs: int = 0
    triton_launches: int = 0
    host_to_device: int = 0

    def add(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class OpCounter(TorchDispatchMode):
    """Counts while active (`with counter:`); `scope(key)` attributes what runs inside it to `key`
    (the innermost scope wins; ops outside every scope go to ()). `tallies[key]`, `names[op] -> count`,
    `sync_sites[(site, op)] -> count`."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.tallies: dict[tuple, Tally] = collections.defaultdict(Tally)
        self.names: collections.Counter[str] = collections.Counter()
        self.sync_sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self._scopes: list[tuple] = [()]
        self._inside_launch = 0  # > 0: a Triton launch or a value read is running: its inner ops are its own

    # ---- scopes ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, key: tuple):
        self.enter_scope(key)
        try:
            yield
        finally:
            self.exit_scope()

    def enter_scope(self, key: tuple) -> None:
        self._scopes.append(key)

    def exit_scope(self) -> None:
        self._scopes.pop()

    def total(self, prefix: tuple = ()) -> Tally:
        """Everything counted in scopes starting with `prefix` (() = everything)."""
        out = Tally()
        for key, t in self.tallies.items():
            if key[: len(prefix)] == prefix:
                out.add(t)
        return out

    # ---- counting ----------------------------------------------------------------------------------
    def _count(self, name: str, sync: bool, triton: bool = False, h2d: bool = False, launch: bool = True) -> None:
        t = self.tallies[self._scopes[-1]]
        t.launches += launch
        t.host_syncs += sync
        t.triton_launches += triton
        t.host_to_device += h2d
        self.names[name] += 1
        if sync:
            self.sync_sites[sync_site(), name] += 1

    @contextlib.contextmanager
    def launch(self, name: str, sync: bool = False, triton: bool = True):
        """One launch (a Triton kernel, or a value read when sync), whatever runs inside it."""
        if self._inside_launch:
            yield
            return
        self._count(name, sync=sync, triton=triton)
        self._inside_launch += 1
        try:
            yield
        finally:
            self._inside_launch -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside_launch:
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under inference mode composite ops (to, flatten, linear, item, ...) reach the mode whole:
            # their decomposition is run with the mode on, so that what they launch is what counts.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        name = op_name(func)
        if name in NOT_LAUNCHED:
            return out
        tensors = _tensors((args, kwargs, out))
        if self.device_type != "cpu" and not any(t.device.type == self.device_type for t in tensors):
            return out  # host bookkeeping: launches nothing on the device
        sync = is_host_sync(func, args, kwargs, out, self.device_type)
        self._count(name, sync=sync, h2d=is_host_to_device(func, args, out, self.device_type))
        return out

    @contextlib.contextmanager
    def value_reads(self):
        """While active: Tensor.tolist() / Tensor.numpy() of a device tensor count as a sync (and a launch:
        on CUDA a copy), and on CUDA an explicit wait (torch.cuda.synchronize, Event / Stream.synchronize)
        as a sync without a launch."""
        counter = self
        patches = [(torch.Tensor, name) for name in ("tolist", "numpy")]
        if self.device_type == "cuda":
            patches += [
                (torch.cuda, "synchronize"),
                (torch.cuda.Event, "synchronize"),
                (torch.cuda.Stream, "synchronize"),
            ]
        originals = [(owner, name, getattr(owner, name)) for owner, name in patches]

        def read(name, original):
            def counted(tensor, *args, **kwargs):
                if tensor.device.type != counter.device_type:
                    return original(tensor, *args, **kwargs)
                with counter.launch(name, sync=True, triton=False):
                    return original(tensor, *args, **kwargs)

            return counted

        def wait(name, original):
            def counted(*args, **kwargs):
                if not counter._inside_launch:
                    counter._count(name, sync=True, launch=False)
                return original(*args, **kwargs)

            return counted

        for owner, name, original in originals:
            wrapped = read(name, original) if owner is torch.Tensor else wait(f"{owner.__name__}.{name}", original)
            setattr(owner, name, wrapped)
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
