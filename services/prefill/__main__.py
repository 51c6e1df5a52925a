"""``python -m services.prefill``: one prefill worker until SIGTERM/SIGINT."""

from cpd.protocol.roles import Role
from services.worker import run_worker

if __name__ == "__main__":
    run_worker(Role.PREFILL)
