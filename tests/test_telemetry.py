"""Logs carry request and trace ids; trace context survives NATS headers and durable strings."""

from __future__ import annotations

import json
import subprocess
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cpd.ops import telemetry

_SCRIPT = """
from cpd.ops import telemetry
from opentelemetry import trace
telemetry.setup("probe")
log = telemetry.get_logger("probe")
with telemetry.tracer().start_as_current_span("work") as span:
    with telemetry.bound_request("req-42", tenant="t1"):
        log.info("did.work", blocks=3)
    print(format(span.get_span_context().trace_id, "032x"))
log.info("outside")
"""


def test_json_logs_carry_request_and_trace_ids() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         check=True)
    trace_id = out.stdout.strip()
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    work = next(entry for entry in lines if entry["event"] == "did.work")
    assert work["request_id"] == "req-42" and work["tenant"] == "t1"
    assert work["trace_id"] == trace_id and work["service"] == "probe"
    assert work["level"] == "info" and work["blocks"] == 3 and "timestamp" in work
    outside = next(entry for entry in lines if entry["event"] == "outside")
    assert "request_id" not in outside and "trace_id" not in outside


def test_traceparent_round_trip() -> None:
    tracer = TracerProvider().get_tracer("t")  # real spans, whatever the global provider
    with tracer.start_as_current_span("parent") as span:
        headers = telemetry.inject({"other": "x"})
        stored = telemetry.current_traceparent()
    assert headers["other"] == "x" and headers["traceparent"] == stored
    want = span.get_span_context().trace_id
    for ctx in (telemetry.extract(headers), telemetry.context_from_traceparent(stored)):
        assert trace.get_current_span(ctx).get_span_context().trace_id == want
    assert not trace.get_current_span(telemetry.extract({})).get_span_context().is_valid
    assert not trace.get_current_span(
        telemetry.context_from_traceparent("garbage")).get_span_context().is_valid


_SERVER_SPAN_SCRIPT = """
import json
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from cpd.ops import telemetry
telemetry.setup("probe")
caller = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
seen = []
for phase in ("quiet", "exporting"):
    if phase == "exporting":
        spans = InMemorySpanExporter()
        telemetry.export_spans(SimpleSpanProcessor(spans))
    with telemetry.server_span("probe.op", caller, {"cpd.node": "n1"}) as span:
        ctx = span.get_span_context()
        seen.append({"phase": phase, "recording": span.is_recording(),
                     "trace_id": format(ctx.trace_id, "032x"),
                     "span_id": format(ctx.span_id, "016x"),
                     "downstream": telemetry.inject({})["traceparent"]})
    with telemetry.server_span("probe.untraced", None, {}) as span:
        seen[-1]["untraced_valid"] = span.get_span_context().is_valid
seen.append([(s.name, s.parent is not None and s.parent.span_id == 0xb7ad6b7169203331)
             for s in spans.get_finished_spans()])
print(json.dumps(seen))
"""


def test_server_spans_are_built_only_where_something_exports_them() -> None:
    out = subprocess.run([sys.executable, "-c", _SERVER_SPAN_SCRIPT], capture_output=True,
                         text=True, check=True)
    quiet, exporting, finished = json.loads(out.stdout)
    # Without an exporter the caller's span stays current: same trace, same parent for
    # whatever this process calls next, nothing recorded.
    assert not quiet["recording"] and quiet["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert quiet["span_id"] == "b7ad6b7169203331"
    assert quiet["downstream"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert not quiet["untraced_valid"]
    # With one, a SERVER span child of the caller's, exported with its parent link.
    assert exporting["recording"] and exporting["trace_id"] == quiet["trace_id"]
    assert exporting["span_id"] != "b7ad6b7169203331"
    assert exporting["downstream"].split("-")[2] == exporting["span_id"]
    assert exporting["untraced_valid"]
    assert finished == [["probe.op", True], ["probe.untraced", False]]
