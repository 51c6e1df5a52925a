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

from cpd.modelbuild import RECIPE_VERSION, build, tokenizer_hash
from cpd.ops.config import Settings
from cpd.protocol.errors import InvalidRequest, PromptTooLong
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
    special_tokens: dict[str, str]
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
            model_id=name, model_revision=f"r{RECIPE_VERSION}",
            tokenizer_hash=tokenizer_hash(folder), kv_dtype=s.model.dtype,
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
                   chat_template=tok_cfg.get("chat_template"),
                   special_tokens={k: v for k, v in tok_cfg.items()
                                   if k.endswith("_token") and isinstance(v, str)})

    def namespace_for(self, tenant: str = "default", cache_salt: str = "") -> Namespace:
        """The cache namespace of one tenant: the default tenant without a salt shares the
        base namespace (the engines' own prefix caches use it); any other tenant or salt
        gets blocks nobody else can match."""
        if tenant == "default" and not cache_salt:
            return self.namespace
        return self.namespace.with_salt(tenant, cache_salt)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if not self.has_tokenizer:
            raise InvalidRequest(f"{self.name} has no tokenizer: send token ids, not text")
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

    def check_prompt(self, tokens: np.ndarray, max_tokens: int) -> None:
        """Refuse, typed, a prompt no engine of this model can run: empty, a token id
        outside the vocabulary, or ``max_tokens`` more that do not fit the context."""
        if not tokens.size:
            raise InvalidRequest("empty prompt")
        self.check_vocab(tokens)
        if self.max_model_len and tokens.size + max_tokens > self.max_model_len:
            raise PromptTooLong(f"{tokens.size} prompt + {max_tokens} new tokens exceed "
                                f"the model's {self.max_model_len}")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added: the locally built models add
        none, and a chat template places its own)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one generated stream (text stays empty
        without a tokenizer)."""
        return Detokenizer(self.tokenizer if self.has_tokenizer else None)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a chat: the model's own template when it has one."""
        return _render_template(self.chat_template or FALLBACK_CHAT_TEMPLATE, messages,
                                self.special_tokens)


class Detokenizer:
    """Text of a token stream as it grows, without ever emitting half a character.

    Byte-level BPE tokens can split a UTF-8 character; decoding each token alone would
    emit replacement characters. As vLLM does, decode a small window of earlier tokens
    with the new ones and emit only the text that is complete and new.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of what was emitted

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
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        now = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


def _render_template(template: str, messages: list[dict[str, str]],
                     special_tokens: dict[str, str]) -> str:
    """Render a Hugging Face chat template as ``transformers`` does: sandboxed (templates
    come with model files), with the special tokens and ``raise_exception`` it expects."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
