"""``cpd images build``: the CPD container images (``Dockerfile``'s targets) built with
podman on a Debian base built here (``mmdebstrap`` → ``podman import``), for hosts that
cannot pull from a public container registry.

Tags are fixed (``cpd-control:latest``, ...) and rebuilt in place; the layers below the
dependency install are reused while ``pyproject.toml`` does not change, and pip's
downloads are kept in ``~/.cache/cpd/pip`` between builds. Layers a rebuild replaced are
pruned.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cpd.protocol.errors import CpdError

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"control": "cpd-control:latest", "worker-cpu": "cpd-worker-cpu:latest",
           "worker-cuda": "cpd-worker-cuda:latest"}
"""Image of each buildable name: ``control``, or the ``worker`` target with ``EXTRA``
``cpu`` or ``gpu`` (:data:`STAGES`)."""
STAGES = {"control": ("control", ""), "worker-cpu": ("worker", "cpu"),
          "worker-cuda": ("worker", "gpu")}
BASE_RELEASE = "bookworm"  # Debian 12: Python 3.11
BASE_TAG = f"cpd-base:{BASE_RELEASE}"
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "ca-certificates", "libnuma1",
                 "gcc", "libc6-dev")
PIP_CACHE = Path("~/.cache/cpd/pip").expanduser()


def _run(args: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise CpdError(f"{' '.join(args[:3])} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout)[-3000:]}")
    return done


def podman() -> str:
    """The podman binary (Debian's ``podman`` package)."""
    found = shutil.which("podman")
    if not found:
        raise CpdError("podman is not installed (Debian: apt-get install podman runc)")
    return found


def image_exists(tag: str) -> bool:
    return subprocess.run([podman(), "image", "exists", tag]).returncode == 0


def ensure_base(tag: str = BASE_TAG) -> str:
    """A Debian base image with Python, built once with mmdebstrap and kept."""
    if image_exists(tag):
        return tag
    if not shutil.which("mmdebstrap"):
        raise CpdError("mmdebstrap is not installed (Debian: apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(prefix="cpd-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _run(["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
              BASE_RELEASE, str(rootfs)])
        _run([podman(), "import", "--change", 'CMD ["/bin/bash"]', str(rootfs), tag])
    return tag


def _pip_options() -> tuple[list[str], list[str]]:
    """Build arguments and volumes that give the build this host's pip access: its
    wheel folders, its CA bundle, its extra index, and a download cache kept here."""
    args: list[str] = []
    volumes = [f"{PIP_CACHE}:/root/.cache/pip"]
    links = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir()]
    if Path("/opt/wheels").is_dir() and "/opt/wheels" not in links:
        links.append("/opt/wheels")
    inside = []
    for i, folder in enumerate(links):
        volumes.append(f"{folder}:/run/wheels/{i}:ro")
        inside.append(f"/run/wheels/{i}")
    if inside:
        args += ["--build-arg", f"PIP_FIND_LINKS={' '.join(inside)}"]
    cert = os.environ.get("PIP_CERT", "")
    if cert and Path(cert).is_file():
        volumes.append(f"{cert}:/run/pip-ca.crt:ro")
        args += ["--build-arg", "PIP_CERT=/run/pip-ca.crt"]
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        if value := os.environ.get(name):
            args += ["--build-arg", f"{name}={value}"]
    return args, volumes


def build(targets: Sequence[str] = ("control", "worker-cpu"), *, base: str = "") -> dict:
    """Build ``targets`` (fixed tags, in place); returns seconds per target."""
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise CpdError(f"unknown image targets {sorted(unknown)}; known: {sorted(TARGETS)}")
    base = base or ensure_base()
    PIP_CACHE.mkdir(parents=True, exist_ok=True)
    args, volumes = _pip_options()
    took = {}
    for target in targets:
        t0 = time.monotonic()
        stage, extra = STAGES[target]
        _run([podman(), "build", "--network", "host", "--target", stage, "--tag",
              TARGETS[target], "--build-arg", f"BASE={base}",
              *(["--build-arg", f"EXTRA={extra}"] if extra else []), *args,
              *(x for v in volumes for x in ("--volume", v)), str(ROOT)])
        took[target] = round(time.monotonic() - t0, 1)
    # Layers that the rebuilt tags no longer use.
    subprocess.run([podman(), "image", "prune", "-f"], capture_output=True)
    return took
