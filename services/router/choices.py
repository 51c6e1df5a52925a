"""One choice of a request as its client gets it: the tokens forwarded, their text (held
back while it may be the start of a stop string) and, once one matched, the stop string
that ended it. A request has ``SamplingParams.n`` of them, streamed side by side.
"""

from __future__ import annotations

from cpd.engines.servedmodel import Detokenizer
from cpd.protocol import wire
from services.router.stops import StopStrings


class ChoiceText:
    """The client's side of one choice across tries."""

    def __init__(self, index: int, detok: Detokenizer, sampling: wire.SamplingParams) -> None:
        self.index = index
        self.detok = detok
        s = sampling
        self.stops = StopStrings(s.stop, include_in_output=s.include_stop_str_in_output,
                                 min_tokens=s.min_tokens) if s.stop else None
        # A stop token's own text (EOS, stop_token_ids) is left out, as vLLM does.
        self._stop_token_text = s.include_stop_str_in_output
        self.forwarded: list[int] = []
        self.seen = 0  # tokens received in the current try
        # Text owed to, or already held by, a resuming client (see resume()).
        self._owed = ""
        self._skip = 0

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended this choice, once one did."""
        return self.stops.matched if self.stops is not None else None

    def resume(self, ids: list[int], text_chars: int) -> None:
        """The client already has ``ids`` and ``text_chars`` characters of their text
        from a router that died: they count as forwarded (a try must regenerate them
        exactly), and text goes on from where the client's stops. Decoded at once, the
        ids' text may end elsewhere than the dead router's chunks did: what is missing
        is sent first, what the client has is not sent again."""
        self.forwarded = list(ids)
        _, text = self.texts(self.forwarded, ends_with_stop_token=False)
        self._owed, self._skip = text[text_chars:], max(0, text_chars - len(text))

    def texts(self, ids: list[int], *, ends_with_stop_token: bool) -> tuple[int, str]:
        """How many of ``ids`` the client gets (all, or up to the one that completed a
        stop string) and the text it may have now."""
        texted = ids[:-1] if ends_with_stop_token and not self._stop_token_text else ids
        if self.stops is None:
            return len(ids), self.detok.push(texted)
        parts = []
        for k, token in enumerate(texted):  # token by token, as vLLM checks
            parts.append(self.stops.push(self.detok.push([token])))
            if self.stops.matched is not None:
                return k + 1, "".join(parts)
        return len(ids), "".join(parts)

    def text(self, text: str) -> str:
        """``text`` as the client still needs it."""
        text, self._owed = self._owed + text, ""
        cut = min(self._skip, len(text))
        self._skip -= cut
        return text[cut:]

    def rest(self) -> str:
        """The text still held back, at the end of the stream."""
        rest = self.detok.flush()
        if self.stops is not None:
            rest = self.stops.push(rest) + self.stops.flush() if rest else self.stops.flush()
        return self.text(rest)

    def end(self, worker: wire.ChoiceEnd | None) -> wire.ChoiceEnd:
        """How this choice ended for the client: at its stop string, or as its node
        says (``worker``; ``None``: the node did not say), with the tokens it got."""
        if self.stop_string is not None:
            return wire.ChoiceEnd(index=self.index, finish_reason="stop",
                                  stop_reason=self.stop_string,
                                  completion_tokens=len(self.forwarded))
        return wire.ChoiceEnd(index=self.index,
                              finish_reason=worker.finish_reason if worker else "abort",
                              stop_reason=worker.stop_reason if worker else None,
                              completion_tokens=len(self.forwarded))
