"""``cpd model build``: the small local Llama-family model every test and demo uses.

No model hub is reachable, so CPD builds its own: random weights (:mod:`.weights`), a
tokenizer trained on a committed corpus (:mod:`.tokenizer`), a standard HF config. Two
builds of one preset are byte-identical on every machine; vLLM loads the folder through
its normal loading code like any downloaded checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.numpy import save_file

from cpd.modelbuild.tokenizer import BOS, EOS, PAD, build_tokenizer
from cpd.modelbuild.weights import llama_weights

RECIPE_VERSION = 1
"""Bump when the recipe changes the bytes; the folder name carries it."""

MANIFEST = "cpd-build.json"


@dataclass(frozen=True)
class Preset:
    """Shape of a locally built model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tokenizer_vocab: int = 4096
    seed: int = 20261129

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V per token over all layers."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
                * dtype_bytes)


PRESETS: dict[str, Preset] = {
    # Starts in seconds on 2 CPU cores; still, an 8K prefill costs far more than moving
    # its 32 MiB of KV (docs/benchmarks/model.md has the measured ratio).
    "tiny": Preset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=768,
                   max_position_embeddings=8192),
    "small": Preset(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, intermediate_size=1536,
                    max_position_embeddings=32768),
}


def model_dir(cache_dir: str | os.PathLike[str], preset: str) -> Path:
    """Folder of a built preset inside ``cache_dir``."""
    return Path(cache_dir).expanduser() / f"cpd-{preset}-r{RECIPE_VERSION}"


def hf_config(p: Preset, vocab_size: int, specials: dict[str, int]) -> dict:
    """The ``config.json`` of a preset."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "max_position_embeddings": p.max_position_embeddings,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": specials[BOS],
        "eos_token_id": specials[EOS],
        "pad_token_id": specials[PAD],
    }


def build(preset: str, cache_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Build ``preset`` into ``cache_dir`` (no-op when an intact build exists)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    target = model_dir(cache_dir, preset)
    if not force and verify(target):
        return target
    p = PRESETS[preset]
    tok_json, specials = build_tokenizer(p.tokenizer_vocab)
    vocab_size = max(specials.values()) + 1
    cfg = hf_config(p, vocab_size, specials)
    files: dict[str, bytes] = {
        "config.json": _json(cfg),
        "generation_config.json": _json({"bos_token_id": specials[BOS],
                                         "eos_token_id": specials[EOS],
                                         "pad_token_id": specials[PAD]}),
        "tokenizer.json": tok_json.encode(),
        "tokenizer_config.json": _json({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "add_bos_token": False, "add_eos_token": False,
            "model_max_length": p.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        }),
        "special_tokens_map.json": _json({"bos_token": BOS, "eos_token": EOS,
                                          "pad_token": PAD}),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        save_file(llama_weights(cfg, p.seed), str(tmp / "model.safetensors"))
        digests = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_bytes(_json({"preset": preset, "recipe": RECIPE_VERSION,
                                            "config": asdict(p), "sha256": digests}))
        if verify(target):
            # Another process finished the same (byte-identical) build first: keep its
            # folder, which readers may already have open.
            shutil.rmtree(tmp)
            return target
        if target.exists():
            shutil.rmtree(target)
        # Atomic publish: a reader sees no folder or a complete one.
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def verify(folder: str | os.PathLike[str]) -> bool:
    """True when ``folder`` holds a complete build whose files match its manifest."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("recipe") != RECIPE_VERSION:
            return False
        return all(_sha256(folder / n) == d for n, d in manifest["sha256"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def tokenizer_hash(folder: str | os.PathLike[str]) -> str:
    """sha256 of ``tokenizer.json`` (part of the cache namespace)."""
    return _sha256(Path(folder) / "tokenizer.json")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files whose contents are a model's weights (the rest of a folder is configuration)."""

_SAMPLE_BYTES = 4 << 20


def weights_revision(folder: str | os.PathLike[str]) -> str:
    """A fingerprint of a model folder's weight files: the model revision in the cache
    namespace, so that retrained or swapped weights behind the same folder never reuse
    the old ones' KV. Each file's name and size and its first, middle and last 4 MiB
    (the whole of a smaller file) go in: milliseconds however large the model, and any
    retraining changes them. Raises ``FileNotFoundError`` when the folder holds no weight
    file (a node without the weights: set ``model.revision`` instead)."""
    files = sorted(p for p in Path(folder).iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {folder}")
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for start in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2),
                                 max(0, size - _SAMPLE_BYTES)}):
                f.seek(start)
                h.update(f.read(_SAMPLE_BYTES))
    return "w" + h.hexdigest()[:16]


def _json(obj: object) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
