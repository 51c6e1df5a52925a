"""HTTP errors of the gateway, in OpenAI's shape.

Every failure reaches the client as ``{"error": {"message", "type", "code", "param"}}``
with an HTTP status the OpenAI SDKs map to their exception classes (400
``BadRequestError``, 404 ``NotFoundError``, 429 ``RateLimitError``, 5xx
``InternalServerError``). CPD's typed errors keep their :class:`~cpd.protocol.errors.ErrorCode`
as ``code``, so a client can tell an overloaded router from a lost node.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import Request, Response
from starlette.exceptions import HTTPException

from cpd.protocol.errors import CpdError, ErrorCode

RETRY_AFTER_S = 1
"""``Retry-After`` of an overloaded reply: admission queues turn over within seconds."""

_STATUS_BY_CODE: dict[ErrorCode, HTTPStatus] = {
    ErrorCode.INVALID_REQUEST: HTTPStatus.BAD_REQUEST,
    ErrorCode.MALFORMED: HTTPStatus.BAD_REQUEST,
    ErrorCode.PROMPT_TOO_LONG: HTTPStatus.BAD_REQUEST,
    ErrorCode.PAYLOAD_TOO_LARGE: HTTPStatus.BAD_REQUEST,
    ErrorCode.UNKNOWN_NAMESPACE: HTTPStatus.NOT_FOUND,
    ErrorCode.OVERLOADED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.NO_RESPONDERS: HTTPStatus.SERVICE_UNAVAILABLE,
    # A service stopping cancels its requests; another replica can take the retry.
    ErrorCode.CANCELLED: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.TIMEOUT: HTTPStatus.GATEWAY_TIMEOUT,
    ErrorCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}

# msgspec (used by cpd.client to check sampling values) ends its messages with the path
# of the offending field.
_FIELD_PATH = re.compile(r"- at `\$\.?([^`]*)`$")


class ApiError(Exception):
    """An error reply: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def invalid(cls, message: str, *, param: str | None = None,
                code: str = ErrorCode.INVALID_REQUEST.value) -> ApiError:
        """A 400 for a request the gateway refuses by itself."""
        return cls(HTTPStatus.BAD_REQUEST, message, code=code, param=param)

    @classmethod
    def from_cpd(cls, exc: CpdError) -> ApiError:
        """The HTTP form of a CPD error (raised by the client, the router or a worker)."""
        status = _STATUS_BY_CODE.get(exc.code, HTTPStatus.INTERNAL_SERVER_ERROR)
        headers = ({"Retry-After": str(RETRY_AFTER_S)}
                   if status == HTTPStatus.TOO_MANY_REQUESTS else None)
        param = field_of(exc.message) if status == HTTPStatus.BAD_REQUEST else None
        return cls(status, exc.message, code=exc.code.value, param=param, headers=headers)

    @property
    def type(self) -> str:
        """OpenAI's error type for the status."""
        if self.status == HTTPStatus.TOO_MANY_REQUESTS:
            return "rate_limit_error"
        if self.status >= HTTPStatus.INTERNAL_SERVER_ERROR:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``: the reply body, and the data of an error stream event."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def response(self, extra_headers: dict[str, str] | None = None) -> Response:
        """The JSON reply."""
        return Response(msgspec.json.encode(self.body()), status_code=self.status,
                        media_type="application/json",
                        headers={**self.headers, **(extra_headers or {})})


def field_of(message: str) -> str | None:
    """The field a msgspec validation message is about (``None`` when it names none)."""
    found = _FIELD_PATH.search(message)
    return (found.group(1) or None) if found else None


async def http_exception_handler(_: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    status = HTTPStatus(exc.status_code)
    code = "not_found" if status == HTTPStatus.NOT_FOUND else status.phrase.lower().replace(
        " ", "_")
    return ApiError(status, str(exc.detail), code=code).response(dict(exc.headers or {}))


def check_model(name: str | None, served_name: str) -> None:
    """Refuse (404) a request naming a model other than the served one; none named is
    the served one."""
    if name and name != served_name:
        raise ApiError(HTTPStatus.NOT_FOUND,
                       f"the model {name!r} does not exist; this server serves "
                       f"{served_name!r}", code="model_not_found", param="model")
