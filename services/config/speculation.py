"""How the verifier speculates: where its drafter is, how large a step's trees are, how they are cut."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .flags import ConfigBase, option


@dataclasses.dataclass(frozen=True)
class SpeculationFields(ConfigBase):
    flag_group = "speculation"

    drafter: str = option("", "drafter address host:port ('' = no drafter: autoregressive decoding only)")
    default_budget: int = option(16, "tree node budget of a request that sets none", at_least=0)
    max_tree_tokens: int = option(
        0,
        "tree tokens (root + nodes) verified per step over the whole batch (0 = no limit): every tree keeps its "
        "first node and the rest go to the drafter's best-scoring nodes over the batch (an equal share, "
        "max_tree_tokens // n - 1 nodes each, when the drafter gives no scores)",
        at_least=0,
    )
    tree_cut: Literal["cost", "fixed"] = option(
        "cost",
        "how many of the drafter's nodes a step verifies. cost = cut each tree where a node's expected tokens "
        "per unit of step time fall under half the step's, from the step time measured on this verifier (per "
        "row, and per row per context token) and the drafter's node probabilities calibrated to the acceptance "
        "seen (some steps verify whole trees, to keep measuring): smaller trees where rows cost and drafts are "
        "unsure; fixed = the whole tree of the request's budget. Within --max-tree-tokens either way; the "
        "output tokens are the same",
    )
    grammar_tree: Literal["table", "prune"] = option(
        "table",
        "the tree of a request with a grammar. table = built here from the drafter's top-K table, of "
        "grammar-valid prefixes only; prune = the drafter's own tree, its grammar-invalid nodes pruned",
    )
    draft_timeout_s: float = option(
        10.0,
        "longest deadline in seconds of one step's drafter calls (Append chunks + Draft): what a call gets "
        "until the replica's speed is known, and a call carrying a long commit",
        above=0,
    )
    draft_deadline_multiple: float = option(
        3.0,
        "a Draft call's deadline is this multiple of the replica's recent p99 call time (at least "
        "--draft-deadline-floor-s, at most --draft-timeout-s); a replica past it is set aside",
        above=0,
    )
    draft_deadline_floor_s: float = option(0.75, "shortest deadline in seconds of a Draft call", above=0)
    drafter_local: Literal["auto", "off"] = option(
        "auto",
        "auto = send Draft calls to a drafter on this host over its Unix socket, features through the "
        "verifier's ring: GPU memory the drafter maps when both run on GPUs, else shared memory (gRPC when "
        "that fails and for remote drafters); off = gRPC only",
    )
    feature_ring_bytes: int = option(
        64 * 1024 * 1024,
        "size of the co-located drafter channel's feature ring (on a GPU verifier it is GPU memory of rank 0, "
        "counted in the memory plan); one call's features take at most half of it",
        at_least=4096,
    )
    instance_name: str = option(
        "",
        "this verifier's name to its drafters, which lease its draft contexts to it: a restart under the same "
        "name releases its former contexts at once ('' = hostname:port when --port is set, else anonymous: "
        "its contexts only expire)",
    )
    feature_chunk_bytes: int = option(
        4 * 1024 * 1024,
        "largest message of a commit's features to the drafter: a commit with more is sent in chunks",
        at_least=1,
    )
