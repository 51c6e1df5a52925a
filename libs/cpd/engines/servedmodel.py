"""The model a CPD cluster serves, as every process needs to know it: where its files are,
its cache namespace (docs/architecture.md, "Block identity"), its limits, and its tokenizer.

Workers, the router and the gateway all derive these from the same settings, so the
router's block hashes match the workers' and a request that does not fit the model is
refused at the door, before any node spends time on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from cpd.modelbuild import build, tokenizer_hash, weights_revision
from cpd.ops.config import Settings
from cpd.protocol import wire
from cpd.protocol.errors import ConfigError, InvalidRequest, PromptTooLong
from cpd.protocol.hashing import Namespace

# The chat template of a model that ships none (the locally built ones do not): plain
# role headers, "<|role|>\ncontent\n" per message, then the assistant's header. Public:
# other servers of the same model (the client benchmark's vLLM) are given the same one.
FALLBACK_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
                          "{% endif %}")


@dataclass(frozen=True)
class ServedModel:
    """One model folder and what follows from it."""

    folder: Path
    name: str
    namespace: Namespace
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    chat_template: str | None
    # False for the sim engine: token ids in, token ids out, no text.
    has_tokenizer: bool = True

    @classmethod
    def load(cls, settings: Settings, *, build_missing: bool = True) -> ServedModel:
        """The model folder of ``settings``: an explicit folder, else the preset (built
        when missing, deterministically). :func:`cpd.engines.profile.served_model` picks
        this or the sim engine's model."""
        s = settings
        if s.model.path:
            folder = Path(s.model.path)
        elif build_missing:
            folder = build(s.model.preset, s.model_cache_dir)
        else:
            from cpd.modelbuild import model_dir

            folder = model_dir(s.model_cache_dir, s.model.preset)
        name = folder.name if s.model.path else f"cpd-{s.model.preset}"
        namespace = Namespace(
            model_id=name, model_revision=_revision(s.model.revision, folder),
            tokenizer_hash=tokenizer_hash(folder), kv_dtype=s.kv_dtype,
            block_size=s.cache.block_size, adapter_id=s.cache.adapter_id,
            tenant_salt=s.cache.tenant_salt)
        cfg = _read_json(folder / "config.json")
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        # The engines' context: the model's own unless [engine] sets a shorter one.
        max_len = s.served_context(int(cfg.get("max_position_embeddings")
                                       or tok_cfg.get("model_max_length") or 0))
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(folder=folder, name=name, namespace=namespace, max_model_len=max_len,
                   vocab_size=int(cfg.get("vocab_size", 0)), eos_token_id=eos,
                   chat_template=tok_cfg.get("chat_template"))

    def namespace_for(self, tenant: str = "default", cache_salt: str = "") -> Namespace:
        """The cache namespace of one tenant: the default tenant without a salt shares the
        base namespace (the engines' own prefix caches use it); any other tenant or salt
        gets blocks nobody else can match."""
        if tenant == "default" and not cache_salt:
            return self.namespace
        return self.namespace.with_salt(tenant, cache_salt)

    def _need_tokenizer(self, instead: str) -> None:
        """Refuse, typed, what needs the tokenizer of a model that has none."""
        if not self.has_tokenizer:
            raise InvalidRequest(f"{self.name} has no tokenizer: {instead}")

    @cached_property
    def tokenizer(self) -> Tokenizer:
        self._need_tokenizer("send token ids, not text")
        return Tokenizer.from_file(str(self.folder / "tokenizer.json"))

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its longest vocabulary entry (a
        byte-level entry has a character per byte, so this bounds decoded text too)."""
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)),
                   default=0)

    def surely_too_long(self, text: str) -> bool:
        """Whether ``text`` cannot fit the context, known without tokenizing it: more
        characters than ``max_model_len`` tokens of the longest entry cover. Tokenizing
        megabytes of one word takes seconds; this refuses it in nanoseconds."""
        return bool(self.max_model_len) and len(text) > self.max_model_len * max(
            self.max_token_chars, 1)

    def check_vocab(self, tokens: np.ndarray) -> None:
        """Refuse, typed, token ids past the vocabulary (an engine would index its
        embedding with them)."""
        if self.vocab_size and tokens.size and int(tokens.max()) >= self.vocab_size:
            raise InvalidRequest(f"token id {int(tokens.max())} is outside the "
                                 f"vocabulary of {self.vocab_size}")

    def check_prompt(self, tokens: np.ndarray, sampling: wire.SamplingParams) -> None:
        """Refuse, typed, a request no engine of this model can run: an empty prompt, a
        token id outside the vocabulary (in the prompt, ``stop_token_ids`` or
        ``logit_bias``), or ``max_tokens`` more that do not fit the context."""
        if not tokens.size:
            raise InvalidRequest("empty prompt")
        self.check_vocab(tokens)
        for what, ids in (("stop_token_ids", sampling.stop_token_ids),
                          ("logit_bias", list(sampling.logit_bias))):
            if self.vocab_size and ids and max(ids) >= self.vocab_size:
                raise InvalidRequest(f"{what}: token id {max(ids)} is outside the "
                                     f"vocabulary of {self.vocab_size}")
        max_tokens = sampling.max_tokens
        if self.max_model_len and tokens.size + max_tokens > self.max_model_len:
            raise PromptTooLong(f"{tokens.size} prompt + {max_tokens} new tokens exceed "
                                f"the model's {self.max_model_len}")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as vLLM's server makes them: a completion's prompt with
        the special tokens the tokenizer adds (a BOS, for most models), a rendered chat
        without (``add_special_tokens=False``: its template places its own).

        The ids of ``encode_batch_fast``: the same as ``encode``'s, without the character
        offsets nobody here reads (a quarter less time: 5.5 against 7.3 ms for 7K tokens
        on a two-core host)."""
        return self.tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, *, skip_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental detokenizer for one generated stream (text stays empty
        without a tokenizer)."""
        return Detokenizer(self.tokenizer if self.has_tokenizer else None,
                           skip_special_tokens=skip_special_tokens)

    @cached_property
    def chat_tokenizer(self) -> Any:
        """``transformers``' tokenizer of the folder, whose ``apply_chat_template``
        renders chats exactly as vLLM's server does (loading it takes seconds: a server
        loads it at start, :meth:`prepare_chat`)."""
        self._need_tokenizer("chats need one; send a completion's token ids")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.folder))

    def prepare_chat(self) -> None:
        """Load what rendering a chat needs, so the first chat request does not wait."""
        if self.has_tokenizer:
            self.render_chat([{"role": "user", "content": ""}])

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a chat: the model's own template (the fallback when it has
        none), rendered by ``transformers`` with the generation prompt, as vLLM does."""
        return self.chat_tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template or FALLBACK_CHAT_TEMPLATE,
            tokenize=False, add_generation_prompt=True)


class Detokenizer:
    """Text of a token stream as it grows, without ever emitting half a character.

    Byte-level BPE tokens can split a UTF-8 character; decoding each token alone would
    emit replacement characters. As vLLM does, decode a small window of earlier tokens
    with the new ones and emit only the text that is complete and new.
    """

    def __init__(self, tokenizer: Tokenizer | None, *, skip_special_tokens: bool = True
                 ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of what was emitted
        self._partial = False

    @property
    def incomplete(self) -> bool:
        """Whether the ids pushed so far end inside a character: their last bytes are
        held back until the ids that complete it come."""
        return self._partial

    def push(self, ids: list[int]) -> str:
        """Add generated ids; return the new complete text (may be empty)."""
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the stream (incomplete bytes included)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._tok is None:
            return ""
        skip = self._skip_special
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=skip)
        now = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=skip)
        self._partial = now.endswith("\ufffd") and not final
        if len(now) <= len(before) or self._partial:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


def _revision(configured: str, folder: Path) -> str:
    """The model revision of the namespace: the configured one, else the weights'
    fingerprint (a folder without weights needs one configured)."""
    if configured:
        return configured
    try:
        return weights_revision(folder)
    except FileNotFoundError as e:
        raise ConfigError(f"{e}: set model.revision to the revision the workers "
                          "serve (the same on every node)") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
