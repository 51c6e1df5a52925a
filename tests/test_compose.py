"""docker-compose.yml is checked here, since no Docker engine runs on CI machines: every
service of the system is there, runs a module this build ships, is health-checked by a
command the CLI has, and is configured only through settings the code reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from cpd.cli import build_parser
from cpd.cluster import SERVICE_ORDER
from cpd.config import env_var_names, load_settings

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def test_every_service_of_the_system_is_in_the_compose_file() -> None:
    services = _compose()["services"]
    assert "nats" in services and "-js" in services["nats"]["command"]
    modules = {next(c for c in s["command"] if c.startswith("services."))
               for s in services.values() if "services." in " ".join(s.get("command", []))}
    assert modules == {f"services.{name}" for name in SERVICE_ORDER}


def test_commands_health_checks_and_settings_are_real() -> None:
    compose = _compose()
    known = set(env_var_names())
    cli = build_parser()
    node_ids = []
    for name, svc in compose["services"].items():
        assert "healthcheck" in svc, f"{name} has no health check"
        env = _env(svc)
        for key in env:
            assert key in known, f"{name} sets {key}, which no setting reads"
        # The values must validate too (types, ranges), as the service would load them.
        load_settings(environ={k: str(v) for k, v in env.items()})
        command = svc.get("command", [])
        if "services." in " ".join(command):
            module = next(c for c in command if c.startswith("services."))
            assert importlib.util.find_spec(f"{module}.__main__"), f"{name}: {module} missing"
            assert svc["build"]["dockerfile"] == "Dockerfile"
            assert (ROOT / svc["build"]["context"] / "Dockerfile").exists()
            node_ids.append(env["CPD_NODE__NODE_ID"])
            test = svc["healthcheck"]["test"]
            assert test[:2] == ["CMD", "cpd"], f"{name}: health check is not a cpd command"
            args = cli.parse_args(test[2:])
            assert args.func.__name__ == "cmd_health" and args.service == name
    assert len(node_ids) == len(set(node_ids)), "node ids must be unique"


def test_workers_get_shared_memory_and_a_reachable_data_plane_address() -> None:
    services = _compose()["services"]
    for role in ("preprefill", "prefill", "decode"):
        svc = services[role]
        assert svc["shm_size"] and "SYS_PTRACE" in svc["cap_add"]
        assert _env(svc)["CPD_DATAPLANE__ADVERTISE_HOST"] == role  # its compose DNS name
