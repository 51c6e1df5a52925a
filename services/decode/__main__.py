"""``python -m services.decode``: one decode worker until SIGTERM/SIGINT."""

from cpd.protocol.roles import Role
from services.worker import run_worker

if __name__ == "__main__":
    run_worker(Role.DECODE)
