"""The Completions API's ``best_of``: ``best_of`` choices are generated (one prompt, its
KV computed and moved once, as for ``n``) and the ``n`` of highest cumulative log
probability are returned, best first, as OpenAI's legacy API and vLLM's earlier
engine define it. It needs the whole of every choice, so it cannot be streamed.

Pure: which choices to keep, from their tokens' log probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpd.protocol import wire


@dataclass(frozen=True)
class Ranking:
    """A request's ``best_of``: keep ``n`` of the generated choices; with their log
    probabilities only when the client asked for them (ranking needs them anyway)."""

    n: int
    logprobs: bool

    def best(self, logprobs: list[list[wire.TokenLogprob]]) -> list[int]:
        """The indexes of the kept choices, best first (a tie: the lower index first),
        from each choice's tokens' log probabilities."""
        scores = [sum(e.logprob for e in entries) for entries in logprobs]
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:self.n]
