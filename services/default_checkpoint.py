"""The embedded default checkpoints.

`default_checkpoint()` is what `ddtree serve / generate / demo` use: the trained demo pair shipped in
`checkpoints/demo/` (target + DFlash drafter + tokenizer; see README "The demo model"), or, when that
folder is absent, the random pair below.

`ensure_default_checkpoint()` builds the random pair reproducibly on first use: a small random
Kimi-shaped target (DeepSeek-V3 architecture), a random DFlash drafter for it, and a byte-level BPE
tokenizer trained on the Python standard library, with the Kimi K2 special tokens and chat template.
Everything is seeded, so every machine builds the same files; the tests use it because its shapes are
fixed. Creation is atomic (build in a temp dir, then rename) and guarded by a file lock, so several
services starting at once build it once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import pathlib
import shutil
import tempfile

from ddtree.config import DEFAULT_CHECKPOINT_DIR
from ddtree.tokenization.default_tokenizer import MASK_TOKEN, write_default_tokenizer
from ddtree.tokenization.tokenizer import Tokenizer

VERSION = "random-v1"
DEMO_DIR = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "demo"  # services/ -> the repository
SEED = 20261129


@dataclasses.dataclass(frozen=True)
class DefaultCheckpoint:
    root: pathlib.Path

    @property
    def target(self) -> pathlib.Path:
        return self.root / "target"

    @property
    def drafter(self) -> pathlib.Path:
        return self.root / "drafter"


def build_default_checkpoint(out: pathlib.Path) -> None:
    # torch: the gateway's install has none, and its `ddtree gateway` imports this module for the default
    # tokenizer's folder; only building a random checkpoint needs the models
    from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
    from ddtree.models.dflash.checkpoint import write_random_drafter

    target_dir, drafter_dir = out / "target", out / "drafter"
    target_dir.mkdir(parents=True)
    write_default_tokenizer(target_dir)
    tok = Tokenizer(target_dir)
    config = dict(DEFAULT_TARGET_CONFIG)
    config.update(bos_token_id=tok.token_id("[BOS]"), eos_token_id=[tok.token_id("[EOS]"), tok.token_id("<|im_end|>")])
    assert tok.vocab_size <= config["vocab_size"], "tokenizer larger than the model vocabulary"
    write_random_target(target_dir, config, seed=SEED)
    write_random_drafter(drafter_dir, config, seed=SEED + 1, mask_token_id=tok.token_id(MASK_TOKEN))
    (out / "README.txt").write_text(
        "Random default checkpoint of ddtree-serve (seeded; rebuilt identically on every machine).\n"
        f"version {VERSION}, seed {SEED}\n"
    )
    (out / "manifest.json").write_text(json.dumps({"version": VERSION, "seed": SEED}, indent=2))


def ensure_default_checkpoint(base: pathlib.Path | None = None) -> DefaultCheckpoint:
    base = pathlib.Path(base or DEFAULT_CHECKPOINT_DIR)
    ckpt = DefaultCheckpoint(base / VERSION)
    if (ckpt.root / "manifest.json").exists():
        return ckpt
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (ckpt.root / "manifest.json").exists():
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=base))
            try:
                build_default_checkpoint(tmp / "ckpt")
                (tmp / "ckpt").rename(ckpt.root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


def default_checkpoint() -> DefaultCheckpoint:
    """The shipped demo pair when present, else the random pair (built on first use)."""
    demo = DefaultCheckpoint(DEMO_DIR)
    if (demo.target / "config.json").exists() and (demo.drafter / "config.json").exists():
        return demo
    return ensure_default_checkpoint()
