"""Typed errors shared by every CPD service and client.

Each error has a stable ``code`` (what goes on the wire in :class:`cpd.protocol.wire.Error`) and a
``retryable`` flag, so a client can decide what to do without parsing messages.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Stable error codes carried by ``wire.Error.code``."""

    MALFORMED = "malformed"
    SCHEMA_VERSION = "schema_version"
    UNKNOWN_KIND = "unknown_kind"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_NAMESPACE = "unknown_namespace"
    PROMPT_TOO_LONG = "prompt_too_long"
    NO_RESPONDERS = "no_responders"
    TIMEOUT = "timeout"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    PEER_GONE = "peer_gone"
    BLOCK_EVICTED = "block_evicted"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    STREAM_GAP = "stream_gap"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    CONFIG = "config"
    NATS_REFUSED = "nats_refused"
    CAPABILITY_DENIED = "capability_denied"
    FORGED_SENDER = "forged_sender"


class CpdError(Exception):
    """Base class of every error CPD raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL
    retryable: bool = False
    # The node the error is about when it is not the one reporting it (the decode node
    # that refused a prefill node's hand-off): the one a retry routes around.
    node: str = ""

    def __init__(self, message: str = "", *, code: ErrorCode | None = None,
                 retryable: bool | None = None, node: str = "") -> None:
        super().__init__(message or self.__class__.__name__)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        if node:
            self.node = node

    @property
    def message(self) -> str:
        return str(self)


class MalformedMessage(CpdError):
    """Bytes that do not decode into the expected message."""

    code = ErrorCode.MALFORMED


class SchemaVersionError(CpdError):
    """A message whose schema major version this process does not speak."""

    code = ErrorCode.SCHEMA_VERSION


class UnknownKind(CpdError):
    """A well-formed message of a kind this process does not know (skip it)."""

    code = ErrorCode.UNKNOWN_KIND


class PayloadTooLarge(CpdError):
    """A message (payload plus headers) over the bus limit; KV bytes never go over NATS."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class InvalidRequest(CpdError):
    """A request that decoded but breaks a rule (bad sampling values, empty prompt...)."""

    code = ErrorCode.INVALID_REQUEST


class NoResponders(CpdError):
    """Nobody subscribes to the subject (NATS status 503)."""

    code = ErrorCode.NO_RESPONDERS
    retryable = True


class RequestTimeout(CpdError):
    """No (further) reply arrived before the deadline."""

    code = ErrorCode.TIMEOUT
    retryable = True


class Overloaded(CpdError):
    """Admission control refused the request; try again later."""

    code = ErrorCode.OVERLOADED
    retryable = True


class StreamGap(CpdError):
    """A streamed reply skipped a sequence number: part of the stream was lost."""

    code = ErrorCode.STREAM_GAP
    retryable = True


class Unavailable(CpdError):
    """A needed service or capacity is not there right now; retry later."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class DeadlineExceeded(CpdError):
    """The request's own deadline passed before it finished (queued or running)."""

    code = ErrorCode.DEADLINE_EXCEEDED


class Cancelled(CpdError):
    """The request was cancelled, e.g. by a service that is stopping; retry elsewhere."""

    code = ErrorCode.CANCELLED
    retryable = True


class ConfigError(CpdError):
    """Settings that fail validation; the message names the offending setting."""

    code = ErrorCode.CONFIG


class RemoteError(CpdError):
    """An error reported by a remote service through a ``wire.Error`` message."""

    def __init__(self, code: ErrorCode | str, message: str, retryable: bool = False) -> None:
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INTERNAL
        super().__init__(message, code=code, retryable=retryable)





class WrongKind(CpdError):
    """A valid message of a kind this endpoint does not accept."""

    code = ErrorCode.INVALID_REQUEST


class PromptTooLong(CpdError):
    """A prompt longer than the model's limit."""

    code = ErrorCode.PROMPT_TOO_LONG


class UnknownNamespace(CpdError):
    """A namespace nobody serves (unknown model, revision or layout)."""

    code = ErrorCode.UNKNOWN_NAMESPACE


# --------------------------------------------------------------------------- data plane


class PeerGone(CpdError):
    """The peer of a KV transfer died, closed or cannot be reached (UCX endpoint error)."""

    code = ErrorCode.PEER_GONE
    retryable = True


class BlockEvicted(CpdError):
    """A requested block is not (or no longer) sealed in the store that was asked for it."""

    code = ErrorCode.BLOCK_EVICTED


class ChecksumMismatch(CpdError):
    """Block bytes whose xxh3-64 differs from the checksum recorded when it was sealed."""

    code = ErrorCode.CHECKSUM_MISMATCH


class TransferTimeout(RequestTimeout):
    """A KV transfer missed its deadline (a paused or overloaded peer); it was aborted."""


class ArenaFull(CpdError):
    """The block arena has no free slot and nothing evictable (everything pinned or in use)."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class CapabilityDenied(CpdError):
    """A data-plane request without a valid capability for the blocks' namespace at that
    node (a guessed hash, a capability of another node, namespace or incarnation). No
    bytes were sent; the puller recomputes as for any other load error."""

    code = ErrorCode.CAPABILITY_DENIED


class ForgedSender(CpdError):
    """A message names another node than the one whose subject it was published on
    (only that node's credentials may publish there): it is dropped and counted, never
    applied."""

    code = ErrorCode.FORGED_SENDER


class NatsRefused(CpdError):
    """NATS refused this process (cpd.ops.security): retrying with the same settings cannot
    help, so services exit instead of restarting in a loop."""

    code = ErrorCode.NATS_REFUSED


class NatsAuthFailed(NatsRefused):
    """The server refused this process's credentials or TLS set-up; the message names
    the ``nats.*`` setting to fix."""


class PermissionDenied(NatsRefused):
    """The server refused a publish or subscribe: this process holds the credentials of
    an identity whose permissions do not cover its job."""


class RouterGone(Unavailable):
    """The router serving a stream stopped sending anything, keep-alives included, for
    several keep-alive intervals: it died or is cut off. Nothing more will come on this
    stream; retrying goes to a live router replica."""


# Built last so every class above can be in it; one class per code (the most general).
_BY_CODE: dict[ErrorCode, type[CpdError]] = {
    cls.code: cls
    for cls in (MalformedMessage, SchemaVersionError, UnknownKind, PayloadTooLarge,
                NoResponders, RequestTimeout, Overloaded, StreamGap, ConfigError,
                PromptTooLong, UnknownNamespace, InvalidRequest, PeerGone, BlockEvicted,
                ChecksumMismatch, Unavailable, DeadlineExceeded, Cancelled,
                CapabilityDenied, ForgedSender)
}


def error_from_wire(code: str, message: str, retryable: bool, node: str = "") -> CpdError:
    """Rebuild the most specific local exception for an error received over the wire
    (``node``: the node it is about, when not its sender)."""
    try:
        cls = _BY_CODE.get(ErrorCode(code))
    except ValueError:
        cls = None
    err = RemoteError(code, message, retryable) if cls is None else cls(message,
                                                                         retryable=retryable)
    err.node = node
    return err
