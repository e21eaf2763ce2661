"""Cutting a long pending commit into pieces that each fit one gRPC message.

The first commit of a long prompt at full width is large: the Kimi-K2.5 DFlash drafter taps 6 layers
of 7168, 86 KB per token in bf16, so a 2048-token window is 176 MB, while a message may carry 64 MB.
`split_commit` cuts a commit into consecutive pieces of at most `chunk_bytes` of features (whole
token rows; at least one row each). All but the last travel ahead of the Draft call (one Append
stream, or one frame each over the co-located channel), the first carrying the sequence's reset; the
last goes in the Draft with the root. Pieces are contiguous: piece i + 1 starts where piece i ends, which
the drafter checks.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CommitPiece:
    token_ids: list[int]
    start: int  # absolute position of token_ids[0]
    features: Tensor  # [len(token_ids), F]


def split_commit(token_ids: list[int], start: int, features: Tensor, chunk_bytes: int) -> list[CommitPiece]:
    """Consecutive pieces of the commit, each at most `chunk_bytes` of features (one row at least);
    a single piece when the whole commit fits."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    n = len(token_ids)
    if features.shape[0] != n:
        raise ValueError(f"commit of {n} tokens with {features.shape[0]} feature rows")
    row_bytes = features.element_size() * (features[0].numel() if n else 0)
    rows = max(1, chunk_bytes // row_bytes) if row_bytes else max(n, 1)
    if n <= rows:
        return [CommitPiece(list(token_ids), start, features)]
    return [CommitPiece(list(token_ids[i : i + rows]), start + i, features[i : i + rows]) for i in range(0, n, rows)]
