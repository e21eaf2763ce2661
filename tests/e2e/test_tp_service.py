"""The verifier with --tp 2 as a service: DDTree output token-identical to TP=1, and a dead rank takes
the verifier down with an error instead of a hang.

The TP=1 reference is the session's oracle stack (conftest); the TP=2 verifier shares its drafter
(the oracle engine: real multi-token acceptance), so both verifiers see the same trees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from ddtree.launcher import start_service
from ddtree.models.parallel.process_group import free_port
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.tokenization.tokenizer import Tokenizer
from tests.support.paths import REPO
from tests.support.stack_calls import MAX_NEW, PROMPTS, VERIFIER_ARGS, generate_concurrently

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt_ids(default_ckpt):
    tok = Tokenizer(default_ckpt.target)
    return [tok.encode(p) for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def tp2_verifier(default_ckpt, oracle_stack, tmp_path_factory):
    proc = start_service(
        "verifier",
        [
            "verifier",
            "--model",
            str(default_ckpt.target),
            "--tp",
            "2",
            "--drafter",
            oracle_stack.get("drafter").address,
            *VERIFIER_ARGS,
        ],
        tmp_path_factory.mktemp("logs-tp2"),
    )
    yield proc
    assert proc.stop() == 0, "a graceful stop of a tensor-parallel verifier exits 0; " + proc.log_tail()
    assert '"tp_worker_stopped"' in proc.log_path.read_text(), "rank 1 left its loop on STOP"


@pytest.mark.parametrize("budget", [8, 32])
def test_tp2_ddtree_greedy_matches_tp1(tp2_verifier, oracle_stack, prompt_ids, budget):
    ref = generate_concurrently(oracle_stack.verifier, prompt_ids, no_spec=True)
    steps = []
    got = generate_concurrently(tp2_verifier.address, prompt_ids, steps, no_spec=False, budget=budget)
    assert all(len(t) == MAX_NEW for t in ref)
    assert max(s.accept_length for s in steps) > 1 and all(s.tree_nodes > 0 for s in steps)
    assert got == ref, "TP=2 DDTree output differs from TP=1 AR"


def test_tp2_static_steps_match_tp1(default_ckpt, oracle_stack, prompt_ids, tmp_path):
    """--cuda-graphs on at --tp 2 on the CPU: every rank builds its static step over its KV replica (no graphs
    here) and runs the steps that fit its buckets through it, in lockstep; DDTree tokens equal TP=1 AR."""
    args = ["verifier", "--model", str(default_ckpt.target), "--tp", "2", "--cuda-graphs", "on"]
    proc = start_service(
        "verifier", [*args, "--drafter", oracle_stack.get("drafter").address, *VERIFIER_ARGS], tmp_path
    )
    try:
        ref = generate_concurrently(oracle_stack.verifier, prompt_ids, no_spec=True)
        assert generate_concurrently(proc.address, prompt_ids, no_spec=False, budget=8) == ref
    finally:
        assert proc.stop() == 0, proc.log_tail()
    log = proc.log_path.read_text()
    assert log.count('"event": "static_step"') == 2, "rank 0 and rank 1 each built a static step"


def test_tp2_sampling_matches_tp1(tp2_verifier, oracle_stack, prompt_ids):
    """temperature > 0 gathers the full logits on rank 0: same seed, same draws as TP=1."""
    kw = dict(no_spec=False, budget=8, temperature=0.8, seed=11)
    assert generate_concurrently(tp2_verifier.address, prompt_ids, **kw) == generate_concurrently(
        oracle_stack.verifier, prompt_ids, **kw
    )


def test_ranks_launched_by_environment(default_ckpt, oracle_stack, prompt_ids, tmp_path):
    """RANK / WORLD_SIZE / MASTER_* set (as a multi-node launcher would): one process per rank, no spawning."""
    dist_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    args = ["verifier", "--model", str(default_ckpt.target), "--tp", "2", "--log-format", "json", *VERIFIER_ARGS]
    with open(tmp_path / "rank1.log", "wb") as log:
        rank1 = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", *args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, **dist_env, "RANK": "1"},
            cwd=REPO,
        )
    try:
        rank0 = start_service("verifier", args, tmp_path, env={**dist_env, "RANK": "0"})
        got = generate_concurrently(rank0.address, prompt_ids, no_spec=True)
        assert got == generate_concurrently(oracle_stack.verifier, prompt_ids, no_spec=True)
        assert '"tp_rank_spawned"' not in rank0.log_path.read_text()
        assert rank0.stop() == 0, rank0.log_tail()
        assert rank1.wait(timeout=30) == 0, "rank 1 exits 0 on rank 0's STOP"
    finally:
        if rank1.poll() is None:
            rank1.kill()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_rank_death_ends_the_verifier(default_ckpt, prompt_ids, tmp_path, sig):
    """A killed rank is seen at once (watchdog, broken connection); a hung one by the collective timeout."""
    proc = start_service(
        "verifier",
        [
            "verifier",
            "--model",
            str(default_ckpt.target),
            "--tp",
            "2",
            "--tp-timeout-s",
            "5",
            "--log-format",
            "json",
            *VERIFIER_ARGS,
        ],
        tmp_path,
    )
    try:
        rank1 = next(
            json.loads(line)["pid"] for line in proc.log_path.read_text().splitlines() if '"tp_rank_spawned"' in line
        )
        streaming, outcome = threading.Event(), {}

        def client():
            try:
                for _ in _stream(proc.address, prompt_ids[0]):
                    streaming.set()
                outcome["error"] = None
            except grpc.RpcError as err:
                outcome["error"] = err.code()

        t = threading.Thread(target=client, daemon=True)
        t.start()
        assert streaming.wait(60), "the stream never started"
        killed = time.monotonic()
        os.kill(rank1, sig)
        proc.popen.wait(timeout=30)
        t.join(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
        deadline = time.monotonic() + 5
        while _alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        survived = _alive(rank1)
        if survived:
            os.kill(rank1, signal.SIGKILL)
    assert proc.popen.returncode != 0, "the verifier must exit non-zero when a rank dies"
    assert elapsed < 30
    assert outcome.get("error") in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED), (
        f"client saw {outcome}"
    )
    log = proc.log_path.read_text()
    if sig == signal.SIGKILL:
        assert "rank 1 exited with code -9" in log
    else:
        assert "Timed out" in log and "hung or unreachable" in log
    assert not survived, "rank 1 outlived the verifier (rank 0 kills the ranks it spawned)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stream(address, ids):
    from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        req = verifier_pb2.GenerateRequest(
            input_ids=ids, max_new_tokens=1900, ignore_eos=True, spec=common_pb2.SpecOptions(no_spec=True)
        )
        yield from verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120)


def _logprobs(address: str, ids: list[int], budget: int) -> tuple[list[int], list]:
    with grpc.insecure_channel(address) as ch:
        req = verifier_pb2.GenerateRequest(
            input_ids=ids,
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0),
            spec=common_pb2.SpecOptions(budget=budget),
            top_logprobs=3,
        )
        msgs = list(verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300))
    return [t for m in msgs for t in m.token_ids], [lp for m in msgs for lp in m.logprobs]


def test_tp2_logprobs_match_tp1(tp2_verifier, oracle_stack, prompt_ids):
    """A greedy request with logprobs at TP 2 gathers the logits over the vocab shards: the same tokens
    and, within fp32 tolerance, the same logprobs and top tokens as TP 1."""
    for ids in prompt_ids[:2]:
        tokens, got = _logprobs(tp2_verifier.address, ids, 8)
        ref_tokens, ref = _logprobs(oracle_stack.verifier, ids, 8)
        assert tokens == ref_tokens and len(got) == len(tokens) == MAX_NEW
        for a, b in zip(got, ref):
            assert abs(a.logprob - b.logprob) < 1e-4 and list(a.top_ids) == list(b.top_ids)
            assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) < 1e-4


def _prompt_logprobs(address: str, ids: list[int]) -> list:
    with grpc.insecure_channel(address) as ch:
        req = verifier_pb2.GenerateRequest(
            input_ids=ids, max_new_tokens=2, sampling=common_pb2.SamplingParams(temperature=0.0), prompt_logprobs=3
        )
        msgs = list(verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300))
    return [m.prompt_logprobs for m in msgs if m.HasField("prompt_logprobs")]


def test_tp2_prompt_logprobs_match_tp1(tp2_verifier, oracle_stack, prompt_ids):
    """prompt_logprobs at TP 2 gathers every prompt row's logits over the vocab shards: within fp32
    tolerance the same entries as TP 1, for a prompt over several prefill chunks."""
    ids = [t for p in prompt_ids for t in p] * 2
    assert len(ids) > 64  # VERIFIER_ARGS' --prefill-chunk
    got, ref = _prompt_logprobs(tp2_verifier.address, ids), _prompt_logprobs(oracle_stack.verifier, ids)
    assert [t for p in got for t in p.token_ids] == [t for p in ref for t in p.token_ids] == ids[1:]
    pairs = list(zip([lp for p in got for lp in p.logprobs], [lp for p in ref for lp in p.logprobs]))
    assert all(abs(a.logprob - b.logprob) < 1e-4 and list(a.top_ids) == list(b.top_ids) for a, b in pairs)
    assert all(max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) < 1e-4 for a, b in pairs)
    assert [r for p in got for r in p.ranks] == [r for p in ref for r in p.ranks]
