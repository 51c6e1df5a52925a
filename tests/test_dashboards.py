"""The dashboard and the alert rules against the metrics CPD really exports: every query
parses, every series it reads is in the catalogue (``cpd.ops.metrics``), and a running
``cpd up`` (real NATS, vLLM-CPU workers, requests through the gateway) exports every
one of them, under names that carry their unit once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cpd.ops import metrics
from tools.supervisor import stop_tree

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "cpd-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
OBSERVABILITY_DOC = ROOT / "docs" / "observability.md"
# Series Prometheus itself makes (scrape health), not a CPD process.
PROMETHEUS_OWN = {"up"}
UNIT_WORDS = ("seconds", "milliseconds", "ms", "bytes", "total")
SCRAPE_PORTS = 8  # cpd up's four processes, and some to spare


def _exprs() -> dict[str, str]:
    """Every PromQL expression of the dashboard and the alert rules, by where it is."""
    out: dict[str, str] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel.get("targets", []):
            out[f"panel {panel['title']!r} {t['refId']}"] = t["expr"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            out[f"alert {rule['alert']}"] = rule["expr"]
    return out


def _selected(expr: str) -> set[str]:
    """The metric names an expression's selectors read."""
    import promql_parser

    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
            return
        if isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
            return
        for attr in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, str | int | float):
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    # Grafana's range variable is not PromQL; any duration stands in for it here.
    walk(promql_parser.parse(expr.replace("$__rate_interval", "5m")))
    return names


def _catalogue_series() -> set[str]:
    return {s for spec in metrics.CATALOGUE for s in spec.series()}


def test_every_dashboard_query_and_alert_reads_catalogued_series() -> None:
    series = _catalogue_series()
    exprs = _exprs()
    assert len(exprs) > 30
    for where, expr in exprs.items():
        assert _selected(expr), f"{where} reads no series"
        unknown = _selected(expr) - series - PROMETHEUS_OWN
        assert not unknown, f"{where} reads {unknown}, which CPD does not export"


@pytest.mark.parametrize("spec", metrics.CATALOGUE, ids=lambda s: s.name)
def test_metric_names_follow_the_conventions(spec: metrics.MetricSpec) -> None:
    assert re.fullmatch(r"cpd_[a-z0-9_]+", spec.name), spec.name
    # The instrument name carries no unit and no _total: the exporter adds them once.
    assert not spec.name.endswith(tuple(f"_{w}" for w in UNIT_WORDS)), spec.name
    assert spec.unit in ("", "s", "By", "{token}"), spec.unit
    if spec.kind == "histogram":
        assert spec.unit == "s" and spec.buckets == tuple(sorted(spec.buckets))
    name = spec.prometheus_name
    for a in UNIT_WORDS:
        for b in UNIT_WORDS:
            assert not name.endswith(f"_{a}_{b}") or (a, b) in (("seconds", "total"),
                                                                ("bytes", "total")), name
    assert spec.description


def test_the_observability_page_lists_every_metric() -> None:
    doc = OBSERVABILITY_DOC.read_text()
    listed = set(re.findall(r"^\| `(cpd_[a-z0-9_]+)` \|", doc, re.M))
    assert listed == {s.prometheus_name for s in metrics.CATALOGUE}


def test_the_scrape_config_reads_cpd_ups_targets_and_the_alerts() -> None:
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert cfg["rule_files"] == [ALERTS.name]
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "cpd" and job["file_sd_configs"][0]["files"] == ["targets/*.json"]


# --------------------------------------------------------------------- live system


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    import socket

    for base in range(20000, 60000, 97):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _scrape(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[dict]:
    """``cpd up`` with scrape ports: the targets file, the gateway's port, its NATS URL."""
    tmp = tmp_path_factory.mktemp("dash")
    metrics_port = _free_ports(SCRAPE_PORTS + 1)  # one per process, then the gateway's
    gateway_port = metrics_port + SCRAPE_PORTS
    env = {**os.environ, "CPD_NATS__EMBEDDED_STORE_DIR": str(tmp / "nats"),
           "CPD_TELEMETRY__LOG_JSON": "false", "CPD_GATEWAY__PORT": str(gateway_port),
           "CPD_MODEL__CACHE_DIR": str(model_cache),
           "CPD_TELEMETRY__PROMETHEUS_PORT": str(metrics_port),
           # A disk tier under every arena, so its series are exported too.
           "CPD_DATAPLANE__DISK_DIR": str(tmp / "disk"),
           # The warm request pulls from a peer, so the data plane's series move too.
           "CPD_ROUTER__WARM_ON_IDLE_PREPREFILL": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "up", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:  # a start that fails stops cpd up too: its engines hold gigabytes
        assert proc.stdout is not None
        yield _await_banner(proc, gateway_port)
    finally:
        # Ctrl-C: cpd up stops its services (each in a session of its own) and exits.
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        stop_tree(proc, 10)


def _await_banner(proc: subprocess.Popen[str], gateway_port: int) -> dict:
    """Where the started system is, from ``cpd up``'s banner."""
    # Read on a thread (all along: a full pipe would stall cpd up) so a silent start
    # fails at the deadline instead of blocking on a read.
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(x) for x in proc.stdout or ()] + [out.put("")],
                     daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + 400
    while not any("Stop:" in x for x in lines):
        try:
            line = out.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break  # silent past the deadline: the banner's absence fails below
        if not line:
            break  # cpd up exited
        lines.append(line)
    banner = "".join(lines)
    url = re.search(r"NATS \(JetStream\): (nats://\S+)", banner)
    logs = re.search(r"logs:\s+(\S+)", banner)
    assert url and logs and "Stop:" in banner, banner[-4000:]
    return {"targets": Path(logs.group(1)) / "prometheus-targets.json",
            "gateway": f"http://127.0.0.1:{gateway_port}", "nats": url.group(1)}


def _complete(base: str, prompt: str, model: str = "cpd-tiny") -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


async def _junk_to_the_router(nats_url: str) -> None:
    """One malformed bus message: the router refuses and counts it."""
    import nats

    from cpd.protocol import subjects

    nc = await nats.connect(nats_url)
    try:
        await nc.request(subjects.GENERATE, b"\xc1junk", timeout=10)
    finally:
        await nc.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_running_system_exports_every_series_the_dashboard_and_alerts_read(
        live: dict) -> None:
    targets = json.loads(live["targets"].read_text())
    services = {t["labels"]["service"] for t in targets}
    # cpd up's front end: the gateway, router and kvindex metrics on one scrape target.
    assert {"frontend", "preprefill", "prefill", "decode"} <= services
    assert all(len(t["targets"]) == 1 for t in targets)
    with urllib.request.urlopen(f"{live['gateway']}/ready", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ready"
    # A cold prompt, then the same context again (warm): every path's metrics move.
    context = " ".join(f"line {i}: def f{i}(x): return x * {i}" for i in range(120))
    for suffix in ("first question", "second question", "second question"):
        out = _complete(live["gateway"], f"{context}\n# {suffix}\n")
        assert out["choices"][0]["text"] is not None
    with pytest.raises(urllib.error.HTTPError) as err:  # an error the gateway counts
        _complete(live["gateway"], "x", model="no-such-model")
    assert err.value.code == 404
    asyncio.run(_junk_to_the_router(live["nats"]))
    exported: set[str] = set()
    for t in targets:
        series = _scrape(f"http://{t['targets'][0]}/metrics")
        exported |= series
        if t["labels"]["service"] in ("preprefill", "prefill", "decode"):
            # Each engine's own series, next to the worker's: what a vLLM dashboard reads.
            assert {"vllm:num_requests_running", "vllm:prompt_tokens_total",
                    "vllm:time_to_first_token_seconds_bucket"} <= series, t
    cpd_names = {n for n in exported if n.startswith("cpd_")}
    doubled = {n for n in cpd_names
               if re.search(r"_(ms|milliseconds|seconds|bytes)_(milliseconds|seconds|bytes)"
                            r"(_bucket|_sum|_count|_total)?$", n)}
    assert not doubled
    missing = {s for spec in metrics.CATALOGUE for s in spec.series()} - exported
    assert not missing, f"catalogued but not exported by the running system: {missing}"
    for where, expr in _exprs().items():
        unread = _selected(expr) - exported - PROMETHEUS_OWN
        assert not unread, f"{where} reads {unread}, which the running system lacks"
    # Nothing exported that the catalogue does not name (one place for every metric).
    uncatalogued = cpd_names - _catalogue_series()
    assert not uncatalogued, uncatalogued
