"""docker-compose.yml against the code (tests/test_compose_run.py also starts it): every
service of the system is there, runs a service ``cpd serve`` has from the image target
that ships it, is health-checked by a command the CLI has, is configured only through
settings the code reads, and connects to NATS as its own identity whose secrets and
permissions ``cpd secure init`` generates."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from cpd.ops import security
from cpd.ops.config import env_var_names, load_settings
from cpd.protocol import subjects
from tools.cli import SERVE_CHOICES, build_parser, main
from tools.images import STAGES, TARGETS
from tools.supervisor import SERVICE_ORDER

ROOT = Path(__file__).resolve().parent.parent
# The compose file runs each service in a container of its own: the front end, which
# hosts three of them in one process (what `cpd up` runs), is not one of its services.
COMPOSED = set(SERVICE_ORDER) - {"frontend"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def _served(svc: dict) -> str:
    """The service a compose service runs with ``cpd serve``, or ``""``."""
    command = svc.get("command", [])
    return command[2] if command[:2] == ["cpd", "serve"] else ""


def test_every_service_of_the_system_is_in_the_compose_file() -> None:
    services = _compose()["services"]
    assert services["nats"]["command"][:2] == ["nats-server", "-c"]
    assert services["nats"]["image"] == "cpd-control:latest"
    served = {_served(s) for s in services.values()} - {""}
    assert served == COMPOSED and served <= set(SERVE_CHOICES)


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
        if service := _served(svc):
            worker = service not in ("kvindex", "router", "gateway")
            image = "worker-cpu" if worker else "control"
            stage, extra = STAGES[image]  # what `cpd images build` builds under that tag
            assert svc["image"] == TARGETS[image] and svc["build"]["target"] == stage
            assert svc["build"].get("args", {}).get("EXTRA", "") == extra
            assert svc["build"]["dockerfile"] == "Dockerfile"
            dockerfile = (ROOT / svc["build"]["context"] / "Dockerfile").read_text()
            assert f" AS {stage}\n" in dockerfile
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
        settings = load_settings(environ=_env(svc))
        assert int(svc["shm_size"].removesuffix("gb")) << 30 > settings.dataplane.arena_bytes
        assert settings.dataplane.advertise_host == role  # its compose DNS name
        # Containers do not share /dev/shm: UCX must not try shared memory between them.
        assert settings.dataplane.ucx_tls == "tcp"


def _mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """``container path -> (host path, read-only)`` of a service's volumes."""
    out = {}
    for v in svc.get("volumes", []):
        host, target, *mode = v.split(":")
        out[target] = (host, mode == ["ro"])
    return out


def test_every_service_connects_as_its_own_identity_with_the_generated_secrets(
        tmp_path: Path) -> None:
    """The compose file and ``cpd secure init``'s defaults line up: the NATS container
    mounts the generated server folder where the config expects it and stores JetStream
    on its volume; every CPD service mounts only its own identity folder, read-only, and
    its environment is exactly that identity's (nkey, CA, inbox prefix), whose kind has
    permissions in the generated config."""
    compose = _compose()
    services = compose["services"]
    defaults = build_parser().parse_args(["secure", "init", str(tmp_path / "s")])
    assert main(["secure", "init", str(tmp_path / "s")]) == 0
    secrets = tmp_path / "s"
    manifest = {x["name"]: x for x in json.loads((secrets / security.MANIFEST).read_text())[
        "identities"]}
    config = (secrets / security.SERVER_DIR / security.CONFIG_FILE).read_text()

    nats = services["nats"]
    conf_path = nats["command"][2]
    mounts = _mounts(nats)
    assert mounts[defaults.server_mount] == (f"./secrets/{security.SERVER_DIR}", True)
    assert conf_path == f"{defaults.server_mount}/{security.CONFIG_FILE}"
    assert mounts[defaults.store_dir][0] == "nats-data"  # JetStream survives restarts
    assert f'store_dir: "{defaults.store_dir}"' in config
    assert f'cert_file: "{defaults.server_mount}/{security.SERVER_CERT}"' in config
    port = defaults.listen.rsplit(":", 1)[1]
    assert any(p.endswith(f":{port}") for p in nats["ports"])
    http_port = defaults.http.rsplit(":", 1)[1]
    assert f":{http_port}/healthz" in " ".join(nats["healthcheck"]["test"])
    assert all(f":{http_port}" not in p for p in nats["ports"])  # monitoring stays inside

    seen = set()
    for name, svc in services.items():
        if not _served(svc):
            continue
        env = _env(svc)
        node = env["CPD_NODE__NODE_ID"]
        ident = security.Identity(node, name, node)
        assert manifest[node]["kind"] == name, f"{name}: no {node} identity of kind {name}"
        assert manifest[node]["nkey"] in config and manifest[node]["password_hash"] in config
        # One mount, read-only, of its own folder only (not the whole secrets dir).
        own = [(t, h) for t, (h, ro) in _mounts(svc).items() if h.startswith("./secrets")]
        assert len(own) == 1 and own[0][1] == f"./secrets/{node}", (name, own)
        target = own[0][0]
        assert _mounts(svc)[target][1], f"{name}: secrets must be mounted read-only"
        expected = security.identity_env(ident, target, mtls=False)
        nats_env = {k: v for k, v in env.items() if k.startswith("CPD_NATS__")
                    and k != "CPD_NATS__SERVERS"}
        assert nats_env == expected, name
        for var in ("CPD_NATS__NKEY_SEED_FILE", "CPD_NATS__TLS_CA_FILE"):
            generated = secrets / node / Path(env[var]).relative_to(target)
            assert generated.exists(), f"{name}: {env[var]} is not generated"
        # TLS: the URL's host is a name in the server certificate.
        assert env["CPD_NATS__SERVERS"].split("//")[1].split(":")[0] in security.DEFAULT_HOSTS
        seen.add(name)
    assert seen == COMPOSED
    # Every identity has permissions; a worker cannot publish client requests.
    assert config.count("permissions: {") == 2 * len(manifest)
    assert not security.allows(security.grants("prefill", "prefill-0").publish,
                               subjects.GENERATE)
