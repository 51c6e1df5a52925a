"""What vLLM-CPU needs of the processor: its FP8 KV cache runs only on x86 with AVX-512
or AMX, so a worker refuses an FP8 ``engine.kv_cache_dtype`` on a CPU without either at
start, in words and with a typed error, not with the engine core's crash."""

from __future__ import annotations

from collections.abc import Iterable

from cpd.protocol.errors import ConfigError

FP8_KV_FLAGS = frozenset({"avx512f", "amx_tile"})
"""CPU flags of which vLLM-CPU's FP8 KV cache needs one."""

_CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags in ``/proc/cpuinfo`` (or in ``cpuinfo``'s text);
    empty where there is none."""
    if cpuinfo is None:
        try:
            with open(_CPUINFO) as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def fp8_kv_supported(flags: Iterable[str]) -> bool:
    """Whether vLLM-CPU can keep an FP8 KV cache on a CPU with ``flags``."""
    return not FP8_KV_FLAGS.isdisjoint(flags)


def check_kv_cache_dtype(kv_cache_dtype: str, flags: Iterable[str]) -> None:
    """Raise :class:`~cpd.protocol.errors.ConfigError` for an FP8 KV cache on a CPU
    without AVX-512 or AMX."""
    if kv_cache_dtype.startswith("fp8") and not fp8_kv_supported(flags):
        raise ConfigError(f"engine.kv_cache_dtype={kv_cache_dtype!r} needs a CPU with "
                          f"AVX-512 or AMX (vLLM-CPU's FP8 KV cache); this one has "
                          f"neither: use 'auto' or 'bfloat16'")


__all__ = ["FP8_KV_FLAGS", "check_kv_cache_dtype", "cpu_flags", "fp8_kv_supported"]
