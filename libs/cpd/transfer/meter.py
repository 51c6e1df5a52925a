"""What the data plane measures: the achieved bandwidth the router's load-vs-recompute
estimate uses, and the transfer metrics."""

from __future__ import annotations

from cpd.ops import metrics, telemetry


class BandwidthMeter:
    """Exponentially weighted achieved transfer bandwidth of this worker.

    The router's load-vs-recompute estimate uses it (``LoadReport.kv_bandwidth_gbps``).
    Transfers under ``min_bytes`` are counted but do not move the estimate: they measure
    latency, not bandwidth. A transfer that stalls until its deadline moves it down
    (:meth:`stalled`): a link that stops moving bytes must make loading look as slow as
    it is, not keep the estimate of the transfers before it.
    """

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1 << 20) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self._gbps = 0.0
        self.samples = 0
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.stalls = 0

    def record(self, nbytes: int, seconds: float) -> None:
        """Account one finished transfer of ``nbytes`` that took ``seconds``."""
        self.total_bytes += nbytes
        self.total_seconds += seconds
        if nbytes < self.min_bytes or seconds <= 0:
            return
        sample = nbytes / seconds / 1e9
        self._gbps = sample if not self.samples else (
            self.alpha * sample + (1 - self.alpha) * self._gbps)
        self.samples += 1

    def stalled(self, nbytes: int, seconds: float) -> None:
        """Account a transfer of ``nbytes`` still unfinished after ``seconds`` (it missed
        its deadline). It moved at most ``nbytes / seconds``: that bound is a sample
        when it is below the estimate (whatever its size: a stall is not latency), and
        is ignored when above. Its bytes do not count as moved."""
        self.stalls += 1
        if seconds <= 0:
            return
        bound = nbytes / seconds / 1e9
        if not self.samples:
            self._gbps = bound
        elif bound < self._gbps:
            self._gbps = self.alpha * bound + (1 - self.alpha) * self._gbps
        else:
            return
        self.samples += 1

    @property
    def gbps(self) -> float:
        """Current estimate in GB/s (10^9 bytes/s); 0.0 until a large transfer finished."""
        return self._gbps


class TransferMetrics:
    def __init__(self) -> None:
        m = telemetry.meter("cpd.transfer")
        self.bytes = metrics.counter(m, metrics.KV_TRANSFER)
        self.transfers = metrics.counter(m, metrics.KV_TRANSFERS)
        self.seconds = metrics.histogram(m, metrics.KV_TRANSFER_DURATION)
        self.denied = metrics.counter(m, metrics.KV_CAPABILITY_DENIED)

    def done(self, op: str, outcome: str, nbytes: int, seconds: float) -> None:
        attrs = {"op": op, "outcome": outcome}
        self.transfers.add(1, attrs)
        if nbytes:
            self.bytes.add(nbytes, {"op": op})
        self.seconds.record(seconds, attrs)


