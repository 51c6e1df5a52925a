"""The client's side of a stream the router's relay forwards, recorded: what a test
of the relay checks."""

from __future__ import annotations

from typing import Any


class Recorder:
    """Stands in for a ``ReplyStream``: the ids and text sent, and the final's fields."""

    def __init__(self) -> None:
        self.ids: list[int] = []  # of choice 0
        self.text = ""
        self.choices: dict[int, tuple[list[int], str]] = {}  # every choice's
        self.final_fields: dict[str, Any] = {}

    async def tokens(self, ids: list[int], text: str = "", *, index: int = 0,
                     **_: object) -> None:
        before_ids, before_text = self.choices.get(index, ([], ""))
        self.choices[index] = (before_ids + ids, before_text + text)
        if index == 0:
            self.ids += ids
            self.text += text

    async def final(self, **fields: Any) -> None:
        self.final_fields = fields
