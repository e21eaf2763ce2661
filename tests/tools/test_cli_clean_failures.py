"""What a newcomer hits with the `ddtree` command fails in one clear line: exit status 2, one error line on
stderr (besides the services' JSON log lines), no traceback. Each case runs the command as a process.

- generate: a dead address, and the gateway's refusals (--temperature -1, --max-tokens 100000,
  --budget 1000) from a gateway over a FAKE verifier; the failing hop named (issue 47): a verifier that
  fails mid-stream or before it is "the verifier behind" a gateway that is up, a dead address is an
  unreachable gateway; an API key from --api-key-file or DDTREE_API_KEY, none refused in words;
- a checkpoint directory with config.json and no safetensors (serve, verifier), a checkpoint without a
  tokenizer (serve, gateway), a --model that is not there;
- and what works: --version, serve --help naming the HTTP API and its port variable, relative directories
  made absolute before the children start, serve's --tokenizer and --gateway-args reaching the gateway.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import grpc
import pytest

from tests.support.fakes import script_for, serve_gateway

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO / "checkpoints" / "demo" / "target"


def _ddtree(
    *args: str, cwd: pathlib.Path | None = None, timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "DDTREE_API_KEY"}, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def _one_line_failure(r: subprocess.CompletedProcess, command: str, *words: str) -> str:
    """The failure's one line (the services' structured log lines, JSON objects, aside)."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith(f"ddtree {command}: error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# -- generate ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


def test_generate_with_a_dead_address():
    r = _ddtree("generate", "--gateway", "127.0.0.1:1", "--prompt", "hi")
    line = _one_line_failure(r, "generate", "127.0.0.1:1", "unreachable", "is it running?")
    assert "verifier" not in line


@pytest.mark.parametrize("sent", [3, 0])
def test_generate_names_the_verifier_when_it_fails_behind_the_gateway(gw, fake, sent):
    """The verifier dies mid-request (after `sent` tokens) or before its first: the gateway passes its
    UNAVAILABLE on, and the line says the gateway is up and the verifier behind it failed."""
    script = script_for(list(range(5, 5 + sent)), finish="")[:sent]
    fake.reset(script, error=(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"))
    r = _ddtree("generate", "--gateway", gw.address, "--prompt", "hi", "--max-tokens", "8")
    line = _one_line_failure(r, "generate", gw.address, "is up, but the verifier behind it failed", "UNAVAILABLE")
    assert "unreachable" not in line and "is it running" not in line


@pytest.fixture(scope="module")
def keyed_gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir, api_key="sk-cli-test")


def test_generate_sends_the_api_key_from_a_file_or_the_environment(keyed_gw, fake, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("# the team's key\nsk-cli-test max_budget=8\n")
    for flags, env in [(("--api-key-file", str(key_file)), None), ((), {"DDTREE_API_KEY": "sk-cli-test"})]:
        fake.reset(script_for([5, 6, 7]))
        r = _ddtree("generate", "--gateway", keyed_gw.address, "--prompt", "hi", "--json", *flags, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == [5, 6, 7]
    fake.reset(script_for([5]))
    r = _ddtree("generate", "--gateway", keyed_gw.address, "--prompt", "hi")
    _one_line_failure(r, "generate", keyed_gw.address, "refused the API key", "--api-key-file")
    r = _ddtree("generate", "--gateway", keyed_gw.address, "--prompt", "hi", "--api-key-file", str(tmp_path / "none"))
    _one_line_failure(r, "generate", "--api-key-file", "cannot read")


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--temperature", "-1"), ("INVALID_ARGUMENT", "temperature")),
        (("--max-tokens", "100000"), ("INVALID_ARGUMENT", "max_tokens")),
        (("--budget", "1000"), ("INVALID_ARGUMENT", "budget")),
    ],
)
def test_generate_refused_by_the_gateway(gw, fake, flags, words):
    fake.reset([])
    r = _ddtree("generate", "--gateway", gw.address, "--prompt", "hi", *flags)
    _one_line_failure(r, "generate", gw.address, *words)
    assert fake.requests == []


# -- checkpoints and tokenizers --------------------------------------------------------------------------------
@pytest.fixture
def no_weights(tmp_path) -> pathlib.Path:
    d = tmp_path / "no-weights"
    d.mkdir()
    (d / "config.json").write_text((DEMO_TARGET / "config.json").read_text())
    return d


@pytest.fixture
def no_tokenizer(tmp_path) -> pathlib.Path:
    d = tmp_path / "no-tokenizer"
    d.mkdir()
    (d / "config.json").write_text((DEMO_TARGET / "config.json").read_text())
    (d / "model.safetensors").symlink_to(DEMO_TARGET / "model.safetensors")
    return d


def test_serve_a_checkpoint_without_safetensors(no_weights):
    _one_line_failure(_ddtree("serve", "--model", str(no_weights), "--no-drafter"), "serve", "no weights")


def test_verifier_a_checkpoint_without_safetensors(no_weights):
    r = _ddtree("verifier", "--model", str(no_weights), "--port", "0")
    _one_line_failure(r, "verifier", str(no_weights), "no weights")


def test_serve_a_checkpoint_without_a_tokenizer(no_tokenizer):
    r = _ddtree("serve", "--model", str(no_tokenizer), "--no-drafter")
    _one_line_failure(r, "serve", "no tokenizer", "--tokenizer")


def test_gateway_without_a_tokenizer(no_weights):
    r = _ddtree("gateway", "--tokenizer", str(no_weights), "--verifier", "127.0.0.1:1", "--port", "0")
    _one_line_failure(r, "gateway", str(no_weights), "no tokenizer")


def test_serve_a_model_that_is_not_there(tmp_path):
    r = _ddtree("serve", "--model", "not-here", "--no-drafter", cwd=tmp_path)
    _one_line_failure(r, "serve", "--model not-here", "no such directory")


# -- what works --------------------------------------------------------------------------------------------------
def test_version():
    r = _ddtree("--version")
    assert r.returncode == 0 and r.stdout.startswith("ddtree ") and len(r.stdout.split()) == 2


def test_serve_help_names_the_http_api_and_its_port_variable():
    r = _ddtree("serve", "--help")
    text = " ".join(r.stdout.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert r.returncode == 0
    for words in ("OpenAI-compatible HTTP API", "/v1/chat/completions", "DDTREE_HTTP_PORT", "--gateway-args"):
        assert words in text, words


def test_relative_dirs_and_gateway_flags_reach_the_children(monkeypatch, tmp_path):
    """serve's directories are absolute before the children (which run in the repository's directory) get
    them; --tokenizer and --gateway-args go to the gateway."""
    from ddtree import cli, launcher

    seen = {}
    monkeypatch.setattr(launcher, "start_stack", lambda model, drafter, log_dir, **kw: seen.update(kw, model=model))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({}))
    target = tmp_path / "ckpt" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_text("")
    monkeypatch.chdir(tmp_path / "ckpt")
    args = cli.build_parser().parse_args(
        ["serve", "--model", "target", "--no-drafter", "--tokenizer", "../tok", "--gateway-args", "--http-port 8123"]
    )
    cli._start_stack(args, tmp_path / "logs")
    assert seen["model"] == str(target)
    assert seen["gateway_args"] == ("--tokenizer", str(tok), "--http-port", "8123")
