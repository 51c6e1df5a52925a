"""What the data plane measures: the achieved bandwidth the router's load-vs-recompute
estimate uses, and the transfer metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from cpd.ops import metrics, telemetry


class BandwidthMeter:
    """Exponentially weighted achieved transfer bandwidth of this worker.

    The router's load-vs-recompute estimate uses it (``LoadReport.kv_bandwidth_gbps``).
    Transfers under ``min_bytes`` are counted but do not move the estimate: they measure
    latency, not bandwidth. A transfer that stalls until its deadline moves it down
    (:meth:`stalled`): a link that stops moving bytes must make loading look as slow as
    it is, not keep the estimate of the transfers before it.

    Two rules keep the estimate describing the link as it is now:

    * **A changed link.** ``SHIFT_RUN`` samples in a row below ``SHIFT_RATIO`` times the
      estimate (or above it divided by ``SHIFT_RATIO``) mean the link itself changed (a
      rate limit, a congested path, a link restored): the estimate restarts at their
      mean instead of taking dozens of transfers to get there at ``alpha``. One outlier
      still moves it by ``alpha`` only.
    * **An old estimate expires.** With no sample for ``max_age_s`` the estimate is 0
      (unknown), so the router prices loads at its configured default again and the next
      transfer measures afresh. Without it a node whose estimate fell would never pull
      again, and so never see its link recover.
    """

    SHIFT_RATIO = 0.25
    SHIFT_RUN = 2

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1 << 20, *,
                 max_age_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if max_age_s < 0:
            raise ValueError("max_age_s must be >= 0 (0: never expires)")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._gbps = 0.0
        self._at = 0.0
        self._run: list[float] = []   # the samples in a row on one side of the band
        self._run_side = 0            # -1 below, 1 above
        self._run_ref = 0.0           # the estimate when that run began
        self.samples = 0
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.stalls = 0
        self.shifts = 0

    def record(self, nbytes: int, seconds: float) -> None:
        """Account one finished transfer of ``nbytes`` that took ``seconds``."""
        self.total_bytes += nbytes
        self.total_seconds += seconds
        if nbytes < self.min_bytes or seconds <= 0:
            return
        self._sample(nbytes / seconds / 1e9)

    def stalled(self, nbytes: int, seconds: float) -> None:
        """Account a transfer of ``nbytes`` still unfinished after ``seconds`` (it missed
        its deadline). It moved at most ``nbytes / seconds``: that bound is a sample
        when it is below the estimate (whatever its size: a stall is not latency), and
        is ignored when above. Its bytes do not count as moved."""
        self.stalls += 1
        if seconds <= 0:
            return
        bound = nbytes / seconds / 1e9
        if self.gbps and bound >= self._gbps:
            return
        self._sample(bound)

    def _sample(self, gbps: float) -> None:
        self._expire()
        self._at = self._clock()
        if not self.samples:
            self._gbps, self.samples, self._run = gbps, 1, []
            return
        self.samples += 1
        # A run is judged against the estimate as it stood before the run began.
        side = self._side(gbps, self._run_ref if self._run else self._gbps)
        if self._run and side != self._run_side:  # in band, or the other side: it ended
            self._run = []
            side = self._side(gbps, self._gbps)
        if side:
            if not self._run:
                self._run_ref, self._run_side = self._gbps, side
            self._run.append(gbps)
            if len(self._run) >= self.SHIFT_RUN:
                self._gbps, self._run = sum(self._run) / len(self._run), []
                self.shifts += 1
                return
        self._gbps = self.alpha * gbps + (1 - self.alpha) * self._gbps

    def _side(self, gbps: float, ref: float) -> int:
        """-1 far below ``ref``, 1 far above it, 0 within the band."""
        if gbps < ref * self.SHIFT_RATIO:
            return -1
        return 1 if gbps * self.SHIFT_RATIO > ref else 0

    @property
    def gbps(self) -> float:
        """Current estimate in GB/s (10^9 bytes/s); 0.0 until a large transfer finished,
        and again once the last sample is older than ``max_age_s``."""
        self._expire()
        return self._gbps

    def _expire(self) -> None:
        if self.samples and self.max_age_s and self._clock() - self._at > self.max_age_s:
            self._gbps, self.samples, self._run = 0.0, 0, []


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


