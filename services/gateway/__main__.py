"""``python -m services.gateway``: serve the OpenAI-compatible HTTP API until
SIGTERM/SIGINT (address in ``gateway.host``/``gateway.port``)."""

from cpd.ops.config import load_settings
from services.gateway.service import serve

if __name__ == "__main__":
    serve(load_settings())
