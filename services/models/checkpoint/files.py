"""The safetensors files of one checkpoint directory, opened lazily and read in slices.

`CheckpointFiles(root)` resolves every tensor through `model.safetensors.index.json` (`weight_map`) or the
single `model.safetensors`, opens a file only when one of its tensors is first needed, and reads with
`get_slice(...)[rows, cols]` so only the requested bytes are touched (the files are memory-mapped).
Every safetensors error (truncated file, corrupt header, ...) is re-raised as `CheckpointError` naming the
file and the tensor being read.

NOTE: safetensors returns views of the mapped file, and every page they touch stays resident (as file
pages) until the file is closed; callers copy what they keep and `close()` now and then (`mapped_bytes`).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, float]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
}  # fmt: skip


class CheckpointError(ValueError):
    """The checkpoint does not match the model, or a file is unreadable; names the file and the tensor."""


def checkpoint_weight_map(path: str | Path, *, every_file: bool = False) -> dict[str, Path]:
    """tensor name -> safetensors file holding it.

    every_file=False (the HF layout): through `model.safetensors.index.json`, else the single
    `model.safetensors`. every_file=True (the DFlash drafter's layout): every `*.safetensors` file in the
    directory, whatever its name and whether or not an index lists it; a tensor in two files is an error.
    """
    root = Path(path)
    if every_file:
        return _every_file_weight_map(root)
    index = root / INDEX_FILE
    if index.exists():
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from err
        return {name: root / shard for name, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if single.exists():
        return {name: single for name in read_header(single)}
    raise CheckpointError(f"{root}: no weights here (no {SINGLE_FILE} or {INDEX_FILE})")


def _every_file_weight_map(root: Path) -> dict[str, Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors file")
    weight_map: dict[str, Path] = {}
    for file in files:
        for name in read_header(file):
            if name in weight_map:
                raise CheckpointError(
                    f"{root}: key {name!r} appears in more than one safetensors file "
                    f"({weight_map[name].name}, {file.name})"
                )
            weight_map[name] = file
    return weight_map


def read_header(file: str | Path) -> dict[str, dict[str, Any]]:
    """The JSON header of one safetensors file: name -> {dtype, shape, data_offsets} (no tensor data read)."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > file.stat().st_size - 8:
                raise ValueError(f"header length {n} does not fit a file of {file.stat().st_size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{file}: unreadable safetensors header ({err})") from err
    header.pop("__metadata__", None)
    return header


class CheckpointFiles:
    """Lazily opened safetensors handles for one checkpoint; use as a context manager."""

    def __init__(self, root: str | Path, weight_map: dict[str, Path] | None = None):
        self.root = Path(root)
        self.weight_map = checkpoint_weight_map(root) if weight_map is None else weight_map
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self.mapped_bytes = 0  # bytes read through the open mappings since the last close()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmap every open file (a later read reopens it)."""
        self._stack.close()
        self._stack = ExitStack()
        self._handles.clear()
        self.mapped_bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name}: missing from checkpoint {self.root}")
        return self.weight_map[name]

    def _slice(self, name: str):
        file = self.file_of(name)
        try:
            if file not in self._handles:
                self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            return self._handles[file].get_slice(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {err}") from err

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string from the header, e.g. 'BF16', 'F8_E4M3', 'I32'."""
        return self._slice(name).get_dtype()

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """The tensor, or only rows [a:b] / cols [a:b] of a 2-D tensor (rows also of a 1-D one)."""
        sl = self._slice(name)
        try:
            if rows is None and cols is None:
                out = sl[:]
            elif cols is None:
                out = sl[rows]
            else:
                out = sl[rows if rows is not None else slice(None), cols]
            full = sl.get_shape()  # a column slice touches whole rows of the file
            row = out.element_size() * (math.prod(full[1:]) if len(full) > 1 else 1)
            self.mapped_bytes += (out.shape[0] if out.dim() else 1) * row
            return out
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"{self.file_of(name)}: cannot read tensor {name}: {err}") from err
