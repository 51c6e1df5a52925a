"""``python -m services.prefill``: one prefill worker until SIGTERM/SIGINT."""

from cpd.worker import run_worker

if __name__ == "__main__":
    run_worker("prefill")
