"""Stop strings as the router finds them in a request's text, with vLLM's semantics:
token by token, only after ``min_tokens``, the first listed string that ends in the new
text, text cut before it (or after it), and the tail held back while it could still be
the start of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import load_settings
from cpd.protocol import wire
from services.router.relay import AttemptFailed, Relay
from services.router.stops import StopStrings
from tests.helpers.recorder import Recorder


@pytest.mark.parametrize(("pieces", "stops", "include", "min_tokens", "sent", "matched"), [
    # No stop: everything goes out, the held-back tail at the end.
    (["ab", "cd", "ef"], ["xyz"], False, 0, ["", "ab", "cdef"], None),
    # A stop inside one piece: text up to it.
    (["hello", " wor", "ld. Bye"], ["."], False, 0, ["hello", " wor", "ld"], "."),
    # A stop split across pieces; the tail that might begin it is held back.
    (["one E", "N", "D two"], ["END"], False, 0, ["one", " ", ""], "END"),
    # Kept in the output when asked; nothing is held back then.
    (["one E", "N", "D two"], ["END"], True, 0, ["one E", "N", "D"], "END"),
    # The first string *in the request's order* that ends in the new text wins.
    (["a b c"], ["c", "b"], False, 0, ["a b "], "c"),
    (["a b c"], ["b", "c"], False, 0, ["a "], "b"),
    # Not before min_tokens tokens: a stop completed earlier is never found later.
    (["x.", "y", "z."], ["."], False, 1, ["x.", "y", "z"], "."),
    (["x.", "y", "z"], ["."], False, 2, ["x.", "y", "z"], None),
    # Nothing after a match, even text that would match again.
    (["a.", "b."], ["."], False, 0, ["a", ""], "."),
])
def test_stop_strings(pieces: list[str], stops: list[str], include: bool,
                      min_tokens: int, sent: list[str], matched: str | None) -> None:
    s = StopStrings(stops, include_in_output=include, min_tokens=min_tokens)
    got = [s.push(p) for p in pieces]
    if matched is None:
        got[-1] += s.flush()
    else:
        assert s.flush() == ""
    assert (got, s.matched) == (sent, matched)


@pytest.fixture(scope="module")
def model(model_cache: Path) -> ServedModel:
    return ServedModel.load(load_settings(environ={}, overrides=[
        f"model.cache_dir={model_cache}"]))


@pytest.mark.parametrize("chunk", [1, 3, 50])
async def test_the_relay_stops_at_the_string_whatever_the_chunking(
        model: ServedModel, chunk: int) -> None:
    """Tokens are checked one by one however the nodes chunk them: the client gets the
    tokens up to the one that completed the stop string, and the text before it."""
    text = "the quick brown fox jumps over the lazy dog"
    ids = model.encode(text)
    out = Recorder()
    relay = Relay(out, model.detokenizer,  # type: ignore[arg-type]
                  wire.SamplingParams(max_tokens=64, stop=["lazy", "fox j"]))
    relay.restart("p0", "d0")
    for i in range(0, len(ids), chunk):
        await relay.tokens(ids[i:i + chunk])
    assert relay.stop_string == "fox j"
    assert out.text == "the quick brown "
    # The stop's last token ends the ids; its text holds the start of "fox j".
    assert model.decode(out.ids).startswith("the quick brown fox j")
    assert not model.decode(out.ids[:-1]).startswith("the quick brown fox j")
    await relay.final(wire.Final(request_id="r", seq=1, finish_reason="stop",
                                 stop_reason=relay.stop_string))
    assert out.text == "the quick brown " and out.final_fields["stop_reason"] == "fox j"


@pytest.mark.parametrize(("include", "expect_tail"), [(False, ""), (True, "dog")])
async def test_a_stop_tokens_own_text_is_left_out(model: ServedModel, include: bool,
                                                  expect_tail: str) -> None:
    """A chunk whose last id is the stop token (EOS, stop_token_ids): as vLLM, its text
    is not added, unless the request includes stop strings in its output."""
    ids = model.encode("a lazy dog")
    out = Recorder()
    relay = Relay(out, model.detokenizer,  # type: ignore[arg-type]
                  wire.SamplingParams(include_stop_str_in_output=include))
    relay.restart("p0")
    *head, last = ids
    await relay.tokens(head)
    await relay.tokens([last], ends_with_stop_token=True)
    await relay.final(wire.Final(request_id="r", seq=1))
    assert out.ids == ids
    assert out.text == model.decode(head) + (model.decode(ids)[len(model.decode(head)):]
                                            if include else "")
    assert out.text.endswith(expect_tail)


async def test_a_stop_string_ends_only_its_own_choice(model: ServedModel) -> None:
    """Of several choices, each is checked for the stop strings on its own: the one that
    has it ends there (its node is told to cancel that choice only), the others run to
    their own end; the client's final says how each ended."""
    out = Recorder()
    relay = Relay(out, model.detokenizer,  # type: ignore[arg-type]
                  wire.SamplingParams(max_tokens=64, stop=["fox j"], n=2))
    relay.restart("p0", "d0")
    fox, dog = model.encode("the quick brown fox jumps"), model.encode("a lazy dog")
    for k in range(max(len(fox), len(dog))):
        await relay.tokens(fox[k:k + 1], index=0)
        await relay.tokens(dog[k:k + 1], index=1)
    assert [c.stop_string for c in relay.choices] == ["fox j", None]
    assert relay.stop_string is None  # the request goes on
    ends = relay.ends(wire.Final(request_id="r", seq=9, choices=[
        wire.ChoiceEnd(index=0, finish_reason="abort", completion_tokens=99),
        wire.ChoiceEnd(index=1, finish_reason="length", completion_tokens=99)]))
    assert [(e.finish_reason, e.stop_reason) for e in ends] == [("stop", "fox j"),
                                                                ("length", None)]
    assert [e.completion_tokens for e in ends] == [len(out.choices[0][0]), len(dog)]
    await relay.final(wire.Final(request_id="r", seq=9, choices=ends))
    assert out.choices[0][1] == "the quick brown " and out.choices[1][1] == "a lazy dog"
    assert relay.sent == len(out.choices[0][0]) + len(dog)
    with pytest.raises(AttemptFailed):  # no such choice: a malformed stream
        await relay.tokens([1], index=2)
