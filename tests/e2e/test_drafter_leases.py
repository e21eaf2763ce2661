"""The drafter's state and the verifier's wait when the other side fails, through the real services on the
demo checkpoints:
- a verifier SIGKILLed with 5 streams in flight leaves 5 draft contexts on the drafter; restarted under the
  same --instance-name (its GetInfo at connection names the new incarnation), they are released at the
  first call once the former incarnation has been silent REPLACE_IDLE_S: active_sequences 0;
- a SIGSTOPped drafter during 8 streams (called over the co-located channel, the default on one host)
  stalls them once, for at most max(3 x the drafter's p99 call time before the stop, 1 s) (the deadline
  follows the drafter's speed, draft_deadline.py), then they decode with AR: every stream's tokens equal
  AR decoding.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from ddtree.drafter.leases import REPLACE_IDLE_S
from ddtree.launcher import start_service
from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow


def _drafter(ckpt, tmp_path):
    args = ["drafter", "--model", str(ckpt.drafter), "--target", str(ckpt.target), "--port", "0"]
    return start_service("drafter", args, tmp_path)


def _verifier(ckpt, drafter, tmp_path, *extra):
    args = ["verifier", "--model", str(ckpt.target), "--port", "0", "--drafter", drafter.address, *extra]
    return start_service("verifier", args, tmp_path)


def _request(i: int, max_new: int, no_spec: bool = False) -> verifier_pb2.GenerateRequest:
    return verifier_pb2.GenerateRequest(
        input_ids=[40 + i, 41, 42, 43 + i],
        max_new_tokens=max_new,
        ignore_eos=True,
        spec=common_pb2.SpecOptions(no_spec=no_spec, budget=8),
    )


class Stream(threading.Thread):
    """One Generate stream, its tokens, steps and the arrival time of every message."""

    def __init__(self, address: str, request):
        super().__init__(daemon=True)
        self.address, self.request = address, request
        self.tokens, self.steps, self.times, self.error = [], [], [], None

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(self.request, timeout=300):
                    self.times.append(time.monotonic())
                    self.tokens.extend(msg.token_ids)
                    self.steps.extend(msg.steps)
        except grpc.RpcError as err:
            self.error = err


def _active(drafter) -> int:
    with grpc.insecure_channel(drafter.address) as ch:
        return drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=30).active_sequences


def _wait_steps(streams, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(s.steps) < n for s in streams):
        assert time.monotonic() < deadline, "the streams did not get going"
        time.sleep(0.02)


def test_a_killed_verifier_restarted_under_its_name_leaves_no_draft_context(default_ckpt, tmp_path):
    drafter = _drafter(default_ckpt, tmp_path)
    verifier = _verifier(default_ckpt, drafter, tmp_path, "--instance-name", "verifier-a")
    try:
        streams = [Stream(verifier.address, _request(i, 400)) for i in range(5)]
        for s in streams:
            s.start()
        _wait_steps(streams, 3)
        verifier.popen.send_signal(signal.SIGKILL)
        verifier.popen.wait()
        assert _active(drafter) == 5, "the killed verifier's 5 sequences should still be held"
        verifier = _verifier(default_ckpt, drafter, tmp_path, "--instance-name", "verifier-a")
        # the restarted verifier's connection (GetInfo with its new incarnation) marks the former one replaced;
        # its contexts go at the first call once the former has been silent REPLACE_IDLE_S (a fast restart on
        # a fast machine can come back sooner than that)
        deadline = time.monotonic() + REPLACE_IDLE_S + 30
        while _active(drafter) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _active(drafter) == 0, "the restarted verifier's connection did not release its former contexts"
    finally:
        verifier.stop()
        drafter.stop()


def test_a_stopped_drafter_stalls_the_streams_once_for_a_few_of_its_own_call_times(default_ckpt, tmp_path):
    drafter = _drafter(default_ckpt, tmp_path)
    verifier = _verifier(default_ckpt, drafter, tmp_path)  # the defaults
    try:
        ar = [Stream(verifier.address, _request(i, 60, no_spec=True)) for i in range(8)]
        for s in ar:
            s.start()
        for s in ar:
            s.join()
        streams = [Stream(verifier.address, _request(i, 60)) for i in range(8)]
        for s in streams:
            s.start()
        _wait_steps(streams, 10)  # every stream drafted a few times: the deadline knows the drafter's speed
        calls = sorted(st.draft_ms + st.transport_ms for s in streams for st in s.steps if st.tree_nodes)
        p99_s = calls[min(len(calls) - 1, int(0.99 * len(calls)))] / 1e3
        stopped_at = time.monotonic()
        os.kill(drafter.popen.pid, signal.SIGSTOP)
        try:
            for s in streams:
                s.join(timeout=300)
        finally:
            os.kill(drafter.popen.pid, signal.SIGCONT)
        assert all(s.error is None for s in streams)
        assert [s.tokens for s in streams] == [s.tokens for s in ar], "a stream's tokens differ from AR"
        gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if b > stopped_at]
        # the drafter's share of a stall is the step's draft deadline (a few of its call times); the step then
        # still runs its own verify, whose time depends on this machine's load, not on the drafter
        verify_s = max(st.verify_ms for s in streams for st in s.steps) / 1e3
        bound = max(3 * p99_s, 1.0) + verify_s
        assert max(gaps) <= bound, (f"longest stall {max(gaps):.3f} s > {bound:.3f} s (p99 call {p99_s * 1e3:.1f} ms, "
                                    f"longest verify {verify_s * 1e3:.1f} ms)")  # fmt: skip
        assert any(st.tree_nodes == 0 for s in streams for st in s.steps[-3:]), "the streams kept drafting"
        assert '"drafter_local_channel"' in verifier.log_path.read_text(), "the co-located channel was not used"
    finally:
        verifier.stop()
        drafter.stop()
