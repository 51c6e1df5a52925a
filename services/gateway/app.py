"""The gateway's HTTP API: OpenAI-compatible completions over the CPD client.

* ``POST /v1/completions`` and ``POST /v1/chat/completions``
  (:mod:`services.gateway.completions`): one prompt each (chats are rendered with the
  model's template), whole replies or SSE streams (:mod:`services.gateway.streaming`).
  Replies carry an extra top-level ``cpd`` field (in a stream: on the chunk with the
  finish reason) with the request id, the route the router took and its timings.
* ``GET /v1/models``; ``POST /tokenize`` and ``POST /detokenize`` (vLLM's); ``GET
  /version``; ``GET /health`` (liveness: the process serves), ``GET /ready`` (NATS
  connected, a router answering, kvindex up, a live prefill-side and decode worker);
  ``GET /metrics`` (Prometheus text of this process) (:mod:`services.gateway.ops`);
  ``GET /openapi.json`` and ``GET /docs`` (the schema and its page).

Tenants' keys and limits are checked by :mod:`services.gateway.admission`; every
endpoint's errors are OpenAI's error objects (:mod:`services.gateway.errors`).
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from starlette.exceptions import HTTPException

import cpd
from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import Settings
from services.gateway.admission import Admission
from services.gateway.calls import Outcomes
from services.gateway.completions import CompletionRoutes
from services.gateway.errors import http_exception_handler
from services.gateway.metrics import GatewayMetrics
from services.gateway.ops import OpsRoutes
from services.gateway.streaming import SseStreamer
from services.gateway.tenants import TenantTable

__all__ = ["create_app"]


def create_app(client: Client, model: ServedModel, settings: Settings) -> FastAPI:
    """The gateway's FastAPI application, sending requests through ``client``."""
    generation, ops = _routes(client, model, settings)
    app = FastAPI(title="CPD gateway", version=cpd.__version__,
                  description="OpenAI-compatible API of CPD (docs/architecture.md, "
                              "\"Services\")", redoc_url=None)
    app.add_api_route("/v1/completions", generation.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", generation.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", ops.models, methods=["GET"])
    app.add_api_route("/tokenize", ops.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", ops.detokenize, methods=["POST"])
    app.add_api_route("/version", ops.version, methods=["GET"])
    app.add_api_route("/health", ops.health, methods=["GET"])
    app.add_api_route("/ready", ops.ready, methods=["GET"])
    app.add_api_route("/metrics", ops.prometheus, methods=["GET"])
    app.add_exception_handler(HTTPException, http_exception_handler)
    return app


def _routes(client: Client, model: ServedModel, settings: Settings
            ) -> tuple[CompletionRoutes, OpsRoutes]:
    """The endpoint handlers, sharing the gateway's tenants, metrics and settings."""
    config = settings.gateway
    served_name = config.served_model_name or model.name
    started = int(time.time())
    tenants = TenantTable.from_settings(config)
    outcomes = Outcomes(GatewayMetrics(tenants=config.tenants))
    admission = Admission(client, model, served_name, config.request_timeout_s, tenants,
                          outcomes, tokenize_inline_chars=config.tokenize_inline_chars)
    streamer = SseStreamer(outcomes, served_name, config.sse_keepalive_s)
    generation = CompletionRoutes(client, admission, outcomes, streamer,
                                  config.stream_headers_after_s)
    return generation, OpsRoutes(client, model, served_name, started)
