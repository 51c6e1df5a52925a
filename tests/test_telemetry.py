"""Logs carry request and trace ids; trace context survives NATS headers and durable strings."""

from __future__ import annotations

import json
import subprocess
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from cpd import telemetry

_SCRIPT = """
from cpd import telemetry
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
