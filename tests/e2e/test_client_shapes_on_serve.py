"""`ddtree serve` with relative checkpoint directories (from another working directory than the children's),
then the request shapes of the clients people already use, through the real services with the official
openai and anthropic clients: guidellm's stream (continuous usage), lm-eval's log-likelihood request (echo +
logprobs, and max_tokens 0), a prompt over the context (OpenAI's and Anthropic's wording), tools under
auto with a strict schema (the verifier enforces the gateway's grammar)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import anthropic
import jsonschema
import openai
import pytest

MODEL = "ddtree-demo"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(default_ckpt, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("elsewhere")
    rel = {name: os.path.relpath(getattr(default_ckpt, name), cwd) for name in ("target", "drafter")}
    assert not os.path.isabs(rel["target"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree.cli", "serve", "--model", rel["target"], "--drafter", rel["drafter"]]
        + ["--no-metrics", "--log-dir", str(cwd / "logs"), "--verifier-args", "--kv-tokens 8192 --max-context 1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    lines, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("serving") or not line:
            break
    http = next((m[1] for ln in lines if (m := re.match(r"http +http://(\S+)/v1", ln))), None)
    assert http, (lines, proc.stderr.read() if proc.poll() is not None else "")
    yield http
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


def test_guidellm_stream_shape(served):
    client = openai.OpenAI(base_url=f"http://{served}/v1", api_key="none", max_retries=0, timeout=120)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=12,
            stream=True,
            stream_options=options,
        )
    )
    *body, last = chunks
    assert all(c.usage is not None for c in body)
    done = [c.usage.completion_tokens for c in body]
    assert done == sorted(done) and done[-1] == last.usage.completion_tokens > 0


def test_lm_eval_loglikelihood_shape(served):
    client = openai.OpenAI(base_url=f"http://{served}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "The capital of France is Paris"
    for max_tokens in (1, 0):
        r = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
        )
        lps, n = r.choices[0].logprobs, r.usage.prompt_tokens
        assert r.choices[0].text.startswith(prompt)
        assert len(lps.token_logprobs) == n + max_tokens and lps.token_logprobs[0] is None
        assert all(v <= 0 for v in lps.token_logprobs[1:]) and r.usage.completion_tokens == max_tokens


def test_context_length_words(served):
    client = openai.OpenAI(base_url=f"http://{served}/v1", api_key="none", max_retries=0, timeout=120)
    text = " ".join(f"w{i}" for i in range(2000))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=text, max_tokens=10)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["message"].startswith("This model's maximum context length is 1024 tokens.")
    claude = anthropic.Anthropic(base_url=f"http://{served}", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": text}])
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 1024 maximum", err.value.body["error"]["message"])


def test_tools_under_auto_on_the_verifier(served):
    client = openai.OpenAI(base_url=f"http://{served}/v1", api_key="none", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": SCHEMA}}]
    messages = [{"role": "user", "content": "Weather in Paris? Call get_weather."}]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=48, temperature=1.0, seed=seed
        )
        for call in r.choices[0].message.tool_calls or []:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
