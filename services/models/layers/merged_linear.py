"""Linears that read the same input, merged along their output rows into one GEMM, named as stored.

A parent module (the MLP's gate + up, MLA's q_a + kv_a) holds one child linear for several checkpoint
linears ("parts"): its rows are the parts' rows in order. `register_merged(parent, merged, order)` makes
`parent.state_dict()` show the parts under their own names, as views of the merged tensors (so the loader,
which fills tensors through the state dict's views, fills the merged ones in place), in the order an
unmerged module would list them (`order`: child names), and makes `load_state_dict` take the parts.

The child is an nn.Linear, or (pack_modules, for a quantized checkpoint) an Fp8Linear / Int4Linear; a
leaf is split by rows (`weight`, `bias`, int4 `weight_packed` / `weight_scale`), by row blocks (fp8
`weight_scale_inv`: every part but the last must fill whole blocks, `can_merge_fp8`), or is rebuilt
(int4 `weight_shape` = [rows, K] per part). Where a checkpoint's blocks do not allow it, pack_modules calls
`split_merged` and the parts become children of their own (two GEMMs): the parent's forward checks
`is_merged`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

Parts = tuple[tuple[str, int], ...]  # (checkpoint child name, output rows) in row order


def register_merged(parent: nn.Module, merged: dict[str, Parts], order: tuple[str, ...]) -> None:
    parent.merged_linears = dict(merged)
    parent.state_dict_order = order
    parent.register_state_dict_post_hook(_split_state_dict)
    parent.register_load_state_dict_pre_hook(_merge_loaded_state_dict)


def is_merged(parent: nn.Module, name: str) -> bool:
    return parent._modules.get(name) is not None


def merged_parts(parent: nn.Module, name: str) -> Parts | None:
    """The parts of child `name` when it is a merged linear of `parent`, else None."""
    parts = getattr(parent, "merged_linears", {}).get(name)
    return parts if parts is not None and is_merged(parent, name) else None


def can_merge_fp8(parts: Parts, block_rows: int) -> bool:
    """An FP8 block-quantized merge keeps every part's scale blocks whole: all parts but the last end on a
    block boundary (the last may end in a ragged block, as its own weight does)."""
    return all(rows % block_rows == 0 for _, rows in parts[:-1])


def split_merged(parent: nn.Module, name: str, make_part) -> None:
    """Replace merged child `name` by one child per part, `make_part(part_name, rows)` each (on meta)."""
    parts = parent.merged_linears[name]
    delattr(parent, name)
    for part, rows in parts:
        setattr(parent, part, make_part(part, rows))


def _row_bounds(child: nn.Module, leaf: str, parts: Parts, total: int) -> list[tuple[int, int]]:
    """[start, stop) of each part in dim 0 of `leaf` (total = its length)."""
    block = child.block[0] if leaf == "weight_scale_inv" else 1
    bounds, start = [], 0
    for _, rows in parts:
        bounds.append((start // block, min(-(-(start + rows) // block), total)))
        start += rows
    return bounds


def _split_state_dict(parent: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """`{prefix}{merged}.{leaf}` -> `{prefix}{part}.{leaf}` per part (views), then the parent's entries in
    `state_dict_order`. The parent's entries are the last ones of `state_dict` when its post-hook runs."""
    mine = [k for k in state_dict if k.startswith(prefix)]
    entries = {k: state_dict.pop(k) for k in mine}
    out: dict[str, torch.Tensor] = {}
    for key, value in entries.items():
        child_name, _, leaf = key[len(prefix) :].partition(".")
        parts = merged_parts(parent, child_name)
        if parts is None or "." in leaf:
            out[key] = value
            continue
        child = parent._modules[child_name]
        if leaf == "weight_shape":  # int4: each part's own [rows, K]
            for part, rows in parts:
                shape = [rows, child.in_features]
                out[f"{prefix}{part}.{leaf}"] = torch.tensor(shape, dtype=value.dtype, device=value.device)
            continue
        for (part, _), (a, b) in zip(parts, _row_bounds(child, leaf, parts, value.shape[0]), strict=True):
            out[f"{prefix}{part}.{leaf}"] = value[a:b]
    rank = {name: i for i, name in enumerate(parent.state_dict_order)}
    for key in sorted(out, key=lambda k: rank.get(k[len(prefix) :].partition(".")[0], len(rank))):
        state_dict[key] = out[key]


def _merge_loaded_state_dict(parent: nn.Module, state_dict, prefix: str, *args) -> None:
    """The inverse: the parts' entries of a leaf (when all of them are there) become the merged one's."""
    for name, parts in parent.merged_linears.items():
        child = parent._modules.get(name)
        if child is None:
            continue
        leaves = [n for n, t in child._parameters.items() if t is not None]
        leaves += [n for n, t in child._buffers.items() if t is not None and n not in child._non_persistent_buffers_set]
        for leaf in leaves:
            keys = [f"{prefix}{part}.{leaf}" for part, _ in parts]
            if not all(k in state_dict for k in keys):
                continue
            pieces = [state_dict.pop(k) for k in keys]
            if leaf == "weight_shape":
                merged = torch.tensor([sum(int(p[0]) for p in pieces), int(pieces[0][1])], dtype=pieces[0].dtype)
            else:
                merged = torch.cat(pieces, dim=0)
            state_dict[f"{prefix}{name}.{leaf}"] = merged


def unmerge_all(model: nn.Module) -> nn.Module:
    """Split every plain merged linear of `model` into its parts, uninitialised on the merged one's device
    (a model to be loaded whose parts are shaped independently, e.g. by arbitrary per-tensor slices)."""
    for parent in list(model.modules()):
        for name in list(getattr(parent, "merged_linears", {})):
            child = parent._modules.get(name)
            if type(child) is nn.Linear:
                split_merged(parent, name, functools.partial(_plain_part, child))
    return model


def _plain_part(merged: nn.Linear, part: str, rows: int) -> nn.Linear:
    return nn.Linear(merged.in_features, rows, merged.bias is not None, device=merged.weight.device)
