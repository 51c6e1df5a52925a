"""``python -m services.router``: run one router replica until SIGTERM/SIGINT."""

from cpd.ops.config import load_settings
from services.router.service import serve

if __name__ == "__main__":
    serve(load_settings())
