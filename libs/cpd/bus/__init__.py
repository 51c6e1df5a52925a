"""The bus: NATS with CPD's rules (docs/architecture.md, "Subjects").

* :func:`connect` - a client that reconnects forever and logs its state changes.
* :class:`Bus` - typed publish / request / *streaming* request over that client:
  messages are :mod:`cpd.protocol.wire` structs, W3C trace context rides in the headers, every
  message passes a header-aware size guard, no-responders (503) and timeouts become
  :mod:`cpd.protocol.errors` exceptions, and a ``wire.Error`` reply is raised as one.
* :class:`ReplyStream` - the sending half of a streamed reply: sequence numbers and an
  explicit final or error message, after which nothing more can be sent.
* :class:`KeepAlives` - one ticker keeping a service's open streams from going silent.
* :class:`LocalHub` - the services of one process reach each other without NATS.
* :class:`Service` - base of every CPD service: endpoints (queue groups, concurrent
  handlers, typed errors for bad input), NATS micro health/info/stats
  (``$SRV.PING|INFO|STATS``), and a graceful start, drain and stop on SIGTERM/SIGINT.
"""

from .connection import connect, flush_all, identity_options, permission_denials, wait_denied
from .keepalive import KeepAlives
from .local import LocalHub
from .replymux import ReplyMux
from .request import Bus, encoded_size
from .service import BAD_INPUT, EXIT_REFUSED, Handler, Request, Service, run_service
from .stream import ReplyStream, StreamReader

__all__ = ["BAD_INPUT", "EXIT_REFUSED", "Bus", "Handler", "KeepAlives", "LocalHub", "ReplyMux",
           "ReplyStream", "Request", "Service", "StreamReader", "connect", "encoded_size",
           "flush_all", "identity_options", "permission_denials", "run_service",
           "wait_denied"]
