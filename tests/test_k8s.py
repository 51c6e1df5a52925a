"""The Kubernetes manifests (``deploy/k8s``): both overlays render with kustomize, every
object is valid for a pinned Kubernetes version (strict schemas: no unknown field), and
what they run agrees with the code — commands, health checks, settings, ports, the NATS
cluster and its config, ``/dev/shm`` against the arena, GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cpd.ops.config import env_var_names, load_settings
from cpd.ops.natsserver import nats_server_binary
from cpd.protocol.roles import WORKER_ROLES
from tools.cli import SERVE_CHOICES

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.30.0"
OVERLAYS = ("cpu", "gpu")
# Stand-ins for values the cluster fills in (downward API).
FIELD_VALUES = {"metadata.name": "pod-0", "status.podIP": "10.1.2.3"}


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: `make test` installs it (Debian: kubernetes-client)"
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _render(request.param)


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _workloads(docs: list[dict]) -> dict[str, dict]:
    return {**_by_kind(docs, "Deployment"), **_by_kind(docs, "StatefulSet")}


def _env(docs: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the process sees it."""
    maps = _by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_every_object_is_valid_for_the_pinned_kubernetes(rendered: tuple) -> None:
    _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
            "NetworkPolicy"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_commands_probes_and_settings_match_the_code(rendered: tuple) -> None:
    overlay, docs = rendered
    known_env = set(env_var_names())
    served = {}
    for name, w in _workloads(docs).items():
        (c,) = w["spec"]["template"]["spec"]["containers"]
        if name == "nats":
            continue
        assert c["command"][:2] == ["cpd", "serve"] and c["command"][2] in SERVE_CHOICES
        service = c["command"][2]
        served[name] = service
        env = _env(docs, c)
        assert set(env) <= known_env, set(env) - known_env
        settings = load_settings(environ=env)  # every value parses as its setting
        assert settings.node.node_id == FIELD_VALUES["metadata.name"]
        probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
        assert probes, name
        for probe in probes:
            if "exec" in probe:
                assert probe["exec"]["command"] == ["cpd", "health", service]
            else:  # the gateway's own HTTP endpoints
                assert probe["httpGet"]["path"] in ("/ready", "/health")
                assert probe["httpGet"]["port"] == settings.gateway.port
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if service == "gateway":
            assert ports["http"] == settings.gateway.port and settings.gateway.host == "0.0.0.0"
            assert int(annotations["prometheus.io/port"]) == settings.gateway.port
            svc = _by_kind(docs, "Service")["gateway"]
            assert svc["spec"]["ports"][0]["targetPort"] == settings.gateway.port
        else:
            assert ports["metrics"] == settings.telemetry.prometheus_port
            assert int(annotations["prometheus.io/port"]) == settings.telemetry.prometheus_port
        if service in WORKER_ROLES:
            _check_worker(overlay, w, c, settings)
    assert sorted(served.values()) == sorted(["kvindex", "router", "gateway", *WORKER_ROLES])


def _check_worker(overlay: str, w: dict, c: dict, settings: Any) -> None:
    dp = settings.dataplane
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["ucx"] == dp.listen_port
    assert dp.advertise_host == FIELD_VALUES["status.podIP"] and dp.ucx_tls == "tcp"
    (shm,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    size = shm["emptyDir"]["sizeLimit"]
    assert shm["emptyDir"]["medium"] == "Memory" and size.endswith("Gi")
    assert int(size[:-2]) << 30 >= dp.arena_bytes + (1 << 30)  # arena + engine's own
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == 1) if overlay == "gpu" else gpus is None
    assert c["image"] == f"cpd-worker-{'cuda' if overlay == 'gpu' else 'cpu'}:latest"


def test_nats_cluster_matches_the_services_seeds_and_its_config_is_valid(
        rendered: tuple, tmp_path: Path) -> None:
    _, docs = rendered
    nats = _by_kind(docs, "StatefulSet")["nats"]
    replicas, service = nats["spec"]["replicas"], nats["spec"]["serviceName"]
    settings = load_settings(environ=_by_kind(docs, "ConfigMap")["cpd-settings"]["data"])
    assert settings.nats.servers == [f"nats://nats-{i}.{service}:4222" for i in range(replicas)]
    assert settings.kvindex.stream_replicas <= replicas
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    assert c["command"][0] == "nats-server"
    conf = tmp_path / "nats.conf"
    conf.write_text(_by_kind(docs, "ConfigMap")["nats-config"]["data"]["nats.conf"])
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True,
                           text=True, env={**os.environ, "POD_NAME": "nats-0"})
    assert check.returncode == 0, check.stderr
    text = conf.read_text()
    for i in range(replicas):
        assert f"nats-route://nats-{i}.{service}:6222" in text
    pdb = _by_kind(docs, "PodDisruptionBudget")["nats"]
    assert pdb["spec"]["maxUnavailable"] == 1  # R3 keeps a majority
