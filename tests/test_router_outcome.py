"""The client's final message as the router assembles it from the workers' reports
(``services.router.outcome``): table-driven, no I/O."""

from __future__ import annotations

import pytest

from cpd.protocol import wire
from services.router.outcome import Reports, RouterTimes, assemble

PLANNED = wire.Route(policy="cpd", path="warm", reason=wire.RouteReason.WARM,
                     prefill_node="p0", decode_node="d0",
                     tokens=wire.PromptTokens(remote=512, computed=40),
                     reusable_tokens=512, planned_reused_tokens=512, remote_node="pp0")
PREFILL = wire.PrefillReport(request_id="r", seq=1, node="p1",
                             tokens=wire.PromptTokens(dram=256, computed=296),
                             load_error=wire.LoadError(peer="pp0", code="unavailable"),
                             load_ms=3.0, prefill_ms=20.0)
DECODE = wire.DecodeReport(request_id="r", seq=6, node="d1", tokens_pulled=512,
                           tokens_computed=41, handoff_ms=4.0, decode_ms=50.0)
TIMES = RouterTimes(admission_ms=1.0, decision_ms=2.0, lookup_ms=0.5, ttft_ms=30.0,
                    total_ms=90.0)


def _final(cached: int = 0) -> wire.Final:
    return wire.Final(request_id="r", seq=7, finish_reason="length",
                      usage=wire.Usage(prompt_tokens=552, completion_tokens=5,
                                       cached_tokens=cached))


@pytest.mark.parametrize(("reports", "route", "usage_cached", "timings"), [
    # Both reports: what the workers did replaces the plan; the plan's view stays.
    (Reports(PREFILL, DECODE),
     {"prefill_node": "p1", "decode_node": "d1", "tokens": PREFILL.tokens,
      "load_error": PREFILL.load_error, "decode_tokens_pulled": 512,
      "decode_tokens_computed": 41, "planned_reused_tokens": 512, "remote_node": "pp0"},
     256, {"load_ms": 3.0, "prefill_ms": 20.0, "handoff_ms": 4.0, "decode_ms": 50.0}),
    # The prefill node finished the request itself (one token, or a stop): no decode.
    (Reports(PREFILL, None),
     {"prefill_node": "p1", "decode_node": "", "decode_tokens_pulled": 0},
     256, {"load_ms": 3.0, "handoff_ms": 0.0, "decode_ms": 0.0}),
    # No report (an older worker): the plan stands, the worker's own count of cached.
    (Reports(), {"prefill_node": "p0", "tokens": PLANNED.tokens, "load_error": None},
     7, {"load_ms": 0.0, "prefill_ms": 0.0}),
])
def test_assemble_takes_each_part_from_its_owner(reports: Reports, route: dict,
                                                 usage_cached: int, timings: dict) -> None:
    final = assemble(PLANNED, reports, _final(cached=7), prompt_tokens=552,
                     completion_tokens=4, times=TIMES, failovers=2)
    for field, want in route.items():
        assert getattr(final.route, field) == want, field
    for field, want in timings.items():
        assert getattr(final.timings, field) == want, field
    assert final.route.failovers == 2
    # The router's own measurements and the client's count of tokens it was sent.
    t = final.timings
    assert (t.admission_ms, t.decision_ms, t.lookup_ms, t.ttft_ms, t.total_ms) == (
        1.0, 2.0, 0.5, 30.0, 90.0)
    assert final.usage == wire.Usage(prompt_tokens=552, completion_tokens=4,
                                     cached_tokens=usage_cached)
    assert (final.finish_reason, final.request_id) == ("length", "r")


def test_assemble_leaves_the_plan_untouched() -> None:
    before = wire.encode(wire.Final(request_id="r", seq=0, route=PLANNED))
    assemble(PLANNED, Reports(PREFILL, DECODE), _final(), prompt_tokens=552,
             completion_tokens=4, times=TIMES, failovers=1)
    assert wire.encode(wire.Final(request_id="r", seq=0, route=PLANNED)) == before
