"""Which node owns a request's stream, as the router's relay tracks it: the prefill node
a try was dispatched to, until a decode node says on the stream that it accepted the
hand-off (never guessed from the tokens seen)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpd.bus.stream import error_message
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import load_settings
from cpd.protocol import wire
from cpd.protocol.errors import InvalidRequest, Unavailable, error_from_wire
from cpd.protocol.resume import resumed_tokens
from services.router import NodeTable
from services.router.relay import AttemptFailed, Relay, resumed_complete
from tests.helpers.recorder import Recorder


def _relay() -> Relay:
    return Relay(out=None, detok=lambda: None)  # type: ignore[arg-type]  # no tokens forwarded


@pytest.mark.parametrize("events, owner, decode_node", [
    ([("restart", "p0")], "p0", ""),
    ([("restart", "p0"), ("accepted", "d1")], "d1", "d1"),
    # A retry goes back to its new prefill node, whatever accepted the last try.
    ([("restart", "p0"), ("accepted", "d1"), ("restart", "p1")], "p1", ""),
    ([("restart", "p0"), ("accepted", "d1"), ("restart", "p1"), ("accepted", "d0")],
     "d0", "d0"),
])
def test_the_stream_owner_follows_restarts_and_acceptances(
        events: list[tuple[str, str]], owner: str, decode_node: str) -> None:
    relay = _relay()
    for kind, node in events:
        if kind == "restart":
            relay.restart(node)
        else:
            relay.accepted(wire.HandoffAccepted(request_id="r", seq=1, node=node))
    assert (relay.owner, relay.decode_node) == (owner, decode_node)


@pytest.fixture(scope="module")
def model(model_cache: Path) -> ServedModel:
    return ServedModel.load(load_settings(environ={}, overrides=[
        f"model.cache_dir={model_cache}"]))


async def _stream(model: ServedModel, ids: list[int], chunk: int) -> str:
    """The text a client gets from one router relaying ``ids`` in chunks of ``chunk``."""
    out = Recorder()
    relay = Relay(out, model.detokenizer)  # type: ignore[arg-type]
    relay.restart("p0")
    for i in range(0, len(ids), chunk):
        await relay.tokens(ids[i:i + chunk])
    await relay.final(wire.Final(request_id="r", seq=1))
    return out.text


async def test_a_resumed_stream_continues_the_text_exactly(model: ServedModel) -> None:
    """A router died after ``k`` tokens (sent in chunks of 3, multi-byte characters
    split across tokens); another resumes from the client's tokens and text and
    regenerates from the start: the client's text, old and new, is the whole text once,
    at every point the first router could have died."""
    ids = model.encode("héllo wörld — ✓ naïve café ≠ 東京 done")
    whole = await _stream(model, ids, 3)
    assert whole == model.tokenizer.decode(ids)
    for k in range(1, len(ids)):
        before = Recorder()
        first = Relay(before, model.detokenizer)  # type: ignore[arg-type]
        first.restart("p0")
        for i in range(0, k, 3):
            await first.tokens(ids[i:min(i + 3, k)])
        after = Recorder()
        second = Relay(after, model.detokenizer)  # type: ignore[arg-type]
        second.resume(before.ids, len(before.text))
        second.restart("p1")
        await second.tokens(ids)  # the try regenerates every token
        await second.final(wire.Final(request_id="r", seq=1))
        assert before.ids + after.ids == ids, k
        assert before.text + after.text == whole, k
        assert second.sent == len(ids)


@pytest.mark.parametrize(("sampling", "resume", "refused"), [
    (wire.SamplingParams(max_tokens=8), [1, 2], False),
    (wire.SamplingParams(max_tokens=8, temperature=0.7, seed=3), [1, 2], False),
    (wire.SamplingParams(max_tokens=8, temperature=0.7), [1, 2], True),  # not reproducible
    (wire.SamplingParams(max_tokens=2), [1, 2], False),  # all there: only the final lost
    (wire.SamplingParams(max_tokens=1), [1, 2], True),  # more than it asked for
    (wire.SamplingParams(max_tokens=8, n=2), [1, 2], True),  # whose tokens? one list
    (wire.SamplingParams(max_tokens=8), [], False),
])
def test_only_a_reproducible_request_resumes(sampling: wire.SamplingParams,
                                             resume: list[int], refused: bool) -> None:
    req = wire.GenerateRequest(request_id="r", tokens=wire.pack_tokens([5]), sampling=sampling,
                               resume_tokens=wire.pack_tokens(resume) if resume else b"")
    if refused:
        with pytest.raises(InvalidRequest):
            resumed_tokens(req, lambda _: None)
    else:
        assert resumed_tokens(req, lambda _: None) == resume


class _FailingReader:
    """A stream whose next message is ``error`` (as a router's reader raises it)."""

    def __init__(self, error: wire.Error) -> None:
        self.error = error

    async def next(self, timeout: float) -> wire.Message | None:
        e = self.error
        raise error_from_wire(e.code, e.message, e.retryable, e.node)


@pytest.mark.parametrize("node, routed_around", [
    # The prefill node's hand-off was refused by d0: retry without d0, p0 is fine.
    ("d0", {"d0"}),
    # An error about the node itself: route around the stream's owner.
    ("", {"p0"}),
])
async def test_a_failed_try_routes_around_the_node_its_error_names(
        node: str, routed_around: set[str]) -> None:
    relay = _relay()
    relay.restart("p0")
    error = error_message(Unavailable("did not take the hand-off", node=node), "r", 1)
    assert error.node == node  # on the wire
    with pytest.raises(AttemptFailed) as failed:
        await relay.follow(_FailingReader(error), NodeTable(), check_s=0.1,  # type: ignore[arg-type]
                           idle_s=1.0, cancel=None)  # type: ignore[arg-type]
    assert failed.value.nodes == routed_around


@pytest.mark.parametrize(("sampling", "resume", "end"), [
    (wire.SamplingParams(max_tokens=3, ignore_eos=True), [4, 5, 6], ("length", None)),
    (wire.SamplingParams(max_tokens=3), [4, 5, 2], ("stop", None)),      # EOS (id 2) last
    (wire.SamplingParams(max_tokens=3, ignore_eos=True), [4, 5, 2], ("length", None)),
    (wire.SamplingParams(max_tokens=3, stop_token_ids=[9]), [4, 5, 9], ("stop", 9)),
    (wire.SamplingParams(max_tokens=4), [4, 5, 6], None),                # one left to make
])
def test_a_resume_with_every_token_ends_at_once(sampling: wire.SamplingParams,
                                                resume: list[int], end: tuple | None) -> None:
    """A client whose final message was lost resumes with all its tokens: the router ends
    the request as vLLM would have, with no engine run."""
    req = wire.GenerateRequest(request_id="r", tokens=wire.pack_tokens([7] * 10),
                               sampling=sampling)
    done = resumed_complete(req, resume, 10, eos_token_id=2)
    if end is None:
        assert done is None
    else:
        assert done is not None
        assert (done["finish_reason"], done["stop_reason"]) == end
        assert (done["usage"].prompt_tokens, done["usage"].completion_tokens) == (10, 3)
