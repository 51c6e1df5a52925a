"""``python -m services.frontend``: run the gateway, a router and (``frontend.kvindex``) a
kvindex replica in one process until SIGTERM/SIGINT."""

from cpd.ops.config import load_settings
from services.frontend.process import serve

if __name__ == "__main__":
    serve(load_settings())
