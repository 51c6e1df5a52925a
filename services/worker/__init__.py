"""The one worker base of the pre-prefill, prefill and decode services."""

from services.worker.service import WorkerService, run_worker

__all__ = ["WorkerService", "run_worker"]
