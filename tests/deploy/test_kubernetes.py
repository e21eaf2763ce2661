"""docker/kubernetes: a kustomize base and two overlays (demo on CPUs, Kimi K2.6 on 8-GPU nodes), rendered
here by a small renderer of the kustomization fields they use (kustomize is not installed: resources,
labels, images, replicas, strategic-merge patches) and validated against the Kubernetes API schemas
(`kubernetes-validate --strict`, in the test extra). Then read as the services would: every container's
command and DDTREE_* variables are ones the service accepts, probes call the gRPC health of the port the
service binds, the verifier on an 8-GPU node has its GPUs, /dev/shm and a long start-up probe, the demo's
drafter scales apart, Kimi's drafter runs at TP 8 in the verifier's pod on the same GPUs (a container with no
GPU request that sees them through NVIDIA_VISIBLE_DEVICES, one PID namespace, one /dev/shm), secrets and
checkpoints come from a Secret and a PersistentVolumeClaim, and the Kimi pod's settings, verifier and
drafter, fit the memory plan of 96 GB cards.
"""

from __future__ import annotations

import copy
import pathlib
import shutil
import subprocess

import pytest
import yaml

from ddtree.cli import build_parser
from ddtree.config import DrafterConfig, GatewayConfig, VerifierConfig, config_from_flags, env_var_names
from ddtree.tools.gpu_plan import deployment_plan
from tests.support.paths import REPO

KUBE = REPO / "docker" / "kubernetes"
OVERLAYS = ("demo-cpu", "kimi-k26")
CONFIGS = {"drafter": DrafterConfig, "verifier": VerifierConfig, "gateway": GatewayConfig}
GRPC_SERVICES = {"drafter": "ddtree.v1.Drafter", "verifier": "ddtree.v1.Verifier", "gateway": "ddtree.v1.Gateway"}
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath", "ports": "name"}


def _merge(base, patch, field: str = ""):
    """Strategic merge as kustomize applies it to the fields used here: maps merge; lists of maps with a
    merge key (MERGE_KEYS) merge by it; other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        out = [copy.deepcopy(b) for b in base]
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = _merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def render(root: pathlib.Path) -> list[dict]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "resources", "labels", "images", "replicas", "patches"}, set(k)
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (root / res).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for label in k.get("labels", []):
        for d in docs:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for patch in k.get("patches", []):
        (p,) = [d for d in yaml.safe_load_all((root / patch["path"]).read_text()) if d]
        at = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"])]
        assert len(at) == 1, f"{patch['path']}: patches {p['kind']}/{p['metadata']['name']}, found {len(at)}"
        docs[at[0]] = _merge(docs[at[0]], p)
    for r in k.get("replicas", []):
        (d,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == r["name"]]
        d["spec"]["replicas"] = r["count"]
    for image in k.get("images", []):
        for d in docs:
            for c in _pod(d).get("containers", []) if d["kind"] == "Deployment" else []:
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _pod(d: dict) -> dict:
    return d["spec"]["template"]["spec"]


def _by(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _env(container) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(KUBE / "overlays" / request.param)


def test_manifests_validate_strictly(overlay, tmp_path):
    name, docs = overlay
    validator = shutil.which("kubernetes-validate")
    if validator is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate, in the test extra)")
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"{i:02d}-{d['kind']}-{d['metadata']['name']}.yaml")
        files[-1].write_text(yaml.safe_dump(d))
    result = subprocess.run([validator, "--strict", "--quiet", *map(str, files)], capture_output=True, text=True)
    assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr}"
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PersistentVolumeClaim"}


def test_services_commands_env_probes_secrets_and_checkpoints(overlay):
    name, docs = overlay
    deployments, services = _by(docs, "Deployment"), _by(docs, "Service")
    assert set(deployments) == set(CONFIGS) and set(services) == set(CONFIGS)
    claims = set(_by(docs, "PersistentVolumeClaim"))
    parser = build_parser()
    pods = [(svc, deployments[svc], c) for svc in CONFIGS for c in _pod(deployments[svc])["containers"]]
    assert sorted(c["name"] for _, _, c in pods) == sorted([*CONFIGS, *(["drafter"] if name == "kimi-k26" else [])])
    for owner, deployment, c in pods:
        svc, cls, pod = c["name"], CONFIGS[c["name"]], _pod(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        parser.parse_args(c["args"])
        assert c["args"] == [svc]
        env = _env(c)
        known = {*env_var_names(cls), *(["NVIDIA_VISIBLE_DEVICES"] if owner != svc else [])}
        assert set(env) <= known, f"{name} {svc}: unknown {set(env) - known}"
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        config_from_flags(cls, None, environ=env)  # every value parses and validates
        assert env["DDTREE_SERVICE_TOKEN_FILE"].startswith("/secrets/")
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["secrets"]["secret"]["secretName"] == "ddtree-secrets"
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] in claims
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["checkpoints"]["mountPath"] == "/checkpoints" and mounts["checkpoints"]["readOnly"] is True
        paths = [v for k, v in env.items() if k in ("DDTREE_MODEL", "DDTREE_TARGET", "DDTREE_TOKENIZER")]
        assert paths and all(p.startswith("/checkpoints/") for p in paths), paths
        for probe in ("readinessProbe", "startupProbe") if svc != "gateway" else ("readinessProbe",):
            args = parser.parse_args(c[probe]["exec"]["command"][1:])
            assert c[probe]["exec"]["command"][:2] == ["ddtree", "health"]
            assert args.service == GRPC_SERVICES[svc] and args.address == f"127.0.0.1:{env['DDTREE_PORT']}"
        labels = deployments[svc]["spec"]["template"]["metadata"]["labels"]
        assert services[svc]["spec"]["selector"].items() <= labels.items()
        assert any(p["port"] == int(env["DDTREE_PORT"]) for p in services[svc]["spec"]["ports"])
    assert _env(_pod(deployments["gateway"])["containers"][0])["DDTREE_API_KEY_FILE"] == "/secrets/api-keys"
    assert services["drafter"]["spec"]["clusterIP"] == "None"
    dials = _env(_pod(deployments["verifier"])["containers"][0])["DDTREE_DRAFTER"]
    if name == "kimi-k26":  # the drafter in the verifier's pod; drafters of their own at 0 replicas
        assert dials == "127.0.0.1:50061" and deployments["drafter"]["spec"]["replicas"] == 0
    else:  # the verifier dials every drafter replica: a headless Service, one DNS record per ready pod
        assert dials == "drafter:50061" and deployments["drafter"]["spec"]["replicas"] >= 2  # scaled apart


def test_kimi_overlay_verifier_node_and_drafters():
    docs = render(KUBE / "overlays" / "kimi-k26")
    deployments = _by(docs, "Deployment")
    pod = _pod(deployments["verifier"])
    c, beside = pod["containers"]
    assert c["name"] == "verifier" and beside["name"] == "drafter"
    assert c["image"] == "ddtree-engine:cuda" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = _env(c)
    assert env["DDTREE_TP"] == "8" and env["DDTREE_DEVICE"] == "cuda"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi")) >= 8
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == deployments["verifier"]["spec"]["selector"]["matchLabels"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # reading 594 GB
    drafter = _pod(deployments["drafter"])["containers"][0]
    assert drafter["resources"]["limits"]["nvidia.com/gpu"] == 1 and drafter["image"] == "ddtree-engine:cuda"
    # the drafter beside it: no GPU of its own to ask for, the node's 8 seen, one PID namespace and /dev/shm
    d_env = _env(beside)
    assert beside["image"] == "ddtree-engine:cuda" and "nvidia.com/gpu" not in beside["resources"].get("limits", {})
    assert d_env.pop("NVIDIA_VISIBLE_DEVICES") == "all" and d_env["DDTREE_TP"] == env["DDTREE_TP"]
    assert pod["shareProcessNamespace"] is True and any(m["name"] == "dshm" for m in beside["volumeMounts"])
    # every GPU holds a verifier rank and a drafter rank: the plan on 96 GB cards fits
    verifier = config_from_flags(VerifierConfig, None, environ=env)
    drafter_cfg = config_from_flags(DrafterConfig, None, environ=d_env)
    plan = deployment_plan(
        str(REPO / "docs" / "kimi_k26_config.json"),
        96,
        verifier,
        drafter_cfg,
        REPO / "docs" / "kimi_k26_dflash_config.json",
    )
    assert plan.fits and len(plan.gpus) == 8 and verifier.max_context <= plan.kv_tokens <= plan.largest_kv_tokens
    assert all({i.owner for i in g.items} == {f"verifier rank {g.index}", f"drafter rank {g.index}"} for g in plan.gpus)


def test_renderer_merges_as_kustomize():
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p"]}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["q"]}]}}
    got = _merge(base, patch)
    assert got["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]
    assert got["spec"]["containers"][0]["args"] == ["q"]
