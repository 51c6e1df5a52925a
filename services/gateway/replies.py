"""The bytes of the gateway's replies: JSON documents and server-sent events.

Bodies are encoded with msgspec, as the requests are decoded, so a reply's JSON is the
same whichever endpoint builds it.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import Response

SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every stream, as OpenAI ends its own."""


def json_response(data: dict[str, Any], *, status: int = HTTPStatus.OK,
                  headers: dict[str, str] | None = None) -> Response:
    """``data`` as a JSON reply."""
    return Response(msgspec.json.encode(data), status_code=status,
                    media_type="application/json", headers=headers)


def sse_event(data: dict[str, Any]) -> bytes:
    """``data`` as one SSE ``data:`` event."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
