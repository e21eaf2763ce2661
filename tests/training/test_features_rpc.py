"""Verifier.Features (issue 18, point 1): drafter training data from a running verifier.

- The data it yields equals the in-process trainer's (drafter_data.TargetRunner.generate) for the same
  prompts: tokens and greedy labels identical, fp32 features within 1e-5, through a real verifier
  process: with a DFlash-shaped drafter (the oracle stack: speculative steps, the forward taps the
  drafter's layers and the request's), AR-only (no drafter: the request's layers alone) and at TP 2.
- The stream: rows in order, at most chunk_bytes of features per message, the dtype asked for, a stop
  token ending it (rows trimmed where a speculative step accepted past it), sampling as Generate's.
- Input validation (INVALID_ARGUMENT naming the field), admission (stream slots) and the service token.
- `ddtree train drafter --verifier` trains from it: on a fixed batch (--pool 1) the loss falls, and the
  exported drafter loads and differs from the initial one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from ddtree.launcher import start_service
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.dflash.checkpoint import load_drafter
from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.security import TOKEN_METADATA
from ddtree.tools.selftest.compare import assert_close
from ddtree.training.drafter_data import TargetRunner
from ddtree.training.verifier_data import VerifierRunner
from tests.support.paths import REPO

TOKEN = "features-token-for-tests"
TAPS = (2, 0)  # not the default drafter's (0, 3), and out of order: the columns must follow the request
VERIFIER_ARGS = ["--kv-tokens", "32768", "--max-context", "2048", "--prefill-chunk", "64", "--threads", "1"]
HIDDEN = 256


@pytest.fixture(scope="module")
def reference(default_ckpt):
    torch.set_num_threads(1)
    return TargetRunner(load_target(default_ckpt.target, dtype=torch.float32), TAPS, torch.float32)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def ar_verifier(default_ckpt, token_file, tmp_path_factory):
    """No drafter, a service token, four stream slots (max_batch 4 + max_queue 0)."""
    args = ["verifier", "--model", str(default_ckpt.target), "--max-batch", "4", "--max-queue", "0", *VERIFIER_ARGS]
    proc = start_service("verifier", [*args, "--service-token-file", str(token_file)], tmp_path_factory.mktemp("ar"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tp2_verifier(default_ckpt, oracle_stack, tmp_path_factory):
    drafter = oracle_stack.get("drafter").address
    args = ["verifier", "--model", str(default_ckpt.target), "--tp", "2", "--drafter", drafter, *VERIFIER_ARGS]
    proc = start_service("verifier", [*args, "--max-batch", "8"], tmp_path_factory.mktemp("tp2-features"))
    yield proc
    proc.stop()


def _prompts(count: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(20, 4000, (count, length), generator=torch.Generator().manual_seed(seed))


def _check_same_data(runner: VerifierRunner, reference: TargetRunner, prompts: torch.Tensor, gen: int) -> None:
    got, want = runner.generate(prompts, gen), reference.generate(prompts, gen)
    assert torch.equal(got.ids, want.ids), "the verifier's generation differs from the in-process one"
    assert torch.equal(got.greedy, want.greedy), "greedy labels differ"
    assert got.anchor_lo == want.anchor_lo == prompts.shape[1]
    assert got.taps.dtype == torch.float32 and got.taps.shape == want.taps.shape == (*got.ids.shape, 2 * HIDDEN)
    assert_close("features", got.taps, want.taps, abs_tol=1e-5, rel_tol=1e-4)


@pytest.mark.parametrize("prompt_len,gen", [(40, 24), (100, 16)], ids=["short", "chunked-prefill"])
def test_data_equals_the_in_process_trainers_with_speculation(oracle_stack, reference, prompt_len, gen):
    runner = VerifierRunner(oracle_stack.verifier, TAPS, torch.float32)
    _check_same_data(runner, reference, _prompts(3, prompt_len, prompt_len), gen)


def test_data_equals_the_in_process_trainers_without_a_drafter(ar_verifier, reference):
    runner = VerifierRunner(ar_verifier.address, TAPS, torch.float32, token=TOKEN)
    _check_same_data(runner, reference, _prompts(4, 30, 1), 20)


@pytest.mark.slow
def test_data_equals_the_in_process_trainers_at_tp2(tp2_verifier, reference):
    runner = VerifierRunner(tp2_verifier.address, TAPS, torch.float32)
    _check_same_data(runner, reference, _prompts(3, 70, 2), 20)


# ------------------------------------------------------------------------------------------- the stream


def _request(prompt, max_new=16, taps=TAPS, **kw) -> verifier_pb2.FeaturesRequest:
    gen = dict(input_ids=prompt, max_new_tokens=max_new, ignore_eos=True)
    gen.update({k: kw.pop(k) for k in ("stop_token_ids", "sampling", "spec", "grammar", "top_logprobs") if k in kw})
    return verifier_pb2.FeaturesRequest(generate=verifier_pb2.GenerateRequest(**gen), tap_layer_ids=taps, **kw)


def _call(address, req, metadata=None) -> list[verifier_pb2.FeaturesResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(verifier_pb2_grpc.VerifierStub(ch).Features(req, timeout=120, metadata=metadata))


def _rows(msgs) -> tuple[list[int], torch.Tensor]:
    from ddtree.protocol.tensors import tensor_from_proto

    tokens, feats = [], []
    for m in msgs[:-1]:
        assert m.start == len(tokens) and not m.finish_reason
        tokens += m.token_ids
        feats.append(tensor_from_proto(m.features))
    assert msgs[-1].finish_reason and not msgs[-1].token_ids and msgs[-1].start == len(tokens)
    return tokens, torch.cat(feats)


def test_chunks_are_bounded_and_the_dtype_is_the_one_asked(oracle_stack):
    prompt = _prompts(1, 50, 3)[0].tolist()
    whole = _call(oracle_stack.verifier, _request(prompt, spec=common_pb2.SpecOptions(no_spec=True)))
    tokens, feats = _rows(whole)
    assert len(tokens) == 50 + 16 - 1 and feats.shape == (65, 2 * HIDDEN)
    assert whole[-1].finish_reason == "length" and whole[-1].usage.completion_tokens == 16
    small = _call(
        oracle_stack.verifier,
        _request(
            prompt, spec=common_pb2.SpecOptions(no_spec=True), chunk_bytes=5000, features_dtype=common_pb2.BFLOAT16
        ),
    )
    assert all(len(m.features.data) <= 5000 for m in small) and len(small) > 10
    small_tokens, small_feats = _rows(small)
    assert small_tokens == tokens and small[-1].next_token_id == whole[-1].next_token_id
    assert small_feats.dtype == torch.bfloat16
    assert_close("bf16 rows", small_feats.float(), feats.to(torch.bfloat16).float(), abs_tol=1e-6, rel_tol=1e-6)


@pytest.mark.parametrize("no_spec", [True, False], ids=["ar", "ddtree"])
def test_a_stop_token_ends_the_rows_after_the_last_emitted_token(oracle_stack, no_spec):
    prompt = _prompts(1, 20, 4)[0].tolist()
    spec = common_pb2.SpecOptions(no_spec=no_spec)
    tokens, _ = _rows(msgs := _call(oracle_stack.verifier, _request(prompt, max_new=40, spec=spec)))
    generated = tokens[20:] + [msgs[-1].next_token_id]
    j = next(j for j in range(5, 40) if generated[j] not in generated[:j])
    stopped = _call(oracle_stack.verifier, _request(prompt, max_new=40, spec=spec, stop_token_ids=[generated[j]]))
    rows, feats = _rows(stopped)
    assert stopped[-1].finish_reason == "stop" and stopped[-1].next_token_id == generated[j]
    assert rows == prompt + generated[:j] and feats.shape[0] == 20 + j
    assert stopped[-1].usage.completion_tokens == j


def test_sampled_generation_is_generates(oracle_stack):
    prompt = _prompts(1, 24, 5)[0].tolist()
    sampling = common_pb2.SamplingParams(temperature=0.9, seed=11)
    msgs = _call(oracle_stack.verifier, _request(prompt, max_new=20, sampling=sampling))
    tokens, _ = _rows(msgs)
    with grpc.insecure_channel(oracle_stack.verifier) as ch:
        req = verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=20, ignore_eos=True, sampling=sampling)
        ref = [t for m in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120) for t in m.token_ids]
    assert tokens[24:] + [msgs[-1].next_token_id] == ref


# ------------------------------------------------------------------------------- validation and gates


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(taps=[]), "tap_layer_ids is empty"),
        (dict(taps=[1, 4]), "tap_layer_ids: layer 4 is not a layer of the target (layers 0..3)"),
        (dict(taps=[-1]), "tap_layer_ids: layer -1 is not a layer of the target"),
        (dict(taps=[1, 2, 1]), "tap_layer_ids repeats layer 1"),
        (dict(taps=[1] * 17), "tap_layer_ids names 17 layers, at most 16"),
        (dict(grammar='start: "a"'), "generate.grammar is not supported by Features"),
        (dict(top_logprobs=0), "generate.top_logprobs is not supported by Features"),
        (dict(features_dtype=common_pb2.INT32), "features_dtype INT32 is not a float type"),
        (dict(chunk_bytes=-1), "chunk_bytes must be in [1, 33554432]"),
        (dict(chunk_bytes=1 << 26), "chunk_bytes must be in [1, 33554432]"),
        (dict(max_new=5000), "generate: max_new_tokens 5000 is above the limit 4096"),
        (dict(max_new=0), "generate: max_new_tokens must be >= 1"),
        (dict(prompt=[7] * 2000, max_new=100), "generate: prompt (2000) + max_new_tokens (100) exceeds"),
        (dict(prompt=[]), "generate: input_ids is empty"),
        (dict(prompt=[5, 4096]), "generate: input_ids has 1 token ids outside [0, 4096)"),
    ],
)
def test_bad_requests_are_invalid_argument(oracle_stack, change, message):
    prompt = change.pop("prompt", [5, 6, 7])
    with pytest.raises(grpc.RpcError) as err:
        _call(oracle_stack.verifier, _request(prompt, **change))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details(), err.value.details()


def test_the_service_token_and_the_stream_slots_apply(ar_verifier):
    with pytest.raises(grpc.RpcError) as err:
        _call(ar_verifier.address, _request([5, 6, 7]))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    md = ((TOKEN_METADATA, TOKEN),)
    with grpc.insecure_channel(ar_verifier.address) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        long = _request([5, 6, 7], max_new=2000, chunk_bytes=1)
        calls = [stub.Features(long, timeout=120, metadata=md) for _ in range(4)]
        try:
            for call in calls:
                next(call)  # a first row: the stream holds a slot
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Features(_request([5, 6, 7]), timeout=60, metadata=md))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_batch + max_queue" in (
                err.value.details()
            )
        finally:
            for call in calls:
                call.cancel()


# ------------------------------------------------------------------------------------------ the trainer


def test_train_drafter_through_the_verifier(default_ckpt, ar_verifier, token_file, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "".join((REPO / "services" / "training" / n).read_text() for n in ("drafter_data.py", "drafter_trainer.py"))
    (corpus / "train_code.txt").write_text(text)
    run = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "ddtree.cli", "train", "drafter", "--verifier", ar_verifier.address),
        *("--service-token-file", str(token_file), "--target", str(default_ckpt.target), "--corpus", str(corpus)),
        *("--run-dir", str(run), "--kinds", "code", "--steps", "12", "--batch", "4", "--prompt-min", "16"),
        *("--prompt-max", "32", "--gen-tokens", "32", "--anchors", "8", "--pool", "1", "--val-batches", "0"),
        *("--warmup", "1", "--lr", "3e-3", "--layers", "1", "--taps-dtype", "float32", "--threads", "1"),
        *("--target-layer-ids", "1,3", "--log-every", "1"),
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert len(losses) == 12 and losses[-1] < losses[0] * 0.9, losses  # one fixed batch (--pool 1): it is learnt
    init, trained = load_drafter(run / "init"), load_drafter(run / "export")
    assert trained.config.target_layer_ids == (1, 3)
    diff = [n for n, p in trained.state_dict().items() if not torch.equal(p, init.state_dict()[n])]
    assert diff, "the exported drafter equals the initial one"
