"""The one worker base of the pre-prefill, prefill and decode services: ``service``
(the process and its handlers), ``arena``, ``peers``, ``loader`` and ``load``."""

from services.worker.service import WorkerService, run_worker

__all__ = ["WorkerService", "run_worker"]
