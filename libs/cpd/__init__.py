"""CPD: cache-aware prefill/decode disaggregation for long-context LLM serving.

The shared library of every CPD service, one folder per layer, bottom to top (lower layers
never import higher ones; docs/architecture.md, "Layers"):

* :mod:`cpd.protocol` - wire messages, subjects, errors, block identity, lifecycle, roles
* :mod:`cpd.modelbuild`, :mod:`cpd.sim` - the local model; the simulation models (pure)
* :mod:`cpd.ops` - settings, telemetry, the embedded NATS server, security, the audit log
* :mod:`cpd.bus` - NATS connection, typed request/reply, streams, the service base
* :mod:`cpd.kvstore`, :mod:`cpd.client` - the host-DRAM block store; the Python client
* :mod:`cpd.transfer` - the UCX data plane
* :mod:`cpd.engines` - the engine protocol and profile, vLLM and the sim engine
"""

__version__ = "0.1.0"
