"""Deterministic random weights for a Llama-family model.

Values come from BLAKE3's extendable output keyed by (seed, tensor name), mapped to a
uniform distribution with the wanted standard deviation: the same bytes on every
machine and numpy version, with no RNG stream-compatibility caveats.
"""

from __future__ import annotations

import math

import blake3
import numpy as np

_CONTEXT = "cpd.v1 2026-11 local model weights"


def uniform_tensor(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """A float32 tensor of ``shape`` with mean 0 and standard deviation ``std``."""
    n = math.prod(shape)
    key = blake3.blake3(f"{seed}".encode(), derive_key_context=_CONTEXT).digest()
    raw = blake3.blake3(name.encode(), key=key).digest(length=4 * n)
    u = np.frombuffer(raw, dtype="<u4")
    # 24 high bits → exact float32 in [0, 1); then to [-a, a) with a = sqrt(3) * std.
    unit = (u >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    a = np.float32(math.sqrt(3.0) * std)
    return ((unit * np.float32(2.0) - np.float32(1.0)) * a).reshape(shape)


def llama_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """All tensors of a ``LlamaForCausalLM`` checkpoint for config ``cfg``."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["head_dim"]
    t: dict[str, np.ndarray] = {
        # Unit-scale embeddings; every projection std 1/sqrt(fan_in) keeps activations O(1).
        "model.embed_tokens.weight": uniform_tensor(seed, "embed", (vocab, h), 1.0),
        "model.norm.weight": np.ones(h, dtype=np.float32),
        # A wide lm_head spreads the logits (std ~2.5) so greedy choices have clear
        # margins: the end-to-end token-identity tests depend on few near-ties.
        "lm_head.weight": uniform_tensor(seed, "lm_head", (vocab, h), 2.5 / math.sqrt(h)),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (heads * head_dim, h),
            "self_attn.k_proj": (kv_heads * head_dim, h),
            "self_attn.v_proj": (kv_heads * head_dim, h),
            "self_attn.o_proj": (h, heads * head_dim),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        for name, shape in shapes.items():
            t[f"{p}.{name}.weight"] = uniform_tensor(seed, f"{p}.{name}", shape,
                                                     1.0 / math.sqrt(shape[1]))
        t[f"{p}.input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    return t
