"""The one native extension, ``cpd._hashchain`` (chained block hashes; see
``native/hashchain.c``). Everything else about the package is in pyproject.toml.

BLAKE3's SIMD code is the upstream C implementation vendored in ``native/blake3``
(CC0-1.0 OR Apache-2.0; version in ``blake3.h``). Its build choices follow upstream's
Python binding: the x86-64 assembly on Unix (the C compiler assembles ``.S`` files
given as extra objects), NEON on AArch64, portable C elsewhere; the best SIMD variant is
picked at run time from the CPU's features.
"""

from __future__ import annotations

import platform
import sys

from setuptools import Extension, setup

_B3 = "native/blake3"


def _hashchain() -> Extension:
    sources = ["native/hashchain.c", f"{_B3}/blake3.c", f"{_B3}/blake3_dispatch.c",
               f"{_B3}/blake3_portable.c"]
    extra_objects: list[str] = []
    macros: list[tuple[str, str | None]] = []
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64") and sys.maxsize > 2**32 and sys.platform != "win32":
        extra_objects = [f"{_B3}/blake3_{isa}_x86-64_unix.S"
                         for isa in ("sse2", "sse41", "avx2", "avx512")]
    elif machine in ("aarch64", "arm64"):
        sources.append(f"{_B3}/blake3_neon.c")
    else:
        macros = [(f"BLAKE3_NO_{isa}", "1") for isa in ("SSE2", "SSE41", "AVX2", "AVX512")]
    return Extension("cpd._hashchain", sources=sources, include_dirs=[_B3],
                     extra_objects=extra_objects, define_macros=macros,
                     extra_compile_args=["-O3"] if sys.platform != "win32" else [])


setup(ext_modules=[_hashchain()])
