"""Prompts of exact token lengths cut from the local model's corpus, for the benchmarks
that drive a server through the OpenAI API."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from cpd.modelbuild.tokenizer import CORPUS


@dataclass
class CorpusPrompts:
    """Contexts and questions of exact token lengths, cut from the model's corpus at
    places ``rng`` draws."""

    folder: Path
    rng: random.Random

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.ids = self.tok.encode(CORPUS.read_text(encoding="utf-8")).ids
        self.serial = 0

    def text(self, n: int) -> str:
        """About ``n`` tokens of corpus text from a random place."""
        start = self.rng.randrange(0, len(self.ids) - n - 1)
        return self.tok.decode(self.ids[start:start + n])

    def context(self, n: int) -> str:
        """A context of about ``n`` tokens that no earlier request began with."""
        self.serial += 1
        head = f"Session {self.serial}-{self.rng.getrandbits(48):012x}.\n"
        return head + self.text(n - len(self.tok.encode(head).ids))
