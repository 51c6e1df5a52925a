"""How long an engine step takes on a modelled GPU node (docs/architecture.md, "Engines").

Pure functions of public hardware and model figures; no I/O, no clock. The simulated
engine (:mod:`cpd.engines.sim.engine`) turns these simulated seconds into wall time through its
own ``time_scale``; the cost model knows nothing about wall time.

Model
-----
One engine spans ``gpus`` GPUs. A step runs a batch of prefill chunks and decodes; its
time is a roofline over the whole batch plus a fixed per-step overhead::

    step = overhead + max(flops / (gpus · peak · mfu),  bytes / (gpus · hbm · hbm_eff))
    flops = 2 · P · tokens  +  4 · L · q_dim · attended_pairs          (attention at
            its own efficiency, see below)
    bytes = weights read per GPU · gpus  +  KV bytes of every attended context token

``attended_pairs`` for a chunk of ``n`` new tokens after ``c`` cached ones is
``n·c + n²/2`` (causal); for a decode it is its context length. Prefill is compute-bound
for any chunk longer than a few hundred tokens, so prefill time is then exactly the
router's form (``services/router/cost.py``)::

    prefill(n, c) = overhead + per_token · n + per_token_ctx · (n·c + n²/2)

with ``per_token = 2P / (gpus · peak · mfu)`` and
``per_token_ctx = 4 · L · q_dim / (gpus · peak · attn_eff)``. A decode step is
bandwidth-bound: ``overhead + (weights + KV of all contexts) / bandwidth``.

Moving KV between the engine and the host-DRAM arena costs
``bytes / (gpus · host_link · efficiency)`` (each GPU moves its own TP shard), charged
inside the step that loads or saves, as CPD's vLLM connector does (loads in
``start_load_kv``, saves in ``wait_for_save``).

Sources (public figures; see docs/sim.md for the derivation and the checks)
---------------------------------------------------------------------------
* NVIDIA HGX B200 (1000 W): 2.25 PFLOPS dense BF16, 4.5 PFLOPS dense FP8, 8 TB/s HBM3e,
  180 GB per GPU in HGX systems (192 GB package). NVIDIA HGX/DGX B200 datasheets;
  e.g. glennklockwood.com/garden/processors/B200 (HGX 1000 W table).
* NVIDIA H200 SXM: 989 TFLOPS dense BF16, 1979 dense FP8, 4.8 TB/s, 141 GB.
  NVIDIA H200 datasheet; MLPerf Inference v4.1 system description (141 GB HBM3e).
* Host link: PCIe Gen5 x16 to the host (DGX/HGX B200 and H200 both use Gen5 hosts),
  64 GB/s per direction, ~55 GB/s achieved with pinned memory (assumption: 85 %).
* Model shapes: Llama-3.1-8B (32 layers, 4096 hidden, 8 KV heads × 128, 8.03 B params)
  and Llama-3.1-70B (80 layers, 8192 hidden, 8 KV heads × 128, 70.6 B params), from
  their published ``config.json``.
* Efficiency: ``mfu`` 0.5 for the GEMMs of a TP4 prefill (dense GEMMs reach 60-70 % of
  peak on Hopper/Blackwell; TP all-reduces cost ~10-15 %), ``attn_eff`` 0.45 (FlashAttention
  forward kernels reach 50-75 % of peak), ``hbm_eff`` 0.8 for decode. The anchor check:
  NVIDIA's GH200 NVL32 blog (Llama-3.1-70B, 32,768-token input, TTFT 472 ms on 32
  GH200, TensorRT-LLM FP8) implies 6.0e15 FLOP / 0.472 s / 32 GPUs = 0.20 of FP8 peak
  at 32-way parallelism; :data:`ANCHORS` holds it and the tests check the model against it.
* Operating point: the paper does not name its model. At 4×B200 TP4 prefill nodes a
  2P1D plain-PD setup saturating at 0.75-0.8 QPS/GPU on a coding-agent mix of
  45K-200K-token contexts needs ~0.13 s of prefill per request, i.e. an 8B-class
  per-token cost (a 70B-class model, even in FP8, saturates near 0.1 QPS/GPU on the same
  workload). So the preset closest to the paper is :data:`B200_TP4_8B`;
  :data:`B200_TP4_70B_FP8` is there for sensitivity runs. docs/sim.md gives the analytic
  check (``tests/test_sim_analysis.py`` runs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9
TB = 1e12
TFLOPS = 1e12
KIB = 1024

# Attention: QKᵀ and PV are each one multiply-add (2 FLOP) per (query, key, q-dim).
ATTN_FLOPS_PER_PAIR_PER_QDIM = 4
# A dense matmul costs 2 FLOP per parameter per token.
LINEAR_FLOPS_PER_PARAM = 2
# K and V.
KV_TENSORS = 2


@dataclass(frozen=True)
class Hardware:
    """One GPU's public figures."""

    name: str
    bf16_tflops: float       # dense tensor-core peak
    fp8_tflops: float
    hbm_tb_s: float
    hbm_gb: float
    host_link_gb_s: float    # achieved host<->device bandwidth, one direction

    def peak_flops(self, dtype_bytes: int) -> float:
        """Dense peak for the weights' dtype (FP8 = 1 byte, BF16 = 2 bytes)."""
        return (self.fp8_tflops if dtype_bytes == 1 else self.bf16_tflops) * TFLOPS


# Achieved PCIe Gen5 x16 (64 GB/s per direction) with pinned buffers.
PCIE5_ACHIEVED_GB_S = 55.0

B200 = Hardware("B200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_tb_s=8.0, hbm_gb=180.0,
                host_link_gb_s=PCIE5_ACHIEVED_GB_S)
H200 = Hardware("H200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tb_s=4.8, hbm_gb=141.0,
                host_link_gb_s=PCIE5_ACHIEVED_GB_S)
GH200 = Hardware("GH200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tb_s=4.0, hbm_gb=96.0,
                 host_link_gb_s=450.0)  # NVLink-C2C; only used for the anchor check


@dataclass(frozen=True)
class ModelShape:
    """The figures of a dense decoder that set its cost."""

    name: str
    params: float
    layers: int
    q_dim: int               # attention heads × head dim
    kv_heads: int
    head_dim: int
    weight_bytes: int = 2    # per parameter (2 = BF16, 1 = FP8)
    kv_bytes: int = 2        # per KV element

    @property
    def kv_bytes_per_token(self) -> int:
        """layers × (K, V) × KV heads × head dim × bytes."""
        return self.layers * KV_TENSORS * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def linear_flops_per_token(self) -> float:
        return LINEAR_FLOPS_PER_PARAM * self.params

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs for one (new token, attended token) pair, over all layers."""
        return ATTN_FLOPS_PER_PAIR_PER_QDIM * self.layers * self.q_dim

    def with_dtype(self, weight_bytes: int, kv_bytes: int) -> ModelShape:
        """The same shape at another precision (named ``-fp8`` for FP8 weights and KV,
        ``-fp8kv`` for an FP8 KV cache next to BF16 weights)."""
        suffix = ("-fp8" if weight_bytes == 1 else "-fp8kv" if kv_bytes == 1 else "")
        return ModelShape(self.name + suffix, self.params, self.layers, self.q_dim,
                          self.kv_heads, self.head_dim, weight_bytes, kv_bytes)


LLAMA_8B = ModelShape("llama-3.1-8b", params=8.03e9, layers=32, q_dim=4096, kv_heads=8,
                      head_dim=128)
LLAMA_70B = ModelShape("llama-3.1-70b", params=70.6e9, layers=80, q_dim=8192, kv_heads=8,
                       head_dim=128)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a well-tuned engine achieves (assumptions, see module doc)."""

    mfu: float = 0.5          # GEMMs of a TP prefill, all-reduce included
    attn_eff: float = 0.45    # FlashAttention forward
    hbm_eff: float = 0.8      # decode streaming reads
    gpu_mem_util: float = 0.9  # vLLM's gpu_memory_utilization
    step_overhead_s: float = 0.002  # schedule + launch + TP latency per step


@dataclass(frozen=True)
class CostModel:
    """Step-time coefficients of one engine (all in simulated seconds)."""

    name: str
    gpus: int
    overhead_s: float
    per_token_s: float           # linear layers, per new token
    per_pair_s: float            # attention, per (new token, attended token) pair
    weight_read_s: float         # one pass over the weights (per decode step)
    per_kv_token_read_s: float   # reading one context token's KV in a decode step
    kv_bytes_per_token: int
    host_link_bytes_s: float     # engine <-> host arena, all GPUs together
    kv_capacity_tokens: int      # engine's own paged cache (GPU)

    # ------------------------------------------------------------------ prefill

    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` after ``context_tokens`` cached ones, alone in
        one step. Compute-bound (exactly the router's linear + quadratic form) for chunks
        of more than ~300 tokens; a tiny chunk costs at least one pass over the weights."""
        if new_tokens <= 0:
            return 0.0
        return self.step_s([(new_tokens, context_tokens)])

    def prefill_coefficients_ms(self) -> tuple[float, float, float]:
        """(fixed_ms, per_token_ms, per_token_ctx_ms) for the router's ``PrefillCost``."""
        return self.overhead_s * 1e3, self.per_token_s * 1e3, self.per_pair_s * 1e3

    def prefill_tokens_per_s(self, context_tokens: int = 0, chunk: int = 8192) -> float:
        """Steady prefill throughput in chunks of ``chunk`` tokens at a given context."""
        return chunk / self.prefill_s(chunk, context_tokens)

    # ------------------------------------------------------------------- decode

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences attending ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return self.step_s((), batch, context_tokens)

    # --------------------------------------------------------------- mixed step

    def step_s(self, chunks: Sequence[tuple[int, int]], decodes: int = 0,
               decode_context: int = 0) -> float:
        """A mixed step: prefill ``chunks`` as (new tokens, cached context) and
        ``decodes`` sequences with ``decode_context`` context tokens in total."""
        tokens = decodes + sum(n for n, _ in chunks)
        if tokens <= 0:
            return 0.0
        pairs = decode_context + sum(_pairs(n, c) for n, c in chunks)
        kv_read = decode_context + sum(c + n for n, c in chunks)
        compute = self._compute_s(tokens, pairs)
        memory = self.weight_read_s + self.per_kv_token_read_s * kv_read
        return self.overhead_s + max(compute, memory)

    def _compute_s(self, tokens: int, pairs: float) -> float:
        return self.per_token_s * tokens + self.per_pair_s * pairs

    # ---------------------------------------------------------------- KV moves

    def kv_move_s(self, tokens: int) -> float:
        """Copy ``tokens`` tokens of KV between the engine and the host arena."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_s


def _pairs(new: int, ctx: int) -> float:
    """(query, key) pairs of a causal chunk of ``new`` tokens after ``ctx`` tokens."""
    return new * ctx + new * new / 2


def derive(hw: Hardware, model: ModelShape, gpus: int, *, data_parallel: bool = False,
           eff: Efficiency | None = None, name: str | None = None) -> CostModel:
    """Coefficients from public figures. ``data_parallel`` models a DP (attention-
    sharded) decode node: every GPU reads the whole weights, KV is spread over GPUs."""
    e = eff or Efficiency()
    peak = hw.peak_flops(model.weight_bytes) * gpus
    weights = model.params * model.weight_bytes
    bw = hw.hbm_tb_s * TB * e.hbm_eff  # per GPU
    weights_per_gpu = weights if data_parallel else weights / gpus
    kv_budget = hw.hbm_gb * GB * gpus * e.gpu_mem_util - weights * (gpus if data_parallel
                                                                      else 1)
    return CostModel(
        name=name or f"{hw.name.lower()}-{'dp' if data_parallel else 'tp'}{gpus}-{model.name}",
        gpus=gpus,
        overhead_s=e.step_overhead_s,
        per_token_s=model.linear_flops_per_token / (peak * e.mfu),
        per_pair_s=model.attn_flops_per_pair / (peak * e.attn_eff),
        weight_read_s=weights_per_gpu / bw,
        per_kv_token_read_s=model.kv_bytes_per_token / (bw * gpus),
        kv_bytes_per_token=model.kv_bytes_per_token,
        host_link_bytes_s=hw.host_link_gb_s * GB * gpus,
        kv_capacity_tokens=max(0, int(kv_budget // model.kv_bytes_per_token)),
    )


PAPER_GPUS_PER_NODE = 4

B200_TP4_8B = derive(B200, LLAMA_8B, PAPER_GPUS_PER_NODE)
"""The paper's operating point: 8B-class BF16 on a 4×B200 TP4 node (default preset)."""
B200_DP4_8B = derive(B200, LLAMA_8B, PAPER_GPUS_PER_NODE, data_parallel=True)
"""The paper's decode node: 4×B200, data parallel with attention sharding."""
B200_TP4_8B_FP8KV = derive(B200, LLAMA_8B.with_dtype(2, 1), PAPER_GPUS_PER_NODE)
"""The same node with an FP8 KV cache (half the KV bytes: decode reads, transfers)."""
B200_DP4_8B_FP8KV = derive(B200, LLAMA_8B.with_dtype(2, 1), PAPER_GPUS_PER_NODE,
                           data_parallel=True)
"""The paper's decode node with an FP8 KV cache."""
B200_TP4_8B_FP8 = derive(B200, LLAMA_8B.with_dtype(1, 1), PAPER_GPUS_PER_NODE)
"""The same node serving the model in FP8 (weights, activations and KV cache), as
B200 deployments of 8B-class models commonly do: GEMMs and attention run at the FP8
peak, so prefill takes half the time; KV bytes halve as with ``-fp8kv``."""
B200_DP4_8B_FP8 = derive(B200, LLAMA_8B.with_dtype(1, 1), PAPER_GPUS_PER_NODE,
                         data_parallel=True)
"""The paper's decode node serving the FP8 model."""
B200_TP4_70B_FP8 = derive(B200, LLAMA_70B.with_dtype(1, 1), PAPER_GPUS_PER_NODE)
"""A 70B-class FP8 model on 4×B200 TP4 (sensitivity runs)."""
H200_TP4_8B = derive(H200, LLAMA_8B, PAPER_GPUS_PER_NODE)
H200_TP4_70B_FP8 = derive(H200, LLAMA_70B.with_dtype(1, 1), PAPER_GPUS_PER_NODE)

PRESETS: dict[str, CostModel] = {m.name: m for m in (
    B200_TP4_8B, B200_DP4_8B, B200_TP4_8B_FP8KV, B200_DP4_8B_FP8KV, B200_TP4_8B_FP8,
    B200_DP4_8B_FP8, B200_TP4_70B_FP8, H200_TP4_8B, H200_TP4_70B_FP8)}
DEFAULT_PRESET = B200_TP4_8B.name


def preset(name: str) -> CostModel:
    """A named preset (``KeyError`` lists the known names)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown cost preset {name!r}; known: {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class Anchor:
    """A published measurement the model's assumptions must roughly reproduce."""

    source: str
    model: CostModel
    new_tokens: int
    seconds: float
    tolerance: float  # relative


# GH200 NVL32 at 32-way parallelism loses most of its per-GPU efficiency to
# communication; the blog's TTFT implies ~0.2 of FP8 peak (module doc). Modelled with
# that efficiency, the anchor pins the FLOP accounting (linear + causal attention).
_NVL32_EFF = Efficiency(mfu=0.2, attn_eff=0.2)
ANCHORS: tuple[Anchor, ...] = (
    Anchor("NVIDIA blog 'Low latency inference chapter 2: GH200 NVL32', Llama-3.1-70B "
           "FP8, 32,768-token input, TTFT 472 ms on 32 GH200",
           derive(GH200, LLAMA_70B.with_dtype(1, 1), 32, eff=_NVL32_EFF),
           new_tokens=32_768, seconds=0.472, tolerance=0.15),
)
