"""Draft engine: per-sequence windowed contexts + one DFlash block + the DDTree build (docs/design.md §3.1).

One `draft` call takes, per sequence, the commit of the previous step (token ids, absolute start,
the target's tapped features of those tokens) and the root (the previous bonus token, not yet
committed), and returns per sequence, in input order, its TokenTree, or its top-K TokenTable when it
asks for one (`table_width` > 0: the verifier builds the tree, a grammar's valid prefixes only).

Commit / window contract (with window W > 0):
  - `commit_features` has exactly one row per `commit_token_ids` entry, and the tokens sit at absolute
    positions [commit_start, commit_start + n). The root sits at commit_start + n.
  - Tokens that fall outside the window never need to be sent: the verifier may drop the oldest
    commit tokens and move commit_start forward accordingly. A non-reset commit must start exactly
    at the context's end, unless it alone fills the window (n >= W), in which case a gap is allowed
    because everything before it would be evicted anyway.
  - The commit token ids are not model inputs (the drafter conditions on features, and on the root
    through the embedding); they are checked for range and count only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.contract.token_tree import TokenTree
from ddtree.drafter.context import DraftContext
from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.tree import MAX_TABLE_WIDTH, TokenTable, drafted_trees, topk_logprobs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Most commit rows per context_kv call where matmul kernels are built and kept per row count: bf16 / fp16 on the
# CPU, where oneDNN caches a primitive per shape (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep one more
# (LRU_CACHE_CAPACITY), 1024 entries each, and every entry holds a built kernel. Every prompt length would be a new row count, so
# longer commits run in pieces of at most this many rows: the row counts ever run are 1..KV_ROWS_PER_CALL, all
# built by warm_up, and the caches stop growing (scripts/bench/measure_drafter_rss.py). context_kv is row-wise; oneDNN's
# AVX512-BF16 kernels give each row the same bits whatever the row count, so there the pieces change no K/V, while
# its AMX kernels (Sapphire Rapids and later) do not, and the pieces' K/V differ from one call's by rounding only
# (tests/drafter/test_drafter_memory.py checks whichever holds): the drafter only proposes, so neither changes an output.
# fp32 matmuls (MKL) keep nothing per shape, and their bits do depend on it: not split.
KV_ROWS_PER_CALL = 128


@dataclass(frozen=True)
class SeqDraftInput:
    seq_id: str
    commit_token_ids: tuple[int, ...]
    commit_start: int  # absolute position of commit_token_ids[0]
    commit_features: Tensor  # [n, len(target_layer_ids) * H_target], n = len(commit_token_ids)
    root_token_id: int  # the previous bonus token, at position commit_start + n
    budget: int = 0  # non-root tree nodes; 0 = the engine's default
    reset: bool = False  # forget any earlier context of this sequence first
    chain: bool = False  # width 1: the top-1 token per depth, min(budget, block_size - 1) nodes
    table_width: int = 0  # > 0: the top-K table (K = table_width) [block_size - 1, K] instead of a tree


class DraftEngine:
    def __init__(
        self,
        model: DFlashDraftModel,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        window: int = 2048,
        default_budget: int | None = None,
        max_budget: int = 1024,
        model_id: str = "dflash",
    ):
        cfg = model.config
        self._check_head(cfg, embed_weight, lm_head_weight)
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = unlimited), got {window}")
        default_budget = cfg.block_size - 1 if default_budget is None else default_budget
        if max_budget < 1 or not 1 <= default_budget <= max_budget:
            raise ValueError(f"need 1 <= default_budget ({default_budget}) <= max_budget ({max_budget})")
        self.model = model.eval()
        self.config = cfg
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.window = window
        self.default_budget = default_budget
        self.max_budget = max_budget
        self.model_id = model_id
        self._contexts: dict[str, DraftContext] = {}
        # Attention over the context is fp32. On the CPU the context is kept in fp32 (converted once per row)
        # rather than converting the whole window at every layer of every draft; on a GPU, where the
        # conversion is cheap and memory is what limits sequences, it stays in the model dtype.
        self._context_dtype = torch.float32 if model.device.type == "cpu" else None
        shape_cached = model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16)
        self.kv_rows_per_call = KV_ROWS_PER_CALL if shape_cached else 0  # 0 = all commit rows in one call
        self.static = None  # a static_draft.StaticDraft (--cuda-graphs): block forwards that fit a bucket run there
        # Where the trees are built (ddtree.tree.drafted_trees): with tensor ops where the logits are on an
        # accelerator, by the heap on the CPU (the same trees).
        self.tree_on_device = model.device.type != "cpu"

    def _check_head(self, cfg, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        """The target's embedding and LM head, [vocab_size, hidden_size] each."""
        if embed_weight.dim() != 2 or tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embed_weight must be [vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}], "
                f"got {tuple(embed_weight.shape)}"
            )
        if tuple(lm_head_weight.shape) != tuple(embed_weight.shape):
            raise ValueError(f"lm_head_weight must be {tuple(embed_weight.shape)}, got {tuple(lm_head_weight.shape)}")

    def _embed(self, block_ids: Tensor) -> Tensor:
        """int64 [S, B] -> the target's embedding rows [S, B, H]."""
        return self.embed_weight[block_ids]

    def _topk_logprobs(self, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """hidden rows [R, H] -> (log-probs fp32 [R, k] descending, token ids int64 [R, k]) over the vocabulary."""
        return topk_logprobs(self.model.compute_logits(rows, self.lm_head_weight), k)

    @property
    def context_dtype(self) -> torch.dtype:
        """The dtype the draft contexts hold their K/V in."""
        return self._context_dtype or self.model.dtype

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    @property
    def active_sequences(self) -> int:
        return len(self._contexts)

    def knows(self, seq_id: str) -> bool:
        """Whether the engine holds a draft context for seq_id."""
        return seq_id in self._contexts

    @property
    def context_bytes(self) -> int:
        return sum(c.nbytes for c in self._contexts.values())

    def info(self) -> dict:
        """DrafterInfo fields (proto/ddtree/v1/drafter.proto)."""
        cfg = self.config
        return dict(
            model_id=self.model_id,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            target_layer_ids=list(cfg.target_layer_ids),
            window=self.window,
            default_budget=self.default_budget,
            max_budget=self.max_budget,
            hidden_size=cfg.target_hidden_size,
            vocab_size=self.vocab_size,
            active_sequences=self.active_sequences,
        )

    def warm_up(self, max_seqs: int) -> float:
        """Run once every matmul shape that steady-state Draft calls of up to max_seqs sequences use, so
        that kernels built per shape (oneDNN's bf16 matmuls on the CPU, built the first time a row count
        is seen) are built at start rather than inside the first requests' steps.
        Shapes: commits of 1..max_seqs x block_size rows (every sequence commits 1..B tokens a step), or of
        1..kv_rows_per_call rows where commits run in pieces of that many (any prompt leaves a piece of any size),
        and 1..max_seqs blocks with their LM head and top-K. Returns the seconds it took."""
        t0 = time.perf_counter()
        cfg, model, B = self.config, self.model, self.config.block_size
        with torch.inference_mode():
            for n in range(1, (self.kv_rows_per_call or max_seqs * B) + 1):
                model.context_kv(torch.zeros(n, cfg.feature_size), torch.arange(n))
            context = model.context_kv(torch.zeros(4, cfg.feature_size), torch.arange(4))
            for S in range(1, max_seqs + 1):
                embeds = self.embed_weight[torch.full((S, B), cfg.mask_token_id)]
                positions = 4 + torch.arange(B).repeat(S, 1)  # [S, B]
                hidden = model.forward_blocks(embeds, positions, [context] * S)
                rows = hidden[:, cfg.prediction_slots].reshape(S * (B - 1), -1)
                logits = model.compute_logits(rows, self.lm_head_weight)
                topk_logprobs(logits, min(self.default_budget, self.vocab_size))
        return time.perf_counter() - t0

    def context_end(self, seq_id: str) -> int | None:
        """Absolute position where the sequence's next commit must start; None if unknown."""
        ctx = self._contexts.get(seq_id)
        return None if ctx is None else ctx.end

    def release(self, seq_ids: Iterable[str]) -> int:
        """Forget these sequences; returns how many were known."""
        return sum(self._contexts.pop(s, None) is not None for s in seq_ids)

    def draft(self, seqs: Sequence[SeqDraftInput]) -> list[TokenTree | TokenTable]:
        """Validate every sequence first (no state changes on error), then draft each in order: a tree, or
        the sequence's top-K table where it asks for one (table_width > 0)."""
        self._validate_all(seqs)
        with torch.inference_mode():
            return self._draft_all(seqs)

    def append(self, seqs: Sequence[SeqDraftInput]) -> None:
        """Append commits to their contexts without drafting (a long commit's earlier chunks: the Append
        RPC). Validated like a Draft's commits first, so an inconsistent chunk changes nothing; the root,
        budget and chain fields are not read."""
        self._validate_all(seqs)
        with torch.inference_mode():
            self._extend_contexts(seqs)

    def _validate_all(self, seqs: Sequence[SeqDraftInput]) -> None:
        """ValueError naming the first bad sequence. The features' values are checked for all sequences
        at once: one read of the device (one flag per sequence), not one per sequence."""
        seen: set[str] = set()
        for i, seq in enumerate(seqs):
            self._validate(i, seq, seen)
            seen.add(seq.seq_id)
        if seqs:
            feats = [seq.commit_features for seq in seqs]
            where = next((f.device for f in feats if f.device.type != "cpu"), feats[0].device)  # one read, there
            finite = torch.stack([torch.isfinite(f).all().to(where) for f in feats])
            for i, ok in enumerate(finite.tolist()):
                if not ok:
                    raise ValueError(f"seqs[{i}] (seq_id={seqs[i].seq_id!r}): commit_features has non-finite values")

    def _validate(self, i: int, seq: SeqDraftInput, seen: set[str]) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"seqs[{i}] (seq_id={getattr(seq, 'seq_id', None)!r}): {msg}")

        if not isinstance(seq.seq_id, str) or not seq.seq_id:
            fail("seq_id must be a non-empty string")
        if seq.seq_id in seen:
            fail("duplicate seq_id in one draft call")
        n = len(seq.commit_token_ids)
        ctx = self._contexts.get(seq.seq_id)
        if seq.commit_start < 0:
            fail(f"commit_start must be >= 0, got {seq.commit_start}")
        if seq.reset and n == 0:
            fail("reset needs a non-empty commit (the drafter has no context otherwise)")
        if not seq.reset:
            if ctx is None:
                fail("unknown sequence; send its first commit with reset=True")
            fills_window = self.window > 0 and n >= self.window
            if seq.commit_start != ctx.end and not (fills_window and seq.commit_start > ctx.end):
                fail(f"commit_start {seq.commit_start} != context end {ctx.end}")
        if not 0 <= seq.budget <= self.max_budget:
            fail(f"budget must be in [0, {self.max_budget}] (0 = default {self.default_budget}), got {seq.budget}")
        vocab = self.vocab_size
        try:
            check_table_width(seq.table_width, seq.chain, vocab)
        except ValueError as err:
            fail(str(err))
        bad = [t for t in seq.commit_token_ids if not 0 <= t < vocab]
        if bad:
            fail(f"commit_token_ids has ids outside [0, {vocab}): {bad[:4]}")
        if not 0 <= seq.root_token_id < vocab:
            fail(f"root_token_id {seq.root_token_id} outside [0, {vocab})")
        feats = seq.commit_features
        want = (n, self.config.feature_size)
        if not isinstance(feats, Tensor):
            fail(f"commit_features must be a tensor, got {type(feats).__name__}")
        if tuple(feats.shape) != want:
            fail(
                f"commit_features shape {tuple(feats.shape)} != [len(commit_token_ids), "
                f"len(target_layer_ids) * target_hidden_size] = {list(want)}"
            )
        if feats.dtype not in _FLOAT_DTYPES:
            fail(f"commit_features dtype {feats.dtype} is not a float dtype")

    def _extend_contexts(self, seqs: Sequence[SeqDraftInput]) -> list[DraftContext]:
        """Append each commit's features to its sequence's context (a fresh one when the commit does not
        continue it); returns the contexts the blocks attend to. The K/V of all commits are computed in
        one drafter call (context_kv is row-wise), then split per sequence."""
        contexts, rows, positions = [], [], []
        for seq in seqs:
            n = len(seq.commit_token_ids)
            ctx = self._contexts.get(seq.seq_id)
            # A fresh context also when this commit alone fills the window (n >= W): nothing older survives.
            if seq.reset or ctx is None or seq.commit_start != ctx.end or (self.window and n >= self.window):
                ctx = self._contexts[seq.seq_id] = DraftContext(self.window, dtype=self._context_dtype)
            keep = n if self.window == 0 else min(n, self.window)  # rows past the window would be evicted at once
            contexts.append(ctx)
            rows.append(seq.commit_features[n - keep :])  # [keep, F]
            positions.append(torch.arange(seq.commit_start + n - keep, seq.commit_start + n))  # [keep]
        counts = [p.shape[0] for p in positions]
        if sum(counts):
            device = self.model.device
            kv = self._context_kv(
                torch.cat([r.to(device, self.model.dtype) for r in rows]), torch.cat(positions).to(device)
            )  # per layer (K, V) [sum(keep), kvh, hd]
            split = [(k.split(counts), v.split(counts)) for k, v in kv]
            for i, (ctx, pos) in enumerate(zip(contexts, positions)):
                if counts[i]:
                    ctx.append([(k[i], v[i]) for k, v in split], pos)  # positions on the host: checked there
        return contexts

    def _context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """model.context_kv over the rows in pieces of at most kv_rows_per_call (0 = one call): the same K/V."""
        n, step = features.shape[0], self.kv_rows_per_call or features.shape[0]
        if n <= step:
            return self.model.context_kv(features, positions)
        parts = [self.model.context_kv(features[i : i + step], positions[i : i + step]) for i in range(0, n, step)]
        return [
            (torch.cat([p[layer][0] for p in parts]), torch.cat([p[layer][1] for p in parts]))
            for layer in range(len(parts[0]))
        ]

    def _draft_all(self, seqs: Sequence[SeqDraftInput]) -> list[TokenTree | TokenTable]:
        """One drafter forward for every sequence's block [root, MASK x (B-1)] (S blocks of B slots),
        one LM head over all S x (B-1) slots, then each sequence's top-K and best-first tree (or its
        top-K table, K = table_width)."""
        if not seqs:
            return []
        cfg, model = self.config, self.model
        contexts = self._extend_contexts(seqs)
        S, B = len(seqs), cfg.block_size
        block_ids = torch.full((S, B), cfg.mask_token_id, dtype=torch.long, device=self.embed_weight.device)
        block_ids[:, 0] = torch.tensor([seq.root_token_id for seq in seqs], device=block_ids.device)
        embeds = self._embed(block_ids)  # [S, B, H]
        if cfg.input_embedding_scale != 1.0:
            embeds = embeds * cfg.input_embedding_scale
        root_pos = torch.tensor([seq.commit_start + len(seq.commit_token_ids) for seq in seqs], device=model.device)
        block_pos = (
            root_pos[:, None] + torch.arange(B, device=model.device)[None, :]
        )  # [S, B]: the root's position first
        kv = [ctx.kv for ctx in contexts]
        hidden = self.static.run(embeds, block_pos, kv) if self.static is not None else None
        if hidden is None:  # no static step, or the call fits none of its buckets
            hidden = model.forward_blocks(embeds, block_pos, kv)  # [S, B, H]; not cached
        rows = hidden[:, cfg.prediction_slots].reshape(S * (B - 1), -1)  # depth order (draft_shift: which slots)
        budgets = [seq.budget or self.default_budget for seq in seqs]
        # chain (K = 1): the best-first build can only extend the single path, one node per depth
        budgets = [min(b, B - 1) if seq.chain else b for seq, b in zip(seqs, budgets)]
        ks = [
            seq.table_width or (1 if seq.chain else min(budget, self.vocab_size)) for seq, budget in zip(seqs, budgets)
        ]
        # One top-K over every sequence's rows (row d - 1 of block s: depth d of sequence s); a sequence takes
        # the first k of its rows' sorted top-K.
        logprobs, ids = self._topk_logprobs(rows, max(ks))  # [S*D, K]
        logprobs, ids = logprobs.view(S, B - 1, -1), ids.view(S, B - 1, -1)
        tables, chains = [bool(seq.table_width) for seq in seqs], [seq.chain for seq in seqs]
        return drafted_trees(logprobs, ids, ks, budgets, tables, chains, self.tree_on_device)


def check_table_width(table_width: int, chain: bool, vocab_size: int) -> None:
    """SeqDraft.table_width: 0 (a tree) or 1..min(vocab_size, MAX_TABLE_WIDTH), and not with chain; ValueError
    naming the field otherwise. The Drafter server checks it for any engine."""
    top = min(vocab_size, MAX_TABLE_WIDTH)
    if not 0 <= table_width <= top:
        raise ValueError(
            f"table_width must be in [0, {top}] (0 = a tree; at most min(vocab_size, {MAX_TABLE_WIDTH})), got {table_width}"
        )
    if table_width and chain:
        raise ValueError("table_width and chain exclude each other (a chain is the tree of a width-1 table)")
