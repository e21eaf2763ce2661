"""Attention metadata and the torch reference backend for absorbed MLA over a latent cache (docs/design.md §5).

The cache of one layer is `kv_layer [S, r + dr]`: per slot, the first r values are the normalised latent
c_kv and the last dr the rotated shared key k_pe. Absorbed MLA is then MQA with one KV head of width r+dr
whose value is the first r dims of the key:

    score_h(t, s) = (q_lat[t, h] · c_kv[s] + q_pe[t, h] · k_pe[s]) · scale
    o_lat[t, h]   = Σ_s softmax_s(score_h(t, ·)) · c_kv[s]

One batch of new tokens is a concatenation of sequences. Each sequence sees all its committed prefix slots
plus its own new tokens through `new_mask`:
- decode:           q_len 1, new_mask None;
- prefill / extend: q_len N, new_mask None (causal), prefix possibly non-empty;
- tree verify:      new tokens [root, tree nodes], new_mask = ancestor mask (a node sees itself and its
                    ancestors), positions = start + depth (supplied by the caller to the model).

The torch backend reads a sequence's long runs of consecutive prefix slots (`RUN_MIN`, fp32 cache) in
place as views of the cache and gathers only the rest, so a step at long context does not
copy the whole prefix of every layer (`SeqAttention.prefix_runs`).

The forward reads no value back to the host: what a backend needs from the slot tables (the torch
backend's gather slots, runs and masks; the Triton backend's kernel plan, kernels/mla/plan.py) is built
from the host tensors by `prepare` (`AttentionMetadata.prepare` / `prepare_attention`) before the
forward, copied to the device once, and kept in `meta.prepared`; the forward only reads those device
buffers. A metadata nobody prepared is prepared at its first use inside the forward (the same result,
with the host work and the copy there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ddtree.models.layers.norm import RMSNorm
from ddtree.models.layers.padded_attention import PaddedKeys, PaddedKeysLayout, attend_padded
from ddtree.models.layers.rope import RotaryEmbedding

RUN_MIN = 128  # consecutive prefix slots read in place instead of gathered (TorchMLAAttention, fp32 cache)


@dataclass(frozen=True, eq=False)
class SeqAttention:
    q_start: int  # first row of this sequence in the flattened batch of new tokens
    q_len: int  # number of new tokens (queries) of this sequence
    prefix_slots: torch.Tensor  # int64 [P] cache slots of the committed context, in position order (P may be 0)
    new_slots: torch.Tensor  # int64 [q_len] cache slots the new tokens' latents are written to
    new_mask: torch.Tensor | None = None  # bool [q_len, q_len], True = row may see col; None = causal

    def __post_init__(self) -> None:
        if self.q_start < 0 or self.q_len < 0:
            raise ValueError(f"q_start {self.q_start} / q_len {self.q_len} must be >= 0")
        if self.prefix_slots.dim() != 1 or self.prefix_slots.dtype != torch.int64:
            raise ValueError(f"prefix_slots must be int64 [P], got {self.prefix_slots.dtype} "
                             f"{tuple(self.prefix_slots.shape)}")  # fmt: skip
        if self.new_slots.shape != (self.q_len,) or self.new_slots.dtype != torch.int64:
            raise ValueError(f"new_slots must be int64 [{self.q_len}], got {self.new_slots.dtype} "
                             f"{tuple(self.new_slots.shape)}")  # fmt: skip
        if self.new_mask is not None and (
            self.new_mask.shape != (self.q_len, self.q_len) or self.new_mask.dtype != torch.bool
        ):
            raise ValueError(f"new_mask must be bool [{self.q_len}, {self.q_len}], got "
                             f"{self.new_mask.dtype} {tuple(self.new_mask.shape)}")  # fmt: skip

    @functools.cached_property
    def key_slots(self) -> torch.Tensor:
        """int64 [P + q_len]: every slot this sequence's queries attend to, prefix first (computed once per
        forward, read by every layer)."""
        return torch.cat([self.prefix_slots, self.new_slots])

    @functools.cached_property
    def prefix_runs(self) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
        """The prefix split for attention: ((first slot, length) of every run of at least RUN_MIN
        consecutive slots, read in place as views of the cache), and int64 [G + q_len] the slots of the
        rest of the prefix then of the new tokens (gathered). Computed once per forward (page size 1 and
        lowest-free-first allocation keep a prompt's slots consecutive, so at long context nearly all of
        the prefix is a few runs: no per-layer gather of it)."""
        P = self.prefix_slots.numel()
        if P < RUN_MIN or self.prefix_slots.device.type != "cpu":
            return (), self.key_slots
        slots = self.prefix_slots
        breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
        runs, rest, start = [], [], 0
        for end in [*breaks, P]:
            if end - start >= RUN_MIN:
                runs.append((int(slots[start]), end - start))
            else:
                rest.append(slots[start:end])
            start = end
        if not runs:
            return (), self.key_slots
        return tuple(runs), torch.cat([*rest, self.new_slots])

    @functools.cached_property
    def hidden_new(self) -> torch.Tensor | None:
        """bool [q_len, q_len]: True where a new query must not see a new key; None when it sees them all."""
        if self.q_len <= 1:
            return None
        return ~self.visible_new()

    def visible_new(self) -> torch.Tensor:
        """bool [q_len, q_len]: which new keys each new query sees (causal when new_mask is None)."""
        if self.new_mask is not None:
            return self.new_mask
        return torch.ones(self.q_len, self.q_len, dtype=torch.bool, device=self.new_slots.device).tril()


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    seqs: tuple[SeqAttention, ...]
    # What backends built for the forward (`prepare`): device buffers keyed by the backend's name, and
    # "write_slots". Filled before the forward, read inside it.
    prepared: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        row = 0
        for i, s in enumerate(self.seqs):
            if s.q_start != row:
                raise ValueError(f"seqs[{i}].q_start is {s.q_start}, expected {row}: sequences must tile "
                                 "the batch rows in order")  # fmt: skip
            row += s.q_len

    @property
    def num_tokens(self) -> int:
        """T: total number of new tokens (rows) across sequences."""
        return sum(s.q_len for s in self.seqs)

    @functools.cached_property
    def host_write_slots(self) -> torch.Tensor:
        """int64 [T]: cache slot of each new token, in row order, as the sequences hold them (the host)."""
        if not self.seqs:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([s.new_slots for s in self.seqs])

    @property
    def write_slots(self) -> torch.Tensor:
        """int [T]: cache slot of each new token, in row order: the prepared device copy (int64, or the
        Triton plan's int32), else host_write_slots."""
        slots = self.prepared.get("write_slots")
        return self.host_write_slots if slots is None else slots

    def prepare(self, backend: MLAAttentionBackend, num_heads: int, kv_cache: torch.Tensor) -> AttentionMetadata:
        """Build `backend`'s device buffers for a forward over `kv_cache` ([L, S, W] or one layer [S, W]) with
        `num_heads` local heads, from the host slot tables, before the forward. Returns self."""
        backend.prepare(self, num_heads, kv_cache)
        return self


def prepare_attention(model, meta: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionMetadata:
    """meta.prepare for `model`'s attention backend and its local head count (a DeepseekV3ForCausalLM, whole
    or one rank's shard)."""
    layers = model.model.layers
    if len(layers):
        meta.prepare(model.attn_backend, layers[0].self_attn.num_heads, kv_cache)
    return meta


@dataclass(frozen=True, eq=False)
class TorchAttentionInputs:
    """The torch backend's per-forward buffers (TorchMLAAttention.prepare), on the cache's device."""

    key: tuple  # (device, in_place): what they were built for
    write_slots: torch.Tensor  # int64 [T]
    gathered: torch.Tensor  # int64: per sequence with queries, its gathered keys (rest or all), in order
    runs: tuple[tuple[tuple[int, int], ...], ...]  # per sequence with queries: its prefix runs read in place
    hidden_new: tuple[torch.Tensor | None, ...]  # per sequence with queries: SeqAttention.hidden_new


class MLAAttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, num_heads: int, kv_cache: torch.Tensor) -> object: ...

    def static_layout(self, bucket, num_heads: int, cache_slots: int, device: torch.device) -> object:
        """Its part of a static batch (models/runtime/static_batch.py): `int_words`, `bind`, `pack`, `upload`."""
        ...

    def write_latent(
        self,
        kv_layer: torch.Tensor,
        latent: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        norm: RMSNorm,
        rope: RotaryEmbedding,
    ) -> None: ...

    def attend(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchMLAAttention:
    """Reference backend: a loop over sequences, fp32 scores and softmax."""

    name = "torch"

    def static_layout(self, bucket, num_heads: int, cache_slots: int, device: torch.device) -> PaddedKeysLayout:
        return PaddedKeysLayout(bucket, device)

    def prepare(self, meta: AttentionMetadata, num_heads: int, kv_cache: torch.Tensor) -> TorchAttentionInputs:
        """The gather slots, prefix runs and masks of `meta` on kv_cache's device: host work and one copy
        per kind, done once per metadata (see the module docstring)."""
        device = kv_cache.device
        key = (device, kv_cache.dtype == torch.float32)
        got = meta.prepared.get(self.name)
        if got is not None and got.key == key:
            return got
        seqs = [s for s in meta.seqs if s.q_len > 0]
        runs = [s.prefix_runs if key[1] else ((), s.key_slots) for s in seqs]
        T = meta.num_tokens
        ints = torch.cat([meta.host_write_slots, *(rest for _, rest in runs)]).to(device, torch.int64)
        hidden = [s.hidden_new for s in seqs]
        masks = [m for m in hidden if m is not None]
        flat = torch.cat([m.flatten() for m in masks]).to(device) if masks else None
        views, at = [], 0
        for m in hidden:
            views.append(None if m is None else flat[at : at + m.numel()].view(m.shape))
            at += 0 if m is None else m.numel()
        state = TorchAttentionInputs(key, ints[:T], ints[T:], tuple(r for r, _ in runs), tuple(views))
        meta.prepared[self.name] = state
        meta.prepared["write_slots"] = state.write_slots
        return state

    def write_latent(
        self,
        kv_layer: torch.Tensor,  # [S, r + dr] one layer's cache, written in place
        latent: torch.Tensor,  # [T, r + dr] kv_a_proj_with_mqa output: [c_kv ; k_pe], not normalised / rotated
        slots: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        norm: RMSNorm,  # kv_a_layernorm
        rope: RotaryEmbedding,
    ) -> None:
        """kv_layer[slots] = [norm(c_kv) ; rope(k_pe)] in the cache dtype."""
        r = norm.weight.shape[0]
        rows = torch.cat([norm(latent[:, :r]), rope(latent[:, r:], positions)], dim=-1)
        kv_layer[slots.to(kv_layer.device)] = rows.to(kv_layer.dtype)

    def attend(
        self,
        q_lat: torch.Tensor,  # [T, H, r]   q_nope absorbed through W_UK
        q_pe: torch.Tensor,  # [T, H, dr]  rotated
        kv_layer: torch.Tensor,  # [S, r + dr] one layer's cache (new tokens already written)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # o_lat [T, H, r], dtype of q_lat
        T, H, r = q_lat.shape
        dr = q_pe.shape[-1]
        assert q_pe.shape == (T, H, dr), f"q_pe {tuple(q_pe.shape)} vs q_lat {tuple(q_lat.shape)}"
        assert kv_layer.dim() == 2 and kv_layer.shape[1] == r + dr, (
            f"kv_layer {tuple(kv_layer.shape)} must be [S, {r + dr}]"
        )
        assert meta.num_tokens == T, f"metadata covers {meta.num_tokens} rows, q has {T}"
        padded = meta.prepared.get(self.name)
        if isinstance(padded, PaddedKeys):  # a static batch (models/runtime/static_batch.py)
            return attend_padded(q_lat, q_pe, kv_layer, padded, scale)
        out = torch.empty(T, H, r, dtype=q_lat.dtype, device=q_lat.device)  # contiguous, whatever q_lat's strides
        # The scale goes into q once (per element, so every row gets the same numbers alone or in a batch).
        q = torch.cat([q_lat, q_pe], dim=-1).float() * scale  # [T, H, r+dr]
        seqs = [s for s in meta.seqs if s.q_len > 0]
        state = self.prepare(meta, H, kv_layer)
        # Long runs of consecutive prefix slots are read in place (fp32 cache); the rest of every
        # sequence's keys in one gather: [sum(G+q), r+dr], each sequence a contiguous block of rows.
        keys_all = kv_layer[state.gathered].float()
        k0 = 0
        for s, runs, hidden in zip(seqs, state.runs, state.hidden_new, strict=True):
            rows = slice(s.q_start, s.q_start + s.q_len)
            if runs:
                G = s.prefix_slots.numel() - sum(length for _, length in runs) + s.q_len
                _attend_runs(q[rows], kv_layer, runs, keys_all[k0 : k0 + G], hidden, out[rows], r)
                k0 += G
                continue
            P, n = s.prefix_slots.numel(), s.q_len
            keys = keys_all[k0 : k0 + P + n]  # [P+q, r+dr]
            k0 += P + n
            # [q·H, r+dr] @ [r+dr, P+q]: every head of every query row in one matmul
            scores = (q[rows].reshape(n * H, r + dr) @ keys.T).view(n, H, P + n)  # [q, H, P+q]
            # The prefix is fully visible; among the new tokens, the causal or tree mask.
            if hidden is not None:  # [q, q]
                scores[:, :, P:].masked_fill_(hidden[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [q, H, P+q] fp32
            o = out[rows].view(n * H, r)  # this sequence's rows of out: a contiguous block
            if o.dtype == torch.float32:
                torch.mm(probs.view(n * H, P + n), keys[:, :r], out=o)
            else:
                o.copy_(probs.view(n * H, P + n) @ keys[:, :r])
        return out


def _attend_runs(
    q: torch.Tensor,  # fp32 [n, H, r+dr] scaled queries of one sequence
    kv_layer: torch.Tensor,  # fp32 [S, r+dr]
    runs: tuple[tuple[int, int], ...],  # (first slot, length) of the prefix runs read in place
    rest: torch.Tensor,  # fp32 [G+n, r+dr] the gathered rest of the prefix, then the new tokens' keys
    hidden: torch.Tensor | None,  # bool [n, n] SeqAttention.hidden_new, on the device
    out: torch.Tensor,  # [n, H, r] this sequence's rows of the output, written
    r: int,
) -> None:
    """One sequence's attention with its long prefix runs as views of the cache: the scores of each part
    are written into one [n·H, P+n] buffer (runs, then the rest), one softmax, then the values of each
    part accumulated into out."""
    n, H = q.shape[0], q.shape[1]
    qf = q.reshape(n * H, -1)
    total = sum(length for _, length in runs) + rest.shape[0]
    scores = qf.new_empty(n * H, total)
    col = 0
    for first, length in runs:
        torch.mm(qf, kv_layer[first : first + length].T, out=scores[:, col : col + length])
        col += length
    torch.mm(qf, rest.T, out=scores[:, col:])
    if hidden is not None:  # the causal or tree mask among the new tokens: the last n columns
        scores.view(n, H, total)[:, :, total - n :].masked_fill_(hidden[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [n·H, P+n]
    o = probs[:, col:] @ rest[:, :r]  # [n·H, r]
    col = 0
    for first, length in runs:
        o.addmm_(probs[:, col : col + length], kv_layer[first : first + length, :r])
        col += length
    out.view(n * H, r).copy_(o)


def _triton_backend(row_invariant: bool = True) -> MLAAttentionBackend:
    # triton is an optional extra (the runtime install has none): imported only when this backend is chosen
    from ddtree.kernels.mla.backend import TritonMLAAttention
    from ddtree.kernels.mla.plan import MLAKernelConfig

    return TritonMLAAttention(MLAKernelConfig(row_invariant=row_invariant))


def _torch_backend(row_invariant: bool = True) -> MLAAttentionBackend:
    return TorchMLAAttention()  # not row invariant either way (the CPU's BLAS: README, "Lossless")


ATTENTION_BACKENDS = {"torch": _torch_backend, "triton": _triton_backend}


def resolve_attention_backend(name: str, device: str | torch.device) -> str:
    """The one place "auto" is decided: triton on CUDA when triton is installed, torch elsewhere."""
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "torch"
    try:  # triton is an optional extra: is it installed?
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def make_attention_backend(name: str, row_invariant: bool = True) -> MLAAttentionBackend:
    """The backend `name`; row_invariant=False gives the Triton kernels' throughput plan (splits from the whole
    step's work over the SMs: kernels/mla/plan.py), the verifier's --row-invariant off."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choices: {sorted(ATTENTION_BACKENDS)}"
            + (" (resolve 'auto' with resolve_attention_backend first)" if name == "auto" else "")
        )
    return ATTENTION_BACKENDS[name](row_invariant)
