"""The gateway's endpoints besides generation: the model, its tokenizer and the process.

``GET /v1/models`` (the one served model); ``POST /tokenize`` and ``POST /detokenize``
(vLLM's); ``GET /version``; ``GET /health`` (liveness: the process serves), ``GET /ready``
(NATS connected, a router answering, kvindex up, a live prefill-side and decode worker);
``GET /metrics`` (Prometheus text of this process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import cpd
from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.protocol.errors import CpdError
from cpd.protocol.roles import PREFILL_ROLES
from services.gateway import protocol
from services.gateway.calls import OWNER
from services.gateway.errors import ApiError, check_model
from services.gateway.replies import json_response

HEALTH_TIMEOUT_S = 1.0
"""How long ``/ready`` waits for a router's status reply."""

# A request needs a node of each kind to run: a prefill side (warm or cold) and decode.
_NEEDED_ROLES: dict[str, set[str]] = {"prefill": set(PREFILL_ROLES), "decode": {"decode"}}


class OpsRoutes:
    """The handlers of the model, tokenizer, version, health and metrics endpoints."""

    def __init__(self, client: Client, model: ServedModel, served_name: str,
                 started: int) -> None:
        self.client = client
        self.model = model
        self.served_name = served_name
        self.started = started

    async def models(self) -> Response:
        """The one served model."""
        card = {"id": self.served_name, "object": "model", "created": self.started,
                "owned_by": OWNER, "root": self.model.name,
                "max_model_len": self.model.max_model_len}
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        """The token ids CPD computes for a prompt (``prompt``) or a chat
        (``messages``), as vLLM's ``/tokenize`` answers."""
        return await _answer(self._tokenize(await request.body()))

    async def _tokenize(self, raw: bytes) -> dict[str, Any]:
        body = protocol.decode_tokenize(raw)
        check_model(body.model, self.served_name)
        if body.messages is not None:
            text, special = protocol.chat_prompt(body.chat(), self.model), False
        elif body.prompt is not None:
            text, special = body.prompt, True
        else:
            raise ApiError.invalid("give a prompt or messages", param="prompt")
        # vLLM's defaults: a prompt's special tokens added, a chat's not.
        if body.add_special_tokens is not None:
            special = body.add_special_tokens
        ids = await asyncio.to_thread(self.model.encode, text, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids, as vLLM's ``/detokenize`` answers."""
        return await _answer(self._detokenize(await request.body()))

    async def _detokenize(self, raw: bytes) -> dict[str, Any]:
        body = protocol.decode_detokenize(raw)
        check_model(body.model, self.served_name)
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < (
                self.model.vocab_size):
            raise ApiError.invalid(f"token ids must lie in [0, {self.model.vocab_size})",
                                   param="tokens")
        return {"prompt": await asyncio.to_thread(self.model.decode, body.tokens)}

    async def version(self) -> Response:
        """CPD's version."""
        return json_response({"version": cpd.__version__})

    async def health(self) -> Response:
        """Liveness: 200 while this process serves HTTP (NATS connected or not: a probe
        that restarted the gateway over a bus outage would not help it), with the bus
        state in the body."""
        return json_response({"status": "ok",
                              "nats_connected": self.client.bus.nc.is_connected})

    async def ready(self) -> Response:
        """Readiness: 200 when NATS is connected, a router answers, kvindex is up and
        the router knows a live worker of each kind a request needs (a prefill side and
        a decode node); else 503 with the reason. The body counts the live workers."""
        if not self.client.bus.nc.is_connected:
            return _unhealthy("not connected to NATS")
        try:
            status = await self.client.status(timeout_s=HEALTH_TIMEOUT_S)
        except CpdError as e:
            return _unhealthy(f"no router answered: {e.message}")
        alive = {n.role for n in status.nodes if n.alive}
        missing = [kind for kind, roles in _NEEDED_ROLES.items() if not alive & roles]
        if not status.kvindex.serving:
            return _unhealthy(f"kvindex is {status.kvindex}")
        if missing:
            return _unhealthy(f"no live {' or '.join(missing)} worker")
        return json_response({"status": "ready",
                              "workers": sum(n.alive for n in status.nodes)})

    async def prometheus(self) -> Response:
        """This process's metrics in Prometheus text format."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _answer(reply: Awaitable[dict[str, Any]]) -> Response:
    """The JSON of ``reply``, or the OpenAI-style error it raised."""
    try:
        return json_response(await reply)
    except ApiError as e:
        return e.response()
    except CpdError as e:
        return ApiError.from_cpd(e).response()


def _unhealthy(reason: str) -> Response:
    return json_response({"status": "unavailable", "reason": reason},
                         status=HTTPStatus.SERVICE_UNAVAILABLE)
