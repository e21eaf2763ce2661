"""docker/compose.yaml and the Dockerfiles, checked without a container engine.

Static: the files parse; every service command is a real `ddtree` subcommand whose flags the CLI
accepts; every DDTREE_* variable is one the service's configuration reads; health checks call the
real grpc.health.v1 endpoint of a service the process registers, on the port it binds.
Dynamic: the compose services' commands run as local processes with the same arguments and
environment, service names mapped to loopback addresses (two drafter replicas on 127.0.0.2 and
127.0.0.3), requests stream through the gateway, one drafter replica is killed mid-stream, and every
request still returns exactly the AR tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from ddtree.cli import build_parser
from ddtree.config import (
    DrafterConfig,
    GatewayConfig,
    SecurityConfig,
    VerifierConfig,
    config_from_flags,
    env_var_names,
)
from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.paths import REPO

DOCKER = REPO / "docker"
CONFIGS = {"drafter": DrafterConfig, "verifier": VerifierConfig, "gateway": GatewayConfig}
GRPC_SERVICES = {"drafter": "ddtree.v1.Drafter", "verifier": "ddtree.v1.Verifier", "gateway": "ddtree.v1.Gateway"}
DOCKERFILE_KEYWORDS = {
    "FROM",
    "ARG",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "USER",
    "ENV",
    "ENTRYPOINT",
    "CMD",
    "EXPOSE",
    "HEALTHCHECK",
    "LABEL",
    "VOLUME",
    "SHELL",
    "STOPSIGNAL",
}


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _substitute(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} / ${VAR} interpolation."""

    def repl(m):
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{([A-Z0-9_]+)(:-([^}]*))?\}", repl, value)


def _dockerfile(name: str) -> list[tuple[str, str]]:
    lines, buf = [], ""
    for raw in (DOCKER / name).read_text().splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            keyword, _, rest = buf.strip().partition(" ")
            lines.append((keyword, rest))
            buf = ""
    return lines


def _entrypoint(service: dict) -> list[str]:
    name = service["build"]["dockerfile"].split("/")[-1]
    entry = next(rest for kw, rest in _dockerfile(name) if kw == "ENTRYPOINT")
    return yaml.safe_load(entry)


def _argv(name: str, service: dict) -> list[str]:
    entry = _entrypoint(service)
    assert entry[0] == "ddtree", f"{name}: entrypoint {entry} does not run the ddtree command"
    command = service.get("command", [])
    return entry[1:] + [c for c in command if c not in entry[1:]]


@pytest.mark.parametrize("name", ["Dockerfile.engine", "Dockerfile.gateway"])
def test_dockerfiles_parse(name):
    lines = _dockerfile(name)
    keywords = [kw for kw, _ in lines]
    assert set(keywords) <= DOCKERFILE_KEYWORDS, set(keywords) - DOCKERFILE_KEYWORDS
    assert [kw for kw in keywords if kw != "ARG"][0] == "FROM"
    users = [rest for kw, rest in lines if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    for kw, rest in lines:
        if kw == "COPY":
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), f"{name}: COPY source {src} does not exist"


def _pip_installs(name: str) -> list[list[str]]:
    """The argument lists of every `pip install` the Dockerfile runs, ARG defaults substituted."""
    lines = _dockerfile(name)
    args = {}
    for kw, rest in lines:
        if kw == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value.strip('"')
    installs = []
    for kw, rest in lines:
        if kw != "RUN":
            continue
        for part in rest.split("&&"):
            words = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), part).split()
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
    return installs


def test_engine_image_installs_the_package_with_its_dependencies():
    """The engine runs verifier and drafter: torch, then the package with every runtime dependency
    (tests/deploy/test_runtime_install.py checks that those cover every module's imports)."""
    installs = _pip_installs("Dockerfile.engine")
    assert any(any(w.startswith("torch") for w in words) for words in installs), installs
    package = [words for words in installs if "." in words]
    assert package and "--no-deps" not in package[-1], installs


def test_gateway_image_installs_the_gateway_requirements_and_no_torch():
    installs = _pip_installs("Dockerfile.gateway")
    flat = [w for words in installs for w in words]
    assert not any(w.startswith("torch") for w in flat), installs
    reqs = [words[words.index("-r") + 1] for words in installs if "-r" in words]
    assert reqs == ["docker/requirements-gateway.txt"], installs
    copied = [rest.split()[:-1] for kw, rest in _dockerfile("Dockerfile.gateway") if kw == "COPY"]
    assert any(reqs[0] in srcs for srcs in copied), "the requirement file is not copied into the image"
    package = [words for words in installs if "." in words]
    assert package and "--no-deps" in package[-1], "the package's own dependencies would pull torch"


def test_compose_serves_the_demo_checkpoint_by_default():
    """With no settings, every service's model path is inside the default /checkpoints mount and exists."""
    services = _compose()["services"]
    mounts = {}
    for name in ("drafter", "verifier", "gateway"):
        for volume in services[name]["volumes"]:
            src, _, rest = _substitute(volume, {}).partition(":")
            mounts[rest.split(":")[0]] = (DOCKER / src).resolve()
    assert set(mounts) >= {"/checkpoints"}
    paths = {
        name: {
            k: _substitute(str(v), {})
            for k, v in services[name]["environment"].items()
            if k in ("DDTREE_MODEL", "DDTREE_TARGET", "DDTREE_TOKENIZER")
        }
        for name in ("drafter", "verifier", "gateway")
    }
    for name, env in paths.items():
        assert env, f"{name}: no model path set"
        for key, value in env.items():
            assert value.startswith("/checkpoints/demo/"), f"{name} {key}={value!r}: not the demo pair"
            host = mounts["/checkpoints"] / value.removeprefix("/checkpoints/")
            assert (host / "config.json").is_file(), f"{name} {key}: {host} has no config.json"
    assert (mounts["/checkpoints"] / "demo" / "target" / "tokenizer.json").is_file()


def test_compose_services_commands_env_and_health():
    compose = _compose()
    services = compose["services"]
    assert {"gateway", "verifier", "drafter"} <= set(services)
    published = [n for n, s in services.items() if s.get("ports")]
    assert set(published) <= {"gateway", "grafana"}, f"only the gateway (and the dashboard) publish ports: {published}"
    assert "internal" in services["drafter"]["networks"] and "public" not in services["drafter"]["networks"]
    assert compose["networks"]["internal"]["internal"] is True
    parser = build_parser()
    for name, cls in CONFIGS.items():
        svc = services[name]
        argv = _argv(name, svc)
        assert argv[0] == name
        env = {k: _substitute(str(v), {}) for k, v in svc["environment"].items()}
        unknown = set(env) - set(env_var_names(cls))
        assert not unknown, f"{name}: DDTREE variables the configuration does not read: {unknown}"
        parser.parse_args(argv)  # SystemExit on an unknown flag or subcommand
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:3] == ["ddtree", "health"]
        args = parser.parse_args(test[2:])
        assert args.service == GRPC_SERVICES[name]
        assert args.address.endswith(":" + env["DDTREE_PORT"]), "health check must call the port the service binds"
    assert services["verifier"]["depends_on"]["drafter"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    gpu = services["verifier"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    example = dict(
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    compose_vars = set(re.findall(r"\$\{([A-Z0-9_]+)", (DOCKER / "compose.yaml").read_text()))
    assert compose_vars <= set(example), f"variables missing from .env.example: {compose_vars - set(example)}"


def test_observability_files():
    compose = _compose()
    prom = yaml.safe_load((DOCKER / "observability" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for name in ("drafter", "verifier", "gateway"):
        port = int(compose["services"][name]["environment"]["DDTREE_METRICS_PORT"])
        assert jobs[name]["dns_sd_configs"][0]["port"] == port
    import json

    from ddtree.drafter import metrics as drafter_metrics
    from ddtree.gateway import metrics as gateway_metrics
    from ddtree.verifier import metrics as verifier_metrics

    dash = json.loads((DOCKER / "observability" / "grafana" / "dashboards" / "ddtree.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in (
        "ddtree_accept_length",
        "ddtree_step_seconds",
        "ddtree_generated_tokens_total",
        "ddtree_context_tokens",
        "ddtree_queued_requests",
        # gateway panels
        "ddtree_gateway_requests_total",
        "ddtree_gateway_time_to_first_token_seconds",
        "ddtree_gateway_request_seconds",
        "ddtree_gateway_verifier_healthy",
        # drafter panels
        "ddtree_drafter_calls_total",
        "ddtree_drafter_draft_seconds",
        "ddtree_drafter_sequences",
        "ddtree_drafter_context_bytes",
    ):
        assert metric in exprs, f"dashboard has no panel on {metric}"
    # Every series a panel reads is one a service exports (names as scraped), scoped to the instance variable.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {
        family.name + suffix
        for module in (verifier_metrics, drafter_metrics, gateway_metrics)
        for family in module.REGISTRY.collect()
        for suffix in suffixes.get(family.type, ("",))
    }
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name, labels in re.findall(r"\b(ddtree_[a-z_]+)(\{[^}]*\})?", target["expr"]):
                assert name in exported, f"panel {panel['title']!r} reads {name}, which no service exports"
                assert 'instance=~"$instance"' in labels, f"panel {panel['title']!r}: {name} ignores $instance"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["instance"]["definition"] == "label_values(up, instance)"


def _free_port(*hosts: str) -> int:
    while True:
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue


def _start(argv, env, log_path):
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "ddtree.cli", *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
    )


def _wait_healthy(healthcheck, mapping, env, timeout=180):
    argv = [mapping(a) for a in healthcheck[2:]]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            subprocess.run(
                [sys.executable, "-m", "ddtree.cli", *argv], capture_output=True, env=env, cwd=REPO
            ).returncode
            == 0
        ):
            return
        time.sleep(1)
    raise AssertionError(f"never healthy: {argv}")


def _make_service_token(svc: dict, directory: pathlib.Path) -> pathlib.Path:
    """Run the service-token one-shot's command with its /secrets volume at `directory`."""
    assert svc["entrypoint"] == ["python", "-c"]
    directory.mkdir(exist_ok=True)
    code = svc["command"][0].replace("'/secrets/", f"'{directory}/")
    subprocess.run([sys.executable, "-c", code], check=True)
    return directory / "service-token"


def test_compose_engines_share_a_generated_service_token(tmp_path):
    """Issue 47: no engine is open on the internal network. A one-shot generates the token once into a
    volume; drafter, verifier and gateway read it, and start after it."""
    services = _compose()["services"]
    token = _make_service_token(services["service-token"], tmp_path)
    first = token.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and token.stat().st_mode & 0o777 == 0o600
    _make_service_token(services["service-token"], tmp_path)
    assert token.read_text() == first, "a restart of the stack must keep the token"
    assert services["service-token"].get("network_mode") == "none"
    for name in ("drafter", "verifier", "gateway"):
        svc = services[name]
        assert svc["environment"]["DDTREE_SERVICE_TOKEN_FILE"] == "/secrets/service-token"
        assert "ddtree-secrets:/secrets:ro" in svc["volumes"]
        assert svc["depends_on"]["service-token"]["condition"] == "service_completed_successfully"


@pytest.mark.slow
def test_compose_commands_as_processes_with_two_drafters(default_ckpt, tmp_path):
    services = _compose()["services"]
    secrets = tmp_path / "secrets"
    _make_service_token(services["service-token"], secrets)
    hosts = {"drafter": ["127.0.0.2", "127.0.0.3"], "verifier": ["127.0.0.1"], "gateway": ["127.0.0.1"]}
    ports = {}
    for name in ("drafter", "verifier", "gateway"):
        env = services[name]["environment"]
        for key in ("DDTREE_PORT", "DDTREE_METRICS_PORT", "DDTREE_HTTP_PORT"):
            if key in env:
                ports[env[key]] = str(_free_port(*hosts[name]))

    def map_address(value: str) -> str:
        # "drafter:50061" -> every replica's loopback address; fixed ports -> free ports
        m = re.fullmatch(r"([a-z]+):(\d+)", value)
        if m and m.group(1) in hosts:
            return ",".join(f"{h}:{ports.get(m.group(2), m.group(2))}" for h in hosts[m.group(1)])
        if value.startswith("/checkpoints/"):  # the default mount: the repository's checkpoints/
            return str(REPO / "checkpoints" / value.removeprefix("/checkpoints/"))
        if value.startswith("/secrets/"):  # the volume service-token fills: here, that command run on tmp_path
            return str(secrets / value.removeprefix("/secrets/"))
        m = re.fullmatch(r"127\.0\.0\.1:(\d+)", value)
        if m:
            return f"127.0.0.1:{ports.get(m.group(1), m.group(1))}"
        return ports.get(value, value)

    base_env = {**os.environ, "DDTREE_HOME": str(default_ckpt.root.parent), "DDTREE_THREADS": "1"}
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for name in ("drafter", "verifier", "gateway"):
            svc = services[name]
            for i, host in enumerate(hosts[name]):
                env = {k: map_address(_substitute(str(v), {})) for k, v in svc["environment"].items()}
                env = {k: v for k, v in env.items() if v != ""}
                env["DDTREE_HOST"] = host
                procs.setdefault(name, []).append(
                    _start(_argv(name, svc), {**base_env, **env}, tmp_path / f"{name}{i}.log")
                )
            for host in hosts[name]:
                # inside its container the check calls 127.0.0.1; here that is the replica's address
                _wait_healthy(
                    svc["healthcheck"]["test"],
                    lambda a, h=host: map_address(a).replace("127.0.0.1:", f"{h}:"),
                    base_env,
                )
        gateway = f"127.0.0.1:{ports[services['gateway']['environment']['DDTREE_PORT']]}"
        prompts = ["def parse(", "class Stack:", "import json\n", "The river", "for i in range(", "Hello"]

        def run(prompt, no_spec, kill=False):
            opts = gateway_pb2.GenerationOptions(max_tokens=40, ignore_eos=True, no_spec=no_spec, budget=8)
            ids = []
            with grpc.insecure_channel(gateway) as ch:
                stream = gateway_pb2_grpc.GatewayStub(ch).Complete(
                    gateway_pb2.CompleteRequest(prompt=prompt, options=opts), timeout=300
                )
                for n, chunk in enumerate(stream):
                    ids.extend(chunk.token_ids)
                    if kill and n == 3:
                        procs["drafter"][0].kill()
            return ids

        ar = [run(p, True) for p in prompts]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futs = [pool.submit(run, p, False, i == 0) for i, p in enumerate(prompts)]
            spec = [f.result() for f in futs]
        assert procs["drafter"][0].poll() is not None, "the replica was not killed"
        assert spec == ar, "a token changed when a drafter replica was lost"
    finally:
        for plist in procs.values():
            for p in plist:
                p.terminate()
        for plist in procs.values():
            for p in plist:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.mark.parametrize("env_file", ["kimi-k26.env", "kimi-k26-141gb.env"])
def test_kimi_k26_override_and_env_file(env_file):
    """The K2.6 example: the override merges onto real services, every variable of the env file (96 GB and
    141 GB cards) is one the compose file uses, and the engine settings it yields are ones the services
    accept (TP 8, KV by tokens or GB, the drafter at TP 8 on the 96 GB cards' GPUs; test_memory_plan.py checks
    that they fit)."""
    override = yaml.safe_load((DOCKER / "compose.kimi-k26.yaml").read_text())
    base = _compose()
    assert set(override["services"]) <= set(base["services"])
    assert override["services"]["verifier"]["ipc"] == "host"
    env = dict(
        line.split("=", 1) for line in (DOCKER / env_file).read_text().splitlines() if line and not line.startswith("#")
    )
    example = dict(
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(env) == set(example), set(env) ^ set(example)
    parser = build_parser()
    for name in ("drafter", "verifier"):
        svc = base["services"][name]
        resolved = {k: _substitute(str(v), env) for k, v in svc["environment"].items()}
        parser.parse_args(_argv(name, svc))
        config = config_from_flags(CONFIGS[name], None, environ=resolved)  # parses and validates every variable
        if name == "verifier":
            assert config.tp == 8 and (config.kv_memory_gb > 0) != (config.kv_tokens > 0) and config.device == "cuda"
        else:  # 96 GB: the drafter's 8 ranks beside the verifier's; 141 GB: whole on GPU 0
            assert config.device == "cuda" and config.dtype == "bfloat16"
            assert config.tp == (8 if env_file == "kimi-k26.env" else 1)
        gpus = svc["deploy"]["resources"]["reservations"]["devices"][0]["count"]
        assert _substitute(str(gpus), env) == str(8 if name == "verifier" else config.tp)


def test_mtls_override():
    """compose.mtls.yaml: every service mounts the certificates and names its own; the variables are
    ones the configuration reads and together make a valid mutual-TLS setting; the engines' health
    checks dial TLS through those variables while the gateway's (its plaintext public port) turns
    them off with empty flags."""
    override = yaml.safe_load((DOCKER / "compose.mtls.yaml").read_text())["services"]
    parser = build_parser()
    for name, cls in CONFIGS.items():
        svc = override[name]
        assert any(v.endswith(":/certs:ro") for v in svc["volumes"]), f"{name}: certificates not mounted read-only"
        env = svc["environment"]
        assert set(env) <= set(env_var_names(cls)), f"{name}: unknown variables {set(env) - set(env_var_names(cls))}"
        assert env["DDTREE_TLS_CERT"] == f"/certs/{name}.pem" and env["DDTREE_TLS_KEY"] == f"/certs/{name}.key"
        config = config_from_flags(cls, None, environ={k: str(v) for k, v in env.items()})
        assert config.tls_ca == "/certs/ca.pem" and config.service_token_file == "/certs/service-token"
    gateway_check = override["gateway"]["healthcheck"]["test"]
    args = parser.parse_args(gateway_check[2:])
    plain = config_from_flags(SecurityConfig, args, environ={"DDTREE_TLS_CA": "/certs/ca.pem"})
    assert (plain.tls_ca, plain.tls_cert, plain.tls_key, plain.service_token_file) == ("", "", "", "")
    assert "healthcheck" not in override["verifier"] and "healthcheck" not in override["drafter"]
