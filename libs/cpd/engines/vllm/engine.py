"""The vLLM engine behind a CPD worker: ``AsyncLLM`` with CPD's KV connector.

Integrated through vLLM's extension points: engine arguments (the connector module path,
a logits processor, a scheduler class), and ``kv_transfer_params`` and ``extra_args`` on
each request. The scheduler class (:mod:`cpd.engines.vllm.wholetext`) overrides one
method of vLLM's scheduler, whose interface vLLM does not promise to keep; the engine
checks vLLM's version (:mod:`cpd.engines.vllm.version`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cpd.engines.protocol import ArenaSpec, EngineRequest, EngineStep
from cpd.engines.vllm.connector import PARAMS_KEY
from cpd.engines.vllm.cpu import check_kv_cache_dtype, cpu_flags
from cpd.engines.vllm.forced import FORCED_KEY, FQCN
from cpd.engines.vllm.version import check_vllm_version
from cpd.engines.vllm.wholetext import FQCN as WHOLE_TEXT_SCHEDULER
from cpd.engines.vllm.wholetext import WHOLE_TEXT_KEY
from cpd.modelbuild.runtime import engine_kwargs, engine_thread_env, prepare_cpu_env
from cpd.ops.config import EngineSettings
from cpd.protocol import wire
from cpd.protocol.errors import ConfigError


class VllmEngine:
    """One vLLM engine (its EngineCore runs in a child process)."""

    def __init__(self, model_dir: str | os.PathLike[str], *, block_size: int,
                 arena: ArenaSpec | None, dtype: str = "float32",
                 prefix_caching: bool = True, max_model_len: int | None = None,
                 kv_cache_gib: int = 1, kv_events_endpoint: str = "",
                 long_prefill_token_threshold: int = 0,
                 async_kv_load: bool = False, executor: str = "uni", threads: int = 0,
                 cpus: Sequence[int] = (), engine: EngineSettings | None = None,
                 metrics: bool = False, allow_untested_vllm: bool = False) -> None:
        self.model_dir = Path(model_dir)
        # "uni": the model runs in the engine-core process, which blocks on a socket when
        # idle; "mp": vLLM-CPU's worker process behind a shared-memory ring whose readers
        # spin a second after every message (docs/architecture.md, "Engines").
        if executor not in ("uni", "mp"):
            raise ValueError(f"unknown vLLM executor {executor!r}")
        # [engine] (one role's): vLLM's own arguments of the same names.
        self.engine = engine or EngineSettings()
        # Whether a run asked to (``EngineRequest.until_whole_text``) ends once its text
        # is whole: with CPD's scheduler class, not one the settings name. Read on every
        # prefill, so taken once from the settings.
        self.stops_at_whole_text = self.engine.vllm_args().get(
            "scheduler_cls", WHOLE_TEXT_SCHEDULER) == WHOLE_TEXT_SCHEDULER
        # An engine of several ranks runs one process per rank.
        self.executor = executor if self.engine.ranks == 1 else "mp"
        self.threads = threads
        self.cpus = tuple(cpus)
        if self.cpus and len(self.cpus) < self.engine.ranks:
            raise ConfigError(f"worker.engine_cpus gives {len(self.cpus)} CPUs to an engine "
                              f"of {self.engine.ranks} ranks: each rank needs at least one")
        # Arena loads off the step (the request waits in WAITING_FOR_REMOTE_KVS while the
        # batch runs; cpd.engines.vllm.connector) instead of inside the step that schedules it.
        self.async_kv_load = async_kv_load
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.block_size = block_size
        self.arena = arena
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self._max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        # Where vLLM publishes its KV cache events (ZMQ), for cpd.engines.vllm.gpu_events.
        self.kv_events_endpoint = kv_events_endpoint
        # vLLM's own vllm:* series, in prometheus_client's default registry (which the
        # worker exports next to CPD's); its log lines of stats stay off.
        self.metrics = metrics
        self.allow_untested_vllm = allow_untested_vllm
        self._llm: Any = None
        # The engine's ZMQ sockets: vLLM binds them in the temp folder and never unlinks
        # them, so each engine gets a folder of its own, removed when it stops.
        self._sockets: str | None = None
        self._rpc_path_before: str | None = None  # VLLM_RPC_BASE_PATH before start()

    @property
    def max_model_len(self) -> int:
        assert self._llm is not None, "start() first"
        return self._llm.vllm_config.model_config.max_model_len

    def engine_args(self) -> dict[str, Any]:
        """Arguments for ``AsyncEngineArgs`` (also used by the GPU check script)."""
        args = engine_kwargs(self.model_dir, dtype=self.dtype,
                             prefix_caching=self.prefix_caching,
                             max_model_len=self._max_model_len)
        args.update(self.engine.vllm_args())
        args["block_size"] = self.block_size
        # A decode node's continuation of a stream (cpd.engines.vllm.forced).
        args["logits_processors"] = [*args.get("logits_processors", ()), FQCN]
        # A prefill's run that ends once its text is whole (cpd.engines.vllm.wholetext),
        # unless the settings name a scheduler of their own.
        args.setdefault("scheduler_cls", WHOLE_TEXT_SCHEDULER)
        args["disable_log_stats"] = True
        args["distributed_executor_backend"] = self.executor
        if self.long_prefill_token_threshold:
            args["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        if self.arena is not None:
            from vllm.config import KVTransferConfig

            args["kv_transfer_config"] = KVTransferConfig(
                kv_connector="CpdConnector", kv_connector_module_path="cpd.engines.vllm.connector",
                kv_role="kv_both",
                # A block that fails its checksum is recomputed, never served or fatal.
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"arena_path": self.arena.path,
                                           "num_slots": self.arena.num_slots,
                                           "slot_bytes": self.arena.slot_bytes,
                                           "async_load": self.async_kv_load})
        if self.kv_events_endpoint:
            from vllm.config import KVEventsConfig

            args["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq",
                endpoint=self.kv_events_endpoint, topic="cpd")
        return args

    def process_env(self) -> dict[str, str]:
        """Environment the engine's processes start with: the executor and the OpenMP
        threads and binding (its child processes inherit them)."""
        env = engine_thread_env(self.threads, self.cpus)
        if self.executor == "uni":
            # vLLM-CPU replaces the "uni" executor by "mp" unless this is off; it only
            # concerns the engine core (AsyncLLM keeps the core in a process of its own).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = rank_cpus(self.cpus, self.engine.ranks)
        return env

    async def start(self) -> None:
        import vllm

        check_vllm_version(vllm.__version__, allow_untested=self.allow_untested_vllm)
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if cpu:
            check_kv_cache_dtype(self.engine.kv_cache_dtype, cpu_flags())
        prepare_cpu_env(self.kv_cache_gib, cpu=cpu)
        os.environ.update(self.process_env())
        self._rpc_path_before = os.environ.get(_RPC_PATH)
        self._sockets = _socket_folder()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loggers: list[Any] = []
        if self.metrics:
            from vllm.v1.metrics.loggers import PrometheusStatLogger

            loggers.append(PrometheusStatLogger)
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args()),
                                                  stat_loggers=loggers or None)
        except BaseException:
            await self.stop()
            raise

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        from vllm.inputs.engine import tokens_input

        # Rendered input (typed "token"): vLLM takes it as it is, where a raw prompt goes
        # through its renderer on a thread pool first (a thread hop per request).
        prompt = tokens_input(_token_list(request.tokens),
                              cache_salt=request.cache_salt or None)
        # Forced output tokens come back first: the caller has them already.
        skip = len(request.forced_output)
        async for out in self._llm.generate(
                prompt, _sampling_params(request, connector=self.arena is not None),
                request.request_id):
            comp = out.outputs[0] if out.outputs else None
            ids = list(comp.token_ids) if comp else []
            dropped = min(skip, len(ids))
            skip -= dropped
            step = EngineStep(token_ids=ids[dropped:],
                              logprobs=(_logprobs(comp.logprobs, ids, request.sampling.logprobs)
                                        [dropped:] if comp else []),
                              finished=out.finished,
                              finish_reason=comp.finish_reason if comp else None,
                              stop_token=(comp.stop_reason if comp and isinstance(
                                  comp.stop_reason, int) else None),
                              prompt_tokens=len(request.tokens),
                              cached_tokens=out.num_cached_tokens or 0)
            info = (out.kv_transfer_params or {}).get(PARAMS_KEY)
            if info:
                step.gpu_blocks = info.get("cached_blocks", 0)
                step.loaded_blocks = info.get("loaded_blocks", 0)
                step.failed_blocks = info.get("failed_blocks", 0)
                step.saved_blocks = info.get("saved_blocks", 0)
                step.scheduled_at = info.get("scheduled_at", 0.0)
                # vLLM counts the connector's matched tokens as cached when it schedules
                # them; blocks that then failed verification were computed after all.
                step.cached_tokens = max(
                    0, step.cached_tokens - step.failed_blocks * self.block_size)
            yield step

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        assert self._llm is not None, "start() first"
        return bool(await self._llm.reset_prefix_cache())

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None
            # Processes started from here on must not inherit the removed folder.
            if self._rpc_path_before is None:
                os.environ.pop(_RPC_PATH, None)
            else:
                os.environ[_RPC_PATH] = self._rpc_path_before


_RPC_PATH = "VLLM_RPC_BASE_PATH"
# A socket's path is <folder>/<uuid4>; a Unix socket address holds 107 characters.
_SOCKET_PATH_MAX = 107
_SOCKET_NAME = 37
_SOCKET_FOLDER = "cpd-vllm-"


def _socket_folder() -> str:
    """A new folder for the next engine's ZMQ sockets, through ``VLLM_RPC_BASE_PATH``:
    in the temp folder, or in ``/tmp`` when the temp folder is too deep for a socket's
    path to fit. An engine core that ran in this process froze vLLM's environment (its
    ``envs`` cache), which would keep an earlier engine's removed folder: the cache is
    cleared."""
    import vllm.envs

    base = tempfile.gettempdir()
    if len(base) + 1 + len(_SOCKET_FOLDER) + 8 + _SOCKET_NAME > _SOCKET_PATH_MAX:
        base = "/tmp"
    folder = tempfile.mkdtemp(prefix=_SOCKET_FOLDER, dir=base)
    os.environ[_RPC_PATH] = folder
    cached = getattr(vllm.envs.__getattr__, "cache_clear", None)
    if cached is not None:
        cached()
    return folder


def _sampling_params(request: EngineRequest, *, connector: bool) -> Any:
    """vLLM's ``SamplingParams`` for ``request`` (stop strings stay with the router);
    with CPD's ``connector``, its copies (every request: the connector also tells when
    the request was scheduled)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s: wire.SamplingParams = request.sampling
    extra: dict[str, Any] = {}
    if connector:
        extra["kv_transfer_params"] = {PARAMS_KEY: {
            "load": list(request.load_slots), "load_checksums": list(request.load_checksums),
            "save": list(request.save_slots)}}
    if request.forced_output:
        extra[FORCED_KEY] = _token_list(request.forced_output)
    if request.until_whole_text:
        extra[WHOLE_TEXT_KEY] = True
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        min_p=s.min_p, repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens, logit_bias=dict(s.logit_bias) or None,
        logprobs=s.logprobs, output_kind=RequestOutputKind.DELTA, extra_args=extra or None,
        # The router owns the text (and stop strings): vLLM's would be decoded for nothing.
        detokenize=False)


def _logprobs(per_token: Any, ids: list[int], k: int | None) -> list[wire.TokenLogprob]:
    """vLLM's log probabilities of ``ids`` (a dict per token: the ``k`` most likely
    tokens, and the token itself when it is not one of them) as the wire's."""
    if not per_token or k is None:
        return []
    out = []
    for token, entries in zip(ids, per_token, strict=True):
        own = entries[token]
        ranked = sorted(entries.items(), key=lambda te: te[1].rank)
        out.append(wire.TokenLogprob(
            logprob=own.logprob, rank=own.rank,
            top=[(t, e.logprob) for t, e in ranked if e.rank <= k]))
    return out


def rank_cpus(cpus: Sequence[int], ranks: int) -> str:
    """vLLM-CPU's ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks over ``cpus``: equal
    consecutive shares (the first ranks take one more where they do not divide), one
    ``|``-separated group per rank."""
    per, extra = divmod(len(cpus), ranks)
    groups, at = [], 0
    for r in range(ranks):
        n = per + (r < extra)
        groups.append(",".join(map(str, cpus[at:at + n])))
        at += n
    return "|".join(groups)


def _token_list(tokens: Sequence[int] | np.ndarray) -> list[int]:
    # vLLM wants Python ints; list() of a numpy array would give numpy scalars.
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
