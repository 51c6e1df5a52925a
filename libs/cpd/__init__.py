"""CPD: cache-aware prefill/decode disaggregation for long-context LLM serving.

The shared library of every CPD service. Modules, one concept each:

* :mod:`cpd.wire` - every NATS message (msgspec structs), encode/decode
* :mod:`cpd.subjects` - every subject, stream and queue group
* :mod:`cpd.config` - typed settings (file, environment, overrides)
* :mod:`cpd.errors` - typed errors with stable codes
* :mod:`cpd.hashing` - cache namespaces and chained block hashes
* :mod:`cpd.bus` - NATS client, streaming request/reply, service base
* :mod:`cpd.telemetry` - structlog, OpenTelemetry traces and metrics
* :mod:`cpd.natsserver` - the embedded ``nats-server``
* :mod:`cpd.modelbuild` - the locally built model
"""

from .config import Settings, load_settings
from .errors import CpdError, ErrorCode
from .hashing import Namespace, block_hashes

__version__ = "0.1.0"

__all__ = ["CpdError", "ErrorCode", "Namespace", "Settings", "__version__", "block_hashes",
           "load_settings"]
