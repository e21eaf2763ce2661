"""Training data for the DFlash drafter: the frozen target's taps and its own greedy choices.

What the drafter must learn (services/drafter/engine.py): given the target's tapped features of the
committed tokens [0, a) and the anchor at position a (the target's previous bonus token), predict the
tokens the target will produce next, greedily, at positions a+1 .. a+B-1: those are what the verifier
accepts. Labels are therefore always the TARGET's choices, never corpus tokens:

    greedy[t] = argmax of the target's logits at position t (its choice for position t+1, given the
                sequence's own prefix 0..t);  slot k of the block at anchor a is labelled greedy[a+k-1].

The sequences those labels are read along come from one of two sources:

- `generate` (default): a corpus prompt of P tokens followed by G tokens the target generates
  greedily from it (ignore EOS), exactly as `ddtree generate` at temperature 0 would. Along the
  generated part every token IS the target's greedy choice (x[t+1] == greedy[t]), so the labels of a
  block are the target's greedy rollout from the anchor: precisely what verification will accept.
  Anchors are drawn from the generated part only (a >= P), where serving places them, and the
  contexts the drafter trains on look like the ones it serves (prompt + the target's own text).
- `corpus`: teacher forcing on raw corpus windows (cheaper per token: one prefill, no decode loop).
  Depth 1 is exact (greedy[a] is the target's choice after the true prefix), deeper slots are the
  target's choices after corpus prefixes, which approximate its rollout only where the corpus and the
  target agree.

The taps and the greedy choices come from one pass of the target per batch (prefill, then one decode
forward per generated token: the decode forward's taps and argmax are the labels' source), under
no_grad, through the same `DeepseekV3ForCausalLM.forward` the verifier runs. For distillation
(`--loss kl`) the same forwards also keep the target's distribution at every labelled position: its
top-K logits and their ids (K = the whole vocabulary when asked for 0), the teacher of drafter_loss.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from ddtree.models.layers.attention import AttentionMetadata, SeqAttention

KINDS = ("code", "prose", "chat")
DOC_SEPARATOR = "[EOS]"  # tools/build_corpus.py joins documents with this special-token text


@dataclass(frozen=True)
class TargetBatch:
    """S sequences of equal length T with everything the drafter trains on."""

    ids: Tensor  # int64 [S, T]
    taps: Tensor  # [S, T, len(target_layer_ids) * H] target features of every position
    greedy: Tensor  # int64 [S, T] target argmax at every position (-1 where not computed)
    anchor_lo: int  # anchors may sit at positions [anchor_lo, T - B + 1]
    teacher: Tensor | None = None  # fp32 [S, T, K] the target's top-K logits at each position (its law for t+1)
    teacher_ids: Tensor | None = None  # int64 [S, T, K] their token ids (rows never computed: -inf / 0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)

    def state(self) -> dict:
        extra = {} if self.teacher is None else {"teacher": self.teacher, "teacher_ids": self.teacher_ids}
        return {"ids": self.ids, "taps": self.taps, "greedy": self.greedy, "anchor_lo": self.anchor_lo, **extra}

    @staticmethod
    def from_state(d: dict) -> TargetBatch:
        return TargetBatch(
            d["ids"], d["taps"], d["greedy"], int(d["anchor_lo"]), d.get("teacher"), d.get("teacher_ids")
        )


# ---------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class TokenStream:
    kind: str
    ids: Tensor  # int64 [N]: the documents of one split, tokenized, joined by the EOS id
    prompt_ends: Tensor | None  # int64 [k] positions a chat prompt may end at (after an assistant header)


def _encode_file(path: Path, tokenizer_json: Path, eos_id: int) -> Tensor:
    tok = Tokenizer.from_file(str(tokenizer_json))
    docs = [d for d in path.read_text(encoding="utf-8").split(DOC_SEPARATOR) if d]
    out: list[int] = []
    for i in range(0, len(docs), 256):
        for enc in tok.encode_batch(docs[i : i + 256], add_special_tokens=False):
            out.extend(enc.ids)
            out.append(eos_id)
    return torch.tensor(out, dtype=torch.int64)


def _chat_prompt_ends(ids: Tensor, assistant_id: int | None, middle_id: int | None) -> Tensor | None:
    """Positions right after `<|im_assistant|>assistant<|im_middle|>`: where the model starts answering."""
    if assistant_id is None or middle_id is None:
        return None
    mids = (ids == middle_id).nonzero().flatten()
    keep = torch.zeros_like(mids, dtype=torch.bool)
    for back in range(1, 5):  # the role name takes a token or a few
        prev = (mids - back).clamp(min=0)
        keep |= ids[prev] == assistant_id
    ends = mids[keep] + 1
    return ends if ends.numel() else None


def load_corpus(
    corpus_dir: str | Path,
    tokenizer_dir: str | Path,
    kinds: tuple[str, ...],
    split: str,
    eos_id: int,
    cache_dir: str | Path | None = None,
) -> dict[str, TokenStream]:
    """Tokenize `{split}_{kind}.txt` for each kind (cached as .pt in cache_dir, keyed by size/mtime)."""
    corpus_dir, tokenizer_json = Path(corpus_dir), Path(tokenizer_dir) / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_json))
    streams = {}
    for kind in kinds:
        path = corpus_dir / f"{split}_{kind}.txt"
        if not path.is_file():
            raise ValueError(f"corpus: {path} not found (expected {split}_{{{','.join(KINDS)}}}.txt)")
        st = path.stat()
        key = {"size": st.st_size, "mtime": st.st_mtime_ns, "tokenizer": tokenizer_json.stat().st_size, "eos": eos_id}
        cached = Path(cache_dir) / f"tokens_{split}_{kind}.pt" if cache_dir else None
        ids = None
        if cached is not None and cached.is_file():
            blob = torch.load(cached, weights_only=True)
            if blob["key"] == key:
                ids = blob["ids"]
        if ids is None:
            ids = _encode_file(path, tokenizer_json, eos_id)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"key": key, "ids": ids}, str(cached) + ".tmp")
                os.replace(str(cached) + ".tmp", cached)
        ends = (
            _chat_prompt_ends(ids, tok.token_to_id("<|im_assistant|>"), tok.token_to_id("<|im_middle|>"))
            if kind == "chat"
            else None
        )
        streams[kind] = TokenStream(kind, ids, ends)
    return streams


def sample_windows(
    streams: dict[str, TokenStream], count: int, length: int, generator: torch.Generator, prompts: bool
) -> Tensor:
    """int64 [count, length] windows, each from a kind drawn uniformly. With prompts=True a chat window
    ends right after an assistant header (the target then writes an answer)."""
    kinds = sorted(streams)
    out = torch.empty(count, length, dtype=torch.int64)
    for i in range(count):
        s = streams[kinds[int(torch.randint(len(kinds), (1,), generator=generator))]]
        n = s.ids.numel()
        if n < length:
            raise ValueError(f"corpus kind {s.kind!r} has {n} tokens, fewer than a window of {length}")
        ends = s.prompt_ends[s.prompt_ends >= length] if prompts and s.prompt_ends is not None else None
        if ends is not None and ends.numel():
            end = int(ends[int(torch.randint(ends.numel(), (1,), generator=generator))])
        else:
            end = int(torch.randint(length, n + 1, (1,), generator=generator))
        out[i] = s.ids[end - length : end]
    return out


# ---------------------------------------------------------------------------------------------- target


class TargetRunner:
    """Runs the frozen target over whole sequences (taps + argmax) or greedy continuations of prompts."""

    def __init__(
        self,
        target,
        tap_layer_ids: tuple[int, ...],
        taps_dtype: torch.dtype,
        max_tokens_per_forward: int = 4096,
        teacher_topk: int | None = None,
    ):
        """teacher_topk: None = greedy choices only; K > 0 = also the top-K logits per position; 0 = all."""
        self.target = target
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.taps_dtype = taps_dtype
        self.max_tokens = max_tokens_per_forward
        self.teacher_topk = teacher_topk
        self._prefill_teacher: list[Tensor] | None = None  # the last prefill's teacher rows [S*T, K] x 2

    def _teacher(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """logits [n, V] -> (fp32 [n, K], int64 [n, K]) on the CPU: the top-K (K = V for 0), sorted."""
        k = self.teacher_topk or logits.shape[-1]
        vals, ids = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1)
        return vals.cpu(), ids.cpu()

    def _teacher_rows(self, s: int, t: int, vocab: int) -> tuple[Tensor, Tensor] | tuple[None, None]:
        if self.teacher_topk is None:
            return None, None
        k = min(self.teacher_topk or vocab, vocab)
        return torch.full((s, t, k), float("-inf")), torch.zeros(s, t, k, dtype=torch.int64)

    def _forward(self, ids: Tensor, positions: Tensor, seqs: list[SeqAttention], cache: Tensor, rows: Tensor | None):
        dev = self.target.device
        meta = AttentionMetadata(seqs=tuple(seqs))
        return self.target.forward(
            ids.to(dev),
            positions.to(dev),
            meta,
            cache,
            logits_rows=None if rows is None else rows.to(dev),
            tap_layer_ids=self.tap_layer_ids,
        )

    @torch.no_grad()
    def prefill(self, ids: Tensor, all_logits: bool = True) -> tuple[Tensor, Tensor]:
        """ids int64 [S, T] -> taps [S, T, F] (taps_dtype, CPU), greedy int64 [S, T] (all_logits) or [S]."""
        s, t = ids.shape
        per = max(1, self.max_tokens // t)  # sequences per forward
        taps, greedy, teacher = [], [], []
        empty = torch.empty(0, dtype=torch.int64)
        for i in range(0, s, per):
            chunk = ids[i : i + per]
            n = chunk.shape[0]
            cache = self.target.new_kv_cache(n * t)
            seqs = [SeqAttention(j * t, t, empty, torch.arange(j * t, (j + 1) * t)) for j in range(n)]
            rows = None if all_logits else torch.arange(1, n + 1) * t - 1
            out = self._forward(chunk.reshape(-1), torch.arange(t).repeat(n), seqs, cache, rows)
            taps.append(out.taps.view(n, t, -1).to("cpu", self.taps_dtype))
            g = out.logits.argmax(-1).cpu()
            greedy.append(g.view(n, t) if all_logits else g)
            if self.teacher_topk is not None:
                teacher.append(self._teacher(out.logits))
        self._prefill_teacher = [torch.cat([part[j] for part in teacher]) for j in range(2)] if teacher else None
        return torch.cat(taps), torch.cat(greedy)

    def prefill_batch(self, ids: Tensor) -> TargetBatch:
        """The teacher-forced batch of windows ids int64 [S, T] (anchors from position 1), with the
        teacher's rows when the runner keeps them."""
        taps, greedy = self.prefill(ids, all_logits=True)
        if self._prefill_teacher is None:
            return TargetBatch(ids, taps, greedy, anchor_lo=1)
        s, t = ids.shape
        vals, tids = (x.view(s, t, -1) for x in self._prefill_teacher)
        return TargetBatch(ids, taps, greedy, 1, vals, tids)

    @torch.no_grad()
    def generate(self, prompts: Tensor, new_tokens: int) -> TargetBatch:
        """Greedy continuation (ignore EOS) of `prompts` int64 [S, P] by `new_tokens` tokens, one decode
        forward per token for all S sequences. Returns T = P + new_tokens positions, anchor_lo = P."""
        s, p = prompts.shape
        t = p + new_tokens
        cache = self.target.new_kv_cache(s * t)
        empty = torch.empty(0, dtype=torch.int64)
        base = torch.arange(s) * t  # sequence i owns slots [i*t, (i+1)*t), position j in slot i*t + j
        seqs = [SeqAttention(i * p, p, empty, torch.arange(p) + base[i]) for i in range(s)]
        out = self._forward(prompts.reshape(-1), torch.arange(p).repeat(s), seqs, cache, torch.arange(1, s + 1) * p - 1)
        ids = torch.empty(s, t, dtype=torch.int64)
        ids[:, :p] = prompts
        greedy = torch.full((s, t), -1, dtype=torch.int64)
        taps = torch.empty(s, t, len(self.tap_layer_ids) * self.target.config.hidden_size, dtype=self.taps_dtype)
        taps[:, :p] = out.taps.view(s, p, -1).to("cpu", self.taps_dtype)
        nxt = out.logits.argmax(-1).cpu()  # [S]
        greedy[:, p - 1] = nxt
        teacher, teacher_ids = self._teacher_rows(s, t, out.logits.shape[-1])
        if teacher is not None:
            teacher[:, p - 1], teacher_ids[:, p - 1] = self._teacher(out.logits)
        for pos in range(p, t):
            ids[:, pos] = nxt
            seqs = [SeqAttention(i, 1, torch.arange(pos) + base[i], (base[i] + pos).reshape(1)) for i in range(s)]
            out = self._forward(nxt, torch.full((s,), pos), seqs, cache, None)
            taps[:, pos] = out.taps.to("cpu", self.taps_dtype)
            nxt = out.logits.argmax(-1).cpu()
            greedy[:, pos] = nxt
            if teacher is not None:
                teacher[:, pos], teacher_ids[:, pos] = self._teacher(out.logits)
        return TargetBatch(ids, taps, greedy, anchor_lo=p, teacher=teacher, teacher_ids=teacher_ids)


# ---------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class DataSpec:
    source: str  # generate | corpus
    batch: int  # sequences per batch
    prompt_min: int  # generate: prompt length drawn log-uniformly in [prompt_min, prompt_max]
    prompt_max: int
    gen_tokens: int  # generate: tokens generated per prompt
    seq_len: int  # corpus: window length
    seed: int

    def validate(self, block_size: int) -> None:
        if self.source not in ("generate", "corpus"):
            raise ValueError(f"data source must be generate | corpus, got {self.source!r}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.source == "generate":
            if not 1 <= self.prompt_min <= self.prompt_max:
                raise ValueError(f"need 1 <= prompt_min ({self.prompt_min}) <= prompt_max ({self.prompt_max})")
            if self.gen_tokens < block_size:
                raise ValueError(f"gen_tokens ({self.gen_tokens}) must be >= block_size ({block_size})")
        elif self.seq_len < block_size + 1:
            raise ValueError(f"seq_len ({self.seq_len}) must be >= block_size + 1 ({block_size + 1})")


def make_batch(index: int, spec: DataSpec, streams: dict[str, TokenStream], runner: TargetRunner) -> TargetBatch:
    """Data batch `index`: a deterministic function of (spec.seed, index), whatever ran before."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    if spec.source == "corpus":
        ids = sample_windows(streams, spec.batch, spec.seq_len, g, prompts=False)
        return runner.prefill_batch(ids)
    lo, hi = math.log(spec.prompt_min), math.log(spec.prompt_max)
    p = int(round(math.exp(lo + (hi - lo) * float(torch.rand((), generator=g)))))
    prompts = sample_windows(streams, spec.batch, min(max(p, spec.prompt_min), spec.prompt_max), g, prompts=True)
    return runner.generate(prompts, spec.gen_tokens)


class BatchPool:
    """Batch i of training is data batch (i mod size); with size > 0 the batches are cached on disk
    (taps included) so later epochs and resumed runs skip the target. size 0 = always fresh data."""

    def __init__(self, directory: str | Path | None, size: int, build):
        self.dir = Path(directory) if directory else None
        self.size = size
        self.build = build  # index -> TargetBatch

    def get(self, i: int) -> TargetBatch:
        index = i % self.size if self.size > 0 else i
        path = self.dir / f"batch_{index:06d}.pt" if self.dir is not None and self.size > 0 else None
        if path is not None and path.is_file():
            return TargetBatch.from_state(torch.load(path, weights_only=True))
        batch = self.build(index)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(batch.state(), str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
        return batch
