"""docker-compose.yml is checked here, since no Docker engine runs on CI machines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from cpd.config import env_var_names

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services_are_real_and_configured_with_known_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "nats" in services and "-js" in services["nats"]["command"]
    known = set(env_var_names())
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        env = svc.get("environment", {})
        keys = env.keys() if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]
        for key in keys:
            assert key in known, f"{name} sets {key}, which no setting reads"
        command = svc.get("command", [])
        if "services." in " ".join(command):
            module = next(c for c in command if c.startswith("services."))
            assert importlib.util.find_spec(f"{module}.__main__"), f"{name}: {module} missing"
