"""The ``cpd`` command: build the local model, run benchmarks, start the system."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import msgspec

from cpd.ops.config import Settings, load_settings
from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from cpd.protocol.roles import WORKER_ROLES


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, overrides=args.set or [])


def _write_json(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def cmd_model_build(args: argparse.Namespace) -> int:
    from cpd.modelbuild import build

    s = _settings(args)
    preset = args.preset or s.model.preset
    folder = build(preset, args.cache_dir or s.model_cache_dir, force=args.force)
    print(folder)
    return 0


def cmd_model_check(args: argparse.Namespace) -> int:
    from tools.bench.model import check_model

    s = _settings(args)
    _write_json(check_model(s, preset=args.preset, max_tokens=args.max_tokens), args.json)
    return 0


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark ``cpd bench NAME`` names (tools/bench/registry.py), print and
    write its JSON; exit 1 when a request failed or took another path than intended."""
    from tools.bench.registry import BENCHMARKS

    # SIGTERM (a runner's timeout, ``kill``) unwinds as Ctrl-C does, also where SIGINT is
    # ignored (a job started in the background): every task's ``finally`` runs, so the
    # clusters, engines and folders the benchmark started are removed. Only for the run
    # (a caller in the same process keeps its own handler after it).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None
    try:
        result = BENCHMARKS[args.what].run(args, lambda: _settings(args))
    finally:
        if previous is not None:  # None: not ours to set, or set outside Python
            signal.signal(signal.SIGTERM, previous)
    _write_json(result, args.json)
    if result.get("requests_failed"):
        print(f"cpd bench {args.what}: FAILED: {result['requests_failed']} requests failed",
              file=sys.stderr)
        return 1
    if result.get("path_ok") is False:  # a benchmark that measured the wrong path failed
        print(f"cpd bench {args.what}: FAILED: requests took other paths than intended",
              file=sys.stderr)
        return 1
    return 0


def cmd_nats(args: argparse.Namespace) -> int:
    from cpd.ops.natsserver import NatsServer

    s = _settings(args)
    server = NatsServer(port=args.port if args.port is not None else s.nats.embedded_port,
                        store_dir=args.store_dir or s.nats.embedded_store_dir)
    server.start()
    print(f"nats-server with JetStream at {server.url} (store {server.store_dir}); Ctrl-C stops it",
          flush=True)
    try:
        assert server.proc is not None
        return server.proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def cmd_nats_cluster(args: argparse.Namespace) -> int:
    """Write one NATS config per cluster member (JetStream, routes to every other member;
    with ``--secrets``, next to that folder's least-privilege config, which each includes)
    and print the settings the services need."""
    from cpd.ops import natscluster, security

    hosts = args.host or [f"nats-{i}" for i in range(args.size)]
    if len(hosts) != args.size:
        raise CpdError(f"--size {args.size} but {len(hosts)} --host given")
    cluster = natscluster.members(hosts)
    include, folder = "", Path(args.dir)
    if args.secrets:
        secrets_root = Path(args.secrets).expanduser()
        folder = secrets_root / security.SERVER_DIR
        if not (folder / security.CONFIG_FILE).exists():
            raise CpdError(f"{folder / security.CONFIG_FILE} does not exist: run "
                           f"`cpd secure init {args.secrets} --host ...` first")
        include = security.CONFIG_FILE
    files = natscluster.write_cluster(folder, cluster, store_dir=args.store_dir,
                                      include=include)
    for name, path in files.items():
        print(f"{name}: {path}")
    seeds = natscluster.servers_setting(cluster, scheme="tls" if include else "nats")
    print(f"services: CPD_NATS__SERVERS={seeds}")
    print(f"kvindex:  CPD_KVINDEX__STREAM_REPLICAS={min(3, len(cluster))}")
    return 0


SERVE_CHOICES = ("kvindex", "router", "gateway", "frontend", "worker", *WORKER_ROLES)
"""What ``cpd serve`` runs (``worker``: in the role of ``worker.role``)."""


def cmd_serve(args: argparse.Namespace) -> int:
    """Run one service in the foreground until SIGTERM/SIGINT, joining the NATS
    deployment ``nats.servers`` names (no embedded server)."""
    settings = _settings(args)
    if args.service == "kvindex":
        from services.kvindex import serve as serve_kvindex
        serve_kvindex(settings)
    elif args.service == "router":
        from services.router import serve as serve_router
        serve_router(settings)
    elif args.service == "gateway":
        from services.gateway import serve as serve_gateway
        serve_gateway(settings)
    elif args.service == "frontend":
        from services.frontend import serve as serve_frontend
        serve_frontend(settings)
    else:
        from services.worker import run_worker
        run_worker("" if args.service == "worker" else args.service, settings)
    return 0


def cmd_images_build(args: argparse.Namespace) -> int:
    """Build the container images with podman (docs/deploy.md, "Containers")."""
    from tools.images import TARGETS, build

    took = build(args.target or ["control", "worker-cpu"], base=args.base or "")
    for target, seconds in took.items():
        print(f"{TARGETS[target]}: built in {seconds:.0f} s")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio

    from cpd.client import Client

    s = _settings(args)
    prompt: str | list[int] = (args.prompt if args.token_ids is None
                               else [int(t) for t in args.token_ids.split(",") if t.strip()])

    async def go() -> int:
        async with await Client.connect(settings=s, name="cpd-cli") as client:
            options = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                           seed=args.seed, ignore_eos=args.ignore_eos, tenant=args.tenant,
                           timeout_s=args.timeout)
            final = None
            ids: list[int] = []
            async for msg in client.stream(prompt, **options):
                if isinstance(msg, wire.TokenChunk):
                    ids.extend(msg.token_ids)
                    if not args.json:
                        print(msg.text, end="", flush=True)
                else:
                    final = msg
            assert final is not None
            if args.json:
                print(json.dumps({"token_ids": ids, **msgspec.to_builtins(final)}, indent=2))
            else:
                r, t = final.route, final.timings
                print(f"\n\n[{final.finish_reason}] {final.usage.prompt_tokens} prompt tokens "
                      f"({final.usage.cached_tokens} cached), {len(ids)} generated; "
                      f"path {r.path} via {r.prefill_node} -> {r.decode_node} "
                      f"({r.describe()}); "
                      f"TTFT {t.ttft_ms:.0f} ms, total {t.total_ms:.0f} ms", file=sys.stderr)
            return 0

    return asyncio.run(go())


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    from cpd.client import Client

    s = _settings(args)

    async def go() -> wire.StatusReply:
        async with await Client.connect(settings=s, name="cpd-cli") as client:
            return await client.status()

    status = asyncio.run(go())
    if args.json:
        print(json.dumps(msgspec.to_builtins(status), indent=2, sort_keys=True))
        return 0
    print(format_status(status))
    return 0


def format_status(status: wire.StatusReply) -> str:
    """``cpd status`` as a table: nodes, roles, queues, cache use, then hit ratios."""
    r = status.router
    lines = [f"router {r.node} (policy {r.policy}): {r.in_flight}/{r.max_inflight} in flight, "
             f"{r.queued} queued; {r.completed} done, {r.failed} failed, {r.rejected} "
             f"rejected, {r.failovers} failovers, {r.resumed} resumed; kvindex "
             f"{status.kvindex} ({r.lookup_misses} decisions without its answer); "
             f"{r.decode_lent} decodes kept on their prefill node",
             f"{'node':<16} {'role':<10} {'alive':<5} {'queue':>6} {'queued tok':>10} "
             f"{'est ms':>8} {'running':>7} {'DRAM used':>16} {'GB/s':>6} "
             f"{'disk used':>16} {'read GB/s':>9}"]
    for n in status.nodes:
        dram = (f"{n.dram_used_bytes / 2**20:.0f}/{n.dram_total_bytes / 2**20:.0f} MiB"
                if n.dram_total_bytes else "-")
        disk = (f"{n.disk_used_bytes / 2**30:.1f}/{n.disk_total_bytes / 2**30:.1f} GiB"
                if n.disk_total_bytes else "-")
        role = f"{n.role}+d" if n.decodes else n.role
        lines.append(f"{n.node:<16} {role:<10} {'yes' if n.alive else 'NO':<5} "
                     f"{n.queue_depth:>6} {n.queued_new_tokens:>10} {n.est_queue_ms:>8.0f} "
                     f"{n.in_flight:>7} {dram:>16} {n.kv_bandwidth_gbps:>6.2f} "
                     f"{disk:>16} {n.disk_read_gbps:>9.2f}")
    total = max(1, r.prompt_tokens)
    lines.append("prompt tokens by source: " + ", ".join(
        f"{source.value} {count / total:.1%}"
        for source, count in r.tokens.by_source().items())
        + f" of {r.prompt_tokens}; paths " + (", ".join(
            f"{k} {v}" for k, v in sorted(r.paths.items())) or "none yet"))
    return "\n".join(lines)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when ``service`` (this node's, by default) answers a NATS micro PING: the
    containers' health check."""
    import asyncio

    from tools.cluster import wait_ready

    s = _settings(args)
    node = args.node or s.node.node_id
    try:
        asyncio.run(asyncio.wait_for(wait_ready(None, args.service, node, args.timeout,
                                                s.nats), args.timeout + 2))
    except (CpdError, OSError, TimeoutError) as e:
        print(f"cpd: {args.service} ({node}) is not healthy: {e!r}", file=sys.stderr)
        return 1
    print(f"{args.service} ({node}) is up")
    return 0


def cmd_vllm(args: argparse.Namespace) -> int:
    from tools.vllmcli import main as vllm_main

    return vllm_main(args.args)


def cmd_up(args: argparse.Namespace) -> int:
    from tools.supervisor import run_cluster

    counts = {}
    for item in args.count or []:
        name, _, n = item.partition("=")
        counts[name] = int(n)
    # Settings were validated here; the services get the same overrides and file.
    return run_cluster(_settings(args), port=args.port, only=args.only, counts=counts,
                       overrides=args.set or [], config_file=args.config,
                       secure=args.secure, secrets_dir=args.secrets_dir)


def cmd_secure_init(args: argparse.Namespace) -> int:
    """Write the NATS server config, CA, certificates and one credentials folder per
    identity (docker-compose.yml mounts them); existing secrets are reused."""
    from cpd.ops import security

    nodes = {f"{k}-0": k for k in security.SERVICE_KINDS}  # what docker-compose.yml runs
    for item in args.node or []:
        node, _, kind = item.partition("=")
        nodes[node.strip()] = kind.strip()
    secrets = security.SecretsDir.ensure(
        args.dir, security.identities_for(nodes),
        hosts=[*security.DEFAULT_HOSTS, *(args.host or [])], mtls=args.mtls,
        server_root=args.server_mount, store_dir=args.store_dir, listen=args.listen,
        http=args.http)
    print(f"NATS server config: {secrets.config_file}")
    for name, ident in secrets.identities.items():
        print(f"  {name:<14} {ident.kind:<10} {secrets.folder(name)}")
    print("Every process reads its own folder (nats.nkey_seed_file, nats.tls_ca_file, "
          "nats.inbox_prefix); see README, 'Secure NATS'.")
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``cpd bench NAME``: one subcommand per benchmark of the registry, each
    with the common ``--json`` and the flags its module declares (added when that
    subcommand is used, so only its module is imported)."""
    from tools.bench.registry import BENCHMARKS, BenchParser

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks/)",
                           description="Benchmarks; each writes its result as JSON "
                                       "(docs/benchmarks/). `cpd bench NAME --help` lists "
                                       "NAME's flags.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="also write the result here")
    names = bench.add_subparsers(dest="what", required=True, metavar="NAME",
                                 title="benchmarks", parser_class=BenchParser)
    for b in BENCHMARKS.values():
        names.add_parser(b.name, help=b.help, description=b.help, parents=[common],
                         benchmark=b)
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpd", description=__doc__)
    p.add_argument("--config", help="TOML settings file (also CPD_CONFIG)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override one setting (repeatable)")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="the locally built model").add_subparsers(
        dest="action", required=True)
    b = model.add_parser("build", help="build a model preset (deterministic, idempotent)")
    b.add_argument("--preset", help="tiny or small (default: model.preset)")
    b.add_argument("--cache-dir", help="default: model.cache_dir")
    b.add_argument("--force", action="store_true", help="rebuild even if intact")
    b.set_defaults(func=cmd_model_build)
    c = model.add_parser("check", help="load the model in vLLM and generate")
    c.add_argument("--preset")
    c.add_argument("--max-tokens", type=int, default=8)
    c.add_argument("--json", metavar="PATH")
    c.set_defaults(func=cmd_model_check)

    add_bench_parser(sub)

    from tools.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)

    n = sub.add_parser("nats", help="run the embedded NATS server (JetStream) in the "
                                    "foreground, or configure a NATS cluster")
    n.add_argument("--port", type=int, help="default: nats.embedded_port; 0 = any free port")
    n.add_argument("--store-dir")
    n.set_defaults(func=cmd_nats)
    nc = n.add_subparsers(dest="action").add_parser(
        "cluster", help="write one config per member of a NATS cluster with JetStream")
    nc.add_argument("dir", metavar="DIR", help="where the configs go (not with --secrets)")
    nc.add_argument("--size", type=int, default=3, help="members (default 3)")
    nc.add_argument("--host", action="append",
                    help="address of member i, in order (repeatable; default nats-0, "
                         "nats-1, ...: the compose and Kubernetes service names)")
    nc.add_argument("--store-dir", default="/data/nats",
                    help="JetStream store on each member (default /data/nats)")
    nc.add_argument("--secrets", metavar="SECRETS_DIR",
                    help="a `cpd secure init` folder: the configs go into its server/ "
                         "folder and include its users, permissions and TLS")
    nc.set_defaults(func=cmd_nats_cluster)

    im = sub.add_parser("images", help="container images").add_subparsers(
        dest="action", required=True)
    ib = im.add_parser("build", help="build the images with podman on a local Debian base")
    ib.add_argument("--target", action="append",
                    choices=["control", "worker-cpu", "worker-cuda"],
                    help="repeatable (default: control and worker-cpu)")
    ib.add_argument("--base", help="base image (default: one built here with mmdebstrap)")
    ib.set_defaults(func=cmd_images_build)

    sv = sub.add_parser("serve", help="run one service in the foreground, joining the NATS "
                                      "deployment nats.servers names")
    sv.add_argument("service", choices=SERVE_CHOICES,
                    help="worker: in the role of worker.role")
    sv.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="send one request through the router, stream the text")
    g.add_argument("prompt", nargs="?", default="", help="prompt text (the router tokenizes)")
    g.add_argument("--token-ids", help="comma-separated token ids instead of text")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--tenant", default="default")
    g.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    g.add_argument("--json", action="store_true", help="print the whole result as JSON")
    g.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="nodes, roles, queues, cache use and hit ratios")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    h = sub.add_parser("health", help="check that a service answers (container health checks)")
    h.add_argument("service",
                   help="kvindex, router, gateway, frontend, preprefill, prefill or decode")
    h.add_argument("--node", help="node id (default: node.node_id)")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(func=cmd_health)

    vl = sub.add_parser("vllm", help="vLLM's own CLI from this environment "
                                     "(e.g. cpd vllm bench serve ...)", add_help=False)
    vl.add_argument("args", nargs=argparse.REMAINDER, help="vLLM's arguments")
    vl.set_defaults(func=cmd_vllm)

    up = sub.add_parser("up", help="start the whole system on the embedded default")
    up.add_argument("--port", type=int, help="NATS port (default: nats.embedded_port)")
    up.add_argument("--only", action="append", metavar="SERVICE",
                    help="start only these services (repeatable; kvindex, router and "
                    "gateway each in a process of its own); default: the workers and "
                    "one frontend")
    up.add_argument("--count", action="append", metavar="SERVICE=N",
                    help="instances of a service, e.g. prefill=2 (repeatable)")
    up.add_argument("--secure", action="store_true",
                    help="least-privilege NATS: TLS, one identity per service, generated "
                         "permissions (secrets in nats.secrets_dir, reused)")
    up.add_argument("--secrets-dir", help="with --secure (default: nats.secrets_dir)")
    up.set_defaults(func=cmd_up)

    sec = sub.add_parser("secure", help="least-privilege NATS secrets").add_subparsers(
        dest="action", required=True)
    si = sec.add_parser("init", help="write the NATS config, CA, certificates and "
                                     "per-service credentials into DIR (for docker compose)")
    si.add_argument("dir", metavar="DIR")
    si.add_argument("--node", action="append", metavar="NODE=KIND",
                    help="one more node identity, e.g. prefill-1=prefill (repeatable); "
                         "<kind>-0 of every service, client and admin are always there")
    si.add_argument("--host", action="append", help="extra name/IP in the server certificate")
    si.add_argument("--mtls", action="store_true", help="clients show certificates too")
    si.add_argument("--server-mount", default="/etc/nats",
                    help="where the NATS container mounts DIR/server (default /etc/nats)")
    si.add_argument("--store-dir", default="/data", help="JetStream store in the container")
    si.add_argument("--listen", default="0.0.0.0:4222")
    si.add_argument("--http", default="127.0.0.1:8222",
                    help="monitoring endpoint (the container's health check)")
    si.set_defaults(func=cmd_secure_init)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cpd`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:  # everything after it is vLLM's, options included
        return cmd_vllm(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CpdError as e:
        print(f"cpd: error [{e.code.value}]: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
