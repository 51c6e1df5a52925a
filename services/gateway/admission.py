"""What a generation request must pass before it goes to the router, and what it becomes.

Tenants (:mod:`services.gateway.tenants`): with ``gateway.tenants`` configured, a request
first needs a tenant's API key (401), then passes the tenant's rate limit (429 with
``Retry-After``), body size (413), prompt length and ``max_tokens`` cap (400); it goes to
the router as that tenant's, so its KV blocks stay in the tenant's own namespace.

A parsed body is checked against the served model (its name, its context) and tokenized
here, once: the router and the workers take the token ids.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus
from typing import NamedTuple

import msgspec
from fastapi import Request

from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.ops import telemetry
from cpd.protocol import wire
from cpd.protocol.errors import ErrorCode
from cpd.protocol.resume import resumed_tokens
from services.gateway import protocol
from services.gateway.calls import Outcomes
from services.gateway.errors import ApiError, check_model
from services.gateway.metrics import UNAUTHORIZED, UNKNOWN_TENANT
from services.gateway.ratelimit import RateLimiter, retry_after_header
from services.gateway.tenants import AuthError, Tenant, TenantTable

log = telemetry.get_logger("cpd.gateway")


class Admitted(NamedTuple):
    """A checked request: the router's request, and the prompt as the body gave it
    (text, or token ids), which ``echo`` sends back."""

    request: wire.GenerateRequest
    prompt: str | list[int]


class Admission:
    """Admits generation requests (tenant, rate, size, limits) and builds the router's
    request of each."""

    def __init__(self, client: Client, model: ServedModel, served_name: str,
                 timeout_s: float, tenants: TenantTable, outcomes: Outcomes, *,
                 tokenize_inline_chars: int) -> None:
        self.client = client
        self.tokenize_inline_chars = tokenize_inline_chars
        self.model = model
        self.served_name = served_name
        self.timeout_s = timeout_s
        self.tenants = tenants
        self.outcomes = outcomes
        self.limiter = RateLimiter(tenants.limits, time.monotonic)

    def admit(self, request: Request) -> Tenant:
        """The request's tenant, once its key, rate and declared size pass."""
        try:
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
        except AuthError:
            self.outcomes.rejected(UNKNOWN_TENANT, UNAUTHORIZED)
            raise
        wait_s = self.limiter.check(tenant.name)
        if wait_s > 0:
            self.outcomes.rejected(tenant.name, "rate_limited")
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS,
                           f"tenant {tenant.name!r} is over its request rate; retry in "
                           f"{wait_s:.2f} s", code="rate_limit_exceeded",
                           headers={"Retry-After": retry_after_header(wait_s)})
        declared = request.headers.get("content-length", "")
        if (tenant.max_request_bytes and declared.isdigit()
                and int(declared) > tenant.max_request_bytes):
            raise self.too_large(tenant, int(declared))  # refused before reading it
        return tenant

    def too_large(self, tenant: Tenant, nbytes: int) -> ApiError:
        """The 413 of a body of ``nbytes`` over the tenant's limit (counted as refused)."""
        self.outcomes.rejected(tenant.name, "request_too_large")
        return ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the request body has {nbytes} bytes; tenant {tenant.name!r} may "
                        f"send at most {tenant.max_request_bytes}",
                        code=ErrorCode.PAYLOAD_TOO_LARGE.value)

    async def wire_request(self, body: protocol.CompletionRequest | protocol.ChatRequest,
                           request_id: str, tenant: Tenant) -> Admitted:
        """Check a parsed body and turn it into the router's request."""
        check_model(body.model, self.served_name)
        protocol.refuse_unsupported(body)
        text_or_ids: str | list[int]
        if isinstance(body, protocol.ChatRequest):
            text_or_ids, param = protocol.chat_prompt(body, self.model), "messages"
            requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                         else body.max_tokens)
        else:
            text_or_ids, param = protocol.completion_prompt(body, self.model), "prompt"
            requested = body.max_tokens
        # The one tokenization of the request: the router and the workers take the ids.
        # As vLLM's server: a completion's text gets the tokenizer's special tokens (a
        # BOS), a chat's rendered text not (its template places them).
        if isinstance(text_or_ids, str) and self.model.surely_too_long(text_or_ids):
            raise ApiError.invalid(
                f"the prompt has {len(text_or_ids)} characters, more than this model's "
                f"context of {self.model.max_model_len} tokens can hold", param=param,
                code=ErrorCode.PROMPT_TOO_LONG.value)
        ids = (text_or_ids if isinstance(text_or_ids, list)
               else await self._encode(text_or_ids, special=param == "prompt"))
        self._check_length(len(ids))
        self._check_tenant_prompt(tenant, len(ids), param)
        explicit = requested is not None
        if requested is not None:
            max_tokens = requested
        elif param == "messages" and self.model.max_model_len:
            max_tokens = self.model.max_model_len - len(ids)  # what the context has left,
        else:                                              # as OpenAI and vLLM do
            max_tokens = protocol.DEFAULT_MAX_TOKENS
        max_tokens = self._cap_max_tokens(tenant, max_tokens, explicit)
        if body.min_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError.invalid(f"min_tokens ({body.min_tokens}) exceeds max_tokens "
                                   f"({max_tokens})", param="min_tokens")
        given = {**protocol.sampling_options(body), "cache_salt": body.cache_salt,
                 # vLLM serves lower values first; the router's admission, higher ones.
                 "priority": None if body.priority is None else -body.priority}
        if body.user:
            log.info("gateway.request_user", request_id=request_id, user=body.user[:256])
        temperature = (protocol.DEFAULT_TEMPERATURE if body.temperature is None
                       else body.temperature)
        req = self.client.request(
            ids, max_tokens=max_tokens, temperature=temperature, model=self.model.name,
            timeout_s=self.timeout_s, request_id=request_id, tenant=tenant.name,
            **{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
        if (resume := body.cpd_resume) is not None:
            req = msgspec.structs.replace(req, resume_tokens=wire.pack_tokens(resume.token_ids),
                                          resume_text_chars=resume.text_chars)
            # Checked here, as the router would, before anything acts on it: a resume
            # ends the request's earlier streams.
            resumed_tokens(req, self.model.check_vocab)
        return Admitted(req, text_or_ids)

    async def _encode(self, text: str, *, special: bool) -> list[int]:
        """``text``'s token ids: on the loop when short, else on a thread
        (``gateway.tokenize_inline_chars``)."""
        if len(text) <= self.tokenize_inline_chars:
            return self.model.encode(text, add_special_tokens=special)
        return await asyncio.to_thread(self.model.encode, text, add_special_tokens=special)

    def _tenant_limit(self, tenant: Tenant, reason: str, message: str,
                      param: str) -> ApiError:
        self.outcomes.rejected(tenant.name, reason)
        return ApiError.invalid(message, param=param,
                                code=(ErrorCode.PROMPT_TOO_LONG.value
                                      if reason == "prompt_too_long"
                                      else ErrorCode.INVALID_REQUEST.value))

    def _check_tenant_prompt(self, tenant: Tenant, prompt_tokens: int, param: str) -> None:
        limit = tenant.max_prompt_tokens
        if limit and prompt_tokens > limit:
            raise self._tenant_limit(
                tenant, "prompt_too_long",
                f"the prompt has {prompt_tokens} tokens; tenant {tenant.name!r} may send "
                f"at most {limit}", param)

    def _cap_max_tokens(self, tenant: Tenant, max_tokens: int, explicit: bool) -> int:
        cap = tenant.max_tokens
        if not cap or max_tokens <= cap:
            return max_tokens
        if explicit:
            raise self._tenant_limit(
                tenant, "max_tokens",
                f"max_tokens {max_tokens} exceeds tenant {tenant.name!r}'s cap of {cap}",
                "max_tokens")
        return cap  # a default (not asked for) is clamped, never refused

    def _check_length(self, prompt_tokens: int) -> None:
        limit = self.model.max_model_len
        if limit and prompt_tokens >= limit:
            raise ApiError.invalid(
                f"the prompt has {prompt_tokens} tokens; this model's context is {limit} "
                "tokens, prompt and completion together", param="prompt",
                code=ErrorCode.PROMPT_TOO_LONG.value)
