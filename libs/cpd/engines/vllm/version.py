"""Which vLLM the connector runs against: it reaches into vLLM's scheduler, cache layout
and KV connector interface, which change between minor versions, so a worker refuses,
at start and in words, a vLLM other than the one the project tests (the ``cpu`` and
``gpu`` extras pin it too)."""

from __future__ import annotations

from cpd.protocol.errors import ConfigError

TESTED = "0.32"
"""The vLLM minor version the connector is tested against (``major.minor``)."""

OVERRIDE = "worker.allow_untested_vllm"
"""The setting that lets a worker start on another vLLM anyway."""


def check_vllm_version(installed: str, *, allow_untested: bool = False) -> None:
    """Raise :class:`~cpd.protocol.errors.ConfigError` unless ``installed`` (e.g.
    ``"0.32.0"``, ``"0.32.1+cpu"``) is a release of :data:`TESTED`, or ``allow_untested``."""
    minor = ".".join(installed.split("+", 1)[0].split(".")[:2])
    if minor == TESTED or allow_untested:
        return
    raise ConfigError(f"vLLM {installed} is installed; CPD's KV connector is tested against "
                      f"vLLM {TESTED}.x (pip install 'cpd[cpu]' or 'cpd[gpu]' installs it). "
                      f"Set {OVERRIDE} = true to start on {installed} anyway.")
