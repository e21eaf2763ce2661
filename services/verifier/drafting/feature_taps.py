"""Which target layers one forward taps, and whose columns of the taps are whose.

The drafter taps its layers (`Scheduler.tap_layer_ids`) for every sequence of a step; a Features
request (features_rpc.py) asks for layers of its own, which need not be the drafter's (a new drafter
trains on other taps, and an AR-only verifier has no drafter at all). One forward taps the union:
the drafter's layers first, in its order, then every other layer a Features request of the batch
asks for, in first-asked order. Its taps are [T, len(layers) * hidden]; each item then reads the
drafter's columns (its pending commit, the prefix cache) and, for a Features request, its own
columns in the order it asked for.
"""

from __future__ import annotations

import torch


def step_tap_layers(drafter_taps: tuple[int, ...], requested: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The drafter's layers, then the other requested layers in first-asked order (no repeats)."""
    layers = list(drafter_taps)
    for taps in requested:
        layers += [i for i in taps if i not in layers]
    return tuple(layers)


def tap_columns(layers: tuple[int, ...], wanted: tuple[int, ...], hidden: int) -> torch.Tensor:
    """int64 column indices into taps of `layers` that give the layers `wanted`, in that order."""
    cols = [torch.arange(layers.index(i) * hidden, (layers.index(i) + 1) * hidden) for i in wanted]
    return torch.cat(cols) if cols else torch.empty(0, dtype=torch.int64)


def split_taps(
    taps: torch.Tensor | None, layers: tuple[int, ...], drafter_taps: tuple[int, ...], wanted: tuple[int, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One item's rows of the step's taps [n, len(layers) * H] -> (the drafter's columns or None when it
    taps nothing, the `wanted` layers' columns or None when nothing is wanted)."""
    if taps is None:
        return None, None
    hidden = taps.shape[-1] // len(layers)
    own = taps[:, : len(drafter_taps) * hidden] if drafter_taps else None
    if not wanted:
        return own, None
    if wanted == layers:
        return own, taps
    return own, taps.index_select(1, tap_columns(layers, wanted, hidden).to(taps.device))
