"""The `ddtree` command as a user runs it: generate --json through a real gateway, serve + Ctrl-C."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ddtree.cli import build_parser
from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def _ddtree(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_generate_json_through_the_gateway(oracle_stack):
    runs = {}
    for mode, extra in (("spec", ["--budget", "8"]), ("ar", ["--no-spec"])):
        res = _ddtree(
            "generate",
            "--gateway",
            oracle_stack.gateway,
            "--prompt",
            "def add(a, b):",
            "--chat",
            "--max-tokens",
            "40",
            "--ignore-eos",
            "--json",
            *extra,
        )
        assert res.returncode == 0, res.stderr
        runs[mode] = json.loads(res.stdout)
    spec, ar = runs["spec"], runs["ar"]
    for out in (spec, ar):
        assert {"text", "token_ids", "usage", "spec", "timing"} <= set(out)
        assert {"steps", "accept_lengths", "avg_accept_length", "histogram"} <= set(out["spec"])
        assert {"ttft_s", "decode_s"} <= set(out["timing"])
        assert out["usage"]["completion_tokens"] == len(out["token_ids"]) == 40
    assert spec["token_ids"] == ar["token_ids"] and spec["text"] + spec["reasoning"] == ar["text"] + ar["reasoning"]
    assert spec["spec"]["avg_accept_length"] > 1.0 and ar["spec"]["avg_accept_length"] == 1.0
    lengths = spec["spec"]["accept_lengths"]
    # prefill yields 1 token, steps the other 39; the last step may commit past the length limit
    assert sum(lengths[:-1]) < 39 <= sum(lengths)


def test_serve_starts_three_services_and_stops_cleanly(default_ckpt, tmp_path):
    env = {"DDTREE_HOME": str(default_ckpt.root.parent)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.cli",
            "serve",
            "--log-dir",
            str(tmp_path),
            "--verifier-args",
            "--kv-tokens 4096 --max-tree-tokens 32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
    )
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("serving"):
            break
    skip = ("serving", "http", "service token: ")
    names = {line.split()[0] for line in lines if line[:1].isalpha() and not line.startswith(skip)}
    assert names == {"drafter", "verifier", "gateway"}, lines
    # issue 47: the engines get a generated service token, in a file of this user's only
    token = pathlib.Path(next(line.split()[2] for line in lines if line.startswith("service token: ")))
    assert token.parent == tmp_path and token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) == 64
    assert any(line.startswith("http      http://127.0.0.1:") for line in lines), lines
    gateway = next(line.split()[1] for line in lines if line.startswith("gateway"))
    # Each service's Prometheus endpoint, printed beside its gRPC address.
    prom = {
        m[1]: m[2] for line in lines if (m := re.match(r"(\w+) +\S+ +metrics (http://127\.0\.0\.1:\d+/metrics) ", line))
    }
    assert set(prom) == {"drafter", "verifier", "gateway"}, lines
    res = _ddtree("generate", "--gateway", gateway, "--prompt", "hi", "--max-tokens", "5", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["usage"]["completion_tokens"] >= 1
    scraped = {name: urllib.request.urlopen(url, timeout=10).read().decode() for name, url in prom.items()}
    assert "ddtree_accept_length_count" in scraped["verifier"] and "ddtree_gateway_" not in scraped["verifier"]
    assert re.search(r"^ddtree_running_sequences 0\.0$", scraped["verifier"], re.M)  # idle after the request
    assert "ddtree_drafter_calls_total" in scraped["drafter"] and "ddtree_accept_length" not in scraped["drafter"]
    assert "ddtree_gateway_requests_total" in scraped["gateway"] and "ddtree_drafter_" not in scraped["gateway"]
    ready = [
        json.loads(line) for line in (tmp_path / "verifier.log").read_text().splitlines() if '"verifier_ready"' in line
    ]
    assert ready and ready[0]["kv_tokens"] == 4096  # --verifier-args reached the verifier
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "gateway exit 0" in out and "verifier exit 0" in out and "drafter exit 0" in out


def test_every_service_flag_is_a_config_field():
    parser = build_parser()
    args = parser.parse_args(["verifier", "--max-batch", "4", "--drafter", "h:1", "--attention-backend", "torch"])
    assert args.max_batch == 4 and args.drafter == "h:1"
    with pytest.raises(SystemExit):
        parser.parse_args(["verifier", "--no-such-flag"])


def test_bad_configuration_is_one_clear_line():
    res = _ddtree("verifier", "--max-batch", "0", timeout=60)
    assert res.returncode == 2
    assert "max_batch must be >= 1" in res.stderr and "Traceback" not in res.stderr
