"""A vLLM scheduler that can end a run as soon as its output's text is whole.

A prefill node samples a request's first token and hands the rest to a decode node.
Byte-level BPE splits multi-byte UTF-8 characters over tokens, and when the first token
ends inside one the client has no text until the next token comes. Sampling that token
in the same engine run costs one decode step. A new run costs a prefill of the prompt's
last, partial block (the engine's prefix cache keeps only full blocks), and stopping a
longer run once the text is whole is an abort, which returns none of the connector's
figures (``kv_transfer_params``: vLLM returns them only with a run that finished).

So a run that asks for it (``SamplingParams.extra_args[WHOLE_TEXT_KEY]``) ends, with
finish reason ``length``, after the first token whose text ends a character, or at its
``max_tokens``. Stop checks run in the engine core's scheduler; this adds that one there,
through vLLM's ``scheduler_cls`` engine argument: the class vLLM would use (its
asynchronous scheduler where vLLM schedules asynchronously) with the check after vLLM's
own. A token ends a character when, decoded alone, its text does not end in U+FFFD (the
replacement of an incomplete UTF-8 sequence), as the workers' detokenizer tells
(:class:`cpd.engines.servedmodel.Detokenizer`). A token of continuation bytes only
cannot tell alone and counts as not ending one (the run samples one token more than
needed, at most up to ``max_tokens``). Without a tokenizer every token counts as whole.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

WHOLE_TEXT_KEY = "cpd_until_whole_text"
"""``SamplingParams.extra_args`` key: end the run once its output's text is whole."""

FQCN = "cpd.engines.vllm.wholetext.WholeTextScheduler"
"""How the engine arguments name the scheduler (``scheduler_cls``)."""

log = logging.getLogger(__name__)


def whole_text_tokens(tokenizer_file: Path, vocab_size: int) -> bytes:
    """Per token id below ``vocab_size``: 1 when its text ends a character, 0 when it
    ends inside one. Ids the tokenizer does not know count as whole."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    known = min(tok.get_vocab_size(with_added_tokens=True), vocab_size)
    texts = tok.decode_batch([[i] for i in range(known)], skip_special_tokens=True)
    out = bytearray(b"\x01" * vocab_size)
    for i, text in enumerate(texts):
        if text.endswith("\ufffd"):
            out[i] = 0
    return bytes(out)


def _table(vllm_config: Any) -> bytes | None:
    """The model's :func:`whole_text_tokens`, or ``None`` (every token whole) without a
    ``tokenizer.json``."""
    model = vllm_config.model_config
    path = Path(str(model.tokenizer or model.model)) / "tokenizer.json"
    if not path.is_file():
        log.warning("no %s: runs asked to end at whole text end after one token", path)
        return None
    return whole_text_tokens(path, model.get_vocab_size())


class _WholeText:
    """The whole-text stop, mixed in front of one of vLLM's scheduler classes. It reads a
    step's last token: a prefill's run samples one a step (no speculative tokens)."""

    _whole: bytes | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._whole = _table(kwargs["vllm_config"])

    def _update_request_with_output(self, request: Any, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        new_token_ids, stopped = super()._update_request_with_output(  # type: ignore[misc]
            request, new_token_ids, is_stale)
        sp = request.sampling_params
        if (stopped or not new_token_ids or sp is None
                or not (sp.extra_args or {}).get(WHOLE_TEXT_KEY)):
            return new_token_ids, stopped
        last = new_token_ids[-1]
        if self._whole is None or last >= len(self._whole) or self._whole[last]:
            from vllm.v1.request import RequestStatus

            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return new_token_ids, True
        return new_token_ids, False


_CLASSES: dict[type, type] = {}


class WholeTextScheduler:
    """Built as vLLM's own scheduler class with the whole-text stop in front: the
    asynchronous one where ``scheduler_config.async_scheduling`` is on, else the plain
    one (vLLM decides that setting before it builds the scheduler)."""

    def __new__(cls, *args: Any, vllm_config: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        if base not in _CLASSES:
            _CLASSES[base] = type(f"WholeText{base.__name__}", (_WholeText, base), {})
        return _CLASSES[base](*args, vllm_config=vllm_config, **kwargs)
