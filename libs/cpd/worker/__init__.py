"""The one worker base of the pre-prefill, prefill and decode services."""

from .service import WorkerService, run_worker

__all__ = ["WorkerService", "run_worker"]
