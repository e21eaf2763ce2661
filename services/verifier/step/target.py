"""The target model as the verifier's step calls it: one interface at TP 1 and at TP N.

`run(inputs, heads)` is one forward over the batch, then, per item, what commit needs from its rows:
`(logits, argmax)`, either of them None. `heads[i]` says how many rows item i asked for (its tree's
n + 1 rows, a prompt's last row, or none), whether its accept walk is greedy (then only the rows the
walk reads matter) and whether it samples (then it needs full logits).

- `LocalTarget` (one device): the forward returns final-normed rows; the LM head then runs only where
  it is read: along the accept walk for greedy trees (greedy_head.py), over every row for sampled
  trees and a prompt's last row.
- `ShardedTarget` (tensor parallel): the LM head is split by vocabulary across ranks, so the forward
  returns the combined argmax of every requested row, and gathers the full logits only when some row
  of the batch is sampled.

The server builds the one that fits its model; the scheduler and batch.py never ask which it is.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import AttentionMetadata, prepare_attention
from ddtree.models.parallel.tp_model import TensorParallelModel
from ddtree.verifier.sampling.greedy_head import greedy_walk_choices


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, num_slots, kv_cache_width], written in place
    logits_rows: torch.Tensor  # int64 [R]: the rows the items ask for, in item order
    tap_layer_ids: tuple[int, ...]
    # (input_ids, positions, logits_rows) on the host, when the caller has them (the tensor-parallel step
    # message is packed from these: nothing read back from the device)
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def args(self) -> tuple:
        """The positional and keyword arguments of either model's forward."""
        return (self.input_ids, self.positions, self.meta, self.kv_cache), {
            "logits_rows": self.logits_rows,
            "tap_layer_ids": self.tap_layer_ids,
        }

    def static_args(self) -> tuple:
        """The arguments of StaticStep.run (the kv cache is the step's own): ids and positions from the
        host when the caller has them (the static batch packs them there)."""
        ids, pos = self.host[:2] if self.host is not None else (self.input_ids, self.positions)
        return ids, pos, self.meta, self.tap_layer_ids


@dataclasses.dataclass(frozen=True)
class ItemHead:
    rows: int  # how many of logits_rows are this item's (consecutive, in item order)
    walk: TokenTree | None  # a greedy tree: only the rows its accept walk reads are needed
    sampled: bool  # the item's sequence samples at temperature > 0


ItemRows = tuple[torch.Tensor | None, torch.Tensor | None]  # (fp32 logits [n, V], int64 argmax [n])


class Target(Protocol):
    config: object

    # Optional: `prepare(inputs)` builds what the forward reads from inputs.meta (its device buffers) before
    # `run`; batch.py calls it when the target has it.

    def run(self, inputs: ForwardInputs, heads: list[ItemHead]) -> tuple[torch.Tensor | None, list[ItemRows]]:
        """(taps [T, F] or None, per item (logits, argmax))."""
        ...


def _blocks(rows: torch.Tensor | None, heads: list[ItemHead]) -> list[torch.Tensor | None]:
    out, start = [], 0
    for h in heads:
        out.append(rows[start : start + h.rows] if h.rows and rows is not None else None)
        start += h.rows
    return out


class LocalTarget:
    def __init__(self, model: DeepseekV3ForCausalLM, static=None):
        """static: a static_step.StaticStep (--cuda-graphs), where the steps that fit a bucket run; None: eager."""
        self.model = model
        self.config = model.config
        self.static = static

    def prepare(self, inputs: ForwardInputs) -> None:
        """The attention's device buffers for the eager forward (the static step has its own)."""
        if self.static is None:
            prepare_attention(self.model, inputs.meta, inputs.kv_cache)

    def run(self, inputs: ForwardInputs, heads: list[ItemHead]) -> tuple[torch.Tensor | None, list[ItemRows]]:
        static = self.static.run(*inputs.static_args()) if self.static is not None else None
        if static is not None:  # every row, final-normed; the items' rows picked here
            rows, taps = static[0].index_select(0, inputs.logits_rows), static[1]
        else:
            args, kwargs = inputs.args()
            out = self.model.forward(*args, **kwargs, hidden_only=True)
            rows, taps = out.hidden, out.taps
        hidden = _blocks(rows, heads)  # final-normed rows per item
        results: list[ItemRows] = [
            (None, None) if h.walk is not None or rows is None else (self.model.compute_logits(rows), None)
            for h, rows in zip(heads, hidden)
        ]
        walking = [i for i, h in enumerate(heads) if h.walk is not None]
        if walking:  # every greedy tree of the batch together, one LM head matmul per round
            choices = greedy_walk_choices(
                [heads[i].walk for i in walking], [hidden[i] for i in walking], self.model.compute_logits
            )
            for i, c in zip(walking, choices):
                results[i] = (None, c)
        return taps, results


class ShardedTarget:
    def __init__(self, model: TensorParallelModel):
        self.model = model
        self.config = model.config

    def prepare(self, inputs: ForwardInputs) -> None:
        """Rank 0's attention buffers and its packed step message, from the host inputs (the other ranks
        prepare theirs from the message, run_shard)."""
        if inputs.host is None:
            prepare_attention(self.model.model, inputs.meta, inputs.kv_cache)
            return
        ids, pos, rows = inputs.host
        self.model.prepare(ids, pos, inputs.meta, inputs.kv_cache, rows, inputs.tap_layer_ids)

    def run(self, inputs: ForwardInputs, heads: list[ItemHead]) -> tuple[torch.Tensor | None, list[ItemRows]]:
        args, kwargs = inputs.args()
        out = self.model.forward(*args, **kwargs, gather_logits=any(h.sampled for h in heads), host_inputs=inputs.host)
        return out.taps, list(zip(_blocks(out.logits, heads), _blocks(out.argmax, heads)))
