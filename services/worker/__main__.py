"""``python -m services.worker``: one worker in the role of ``worker.role`` until
SIGTERM/SIGINT."""

from services.worker import run_worker

if __name__ == "__main__":
    run_worker()
