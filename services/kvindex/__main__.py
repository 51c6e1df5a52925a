"""``python -m services.kvindex``: run one kvindex replica until SIGTERM/SIGINT."""

from cpd.ops.config import load_settings
from services.kvindex.service import serve

if __name__ == "__main__":
    serve(load_settings())
