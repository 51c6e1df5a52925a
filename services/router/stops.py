"""Stop strings on a generated text stream, with vLLM's semantics.

The router owns a request's text (it detokenizes what the nodes generate), so it is
where stop strings are found, as vLLM's output processor finds them in its server:

* Text is checked one token at a time, once more than ``min_tokens`` tokens were
  generated; a match is a stop string that *ends* within the token's new text, and
  the strings are tried in the order the request gave them.
* The text is cut before the match (after it with ``include_stop_str_in_output``), and
  the request finishes with reason ``stop`` and the string as its stop reason.
* While streaming, the last ``len(longest stop) - 1`` characters are held back (none
  with ``include_stop_str_in_output``): they may be the start of a stop string that
  the client must never see.
"""

from __future__ import annotations


class StopStrings:
    """One request's stop strings over its text, fed token by token."""

    def __init__(self, stops: list[str], *, include_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self.stops = stops
        self.include = include_in_output
        self.min_tokens = min_tokens
        self.matched: str | None = None
        self._text = ""
        self._released = 0  # characters of _text handed out
        self._tokens = 0
        self._hold = 0 if include_in_output or not stops else max(map(len, stops)) - 1

    def push(self, new: str) -> str:
        """Add one token's new text; the text that may be sent now (empty once a stop
        string matched: nothing after it is ever sent)."""
        if self.matched is not None:
            return ""
        self._tokens += 1
        self._text += new
        if self._tokens > self.min_tokens and new:
            self._match(len(new))
        end = len(self._text) if self.matched is not None else len(self._text) - self._hold
        return self._release(end)

    def flush(self) -> str:
        """The text still held back, at the end of the stream."""
        return self._release(len(self._text))

    def _match(self, new_chars: int) -> None:
        for stop in self.stops:
            # Only a match that ends within the new text: earlier ones were looked for.
            at = self._text.find(stop, max(0, len(self._text) - new_chars - len(stop) + 1))
            if at < 0:
                continue
            self.matched = stop
            self._text = self._text[:at + len(stop) if self.include else at]
            return

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        out = self._text[self._released:end]
        self._released = end
        return out
