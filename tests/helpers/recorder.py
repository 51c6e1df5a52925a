"""The client's side of a stream the router's relay forwards, recorded: what a test
of the relay checks."""

from __future__ import annotations

from typing import Any


class Recorder:
    """Stands in for a ``ReplyStream``: the ids and text sent, and the final's fields."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.final_fields: dict[str, Any] = {}

    async def tokens(self, ids: list[int], text: str = "", **_: object) -> None:
        self.ids += ids
        self.text += text

    async def final(self, **fields: Any) -> None:
        self.final_fields = fields
