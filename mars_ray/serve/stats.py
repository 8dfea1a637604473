"""What a replica's engine did recently: rates, latencies and totals, the same for either engine.

Both engines feed one `StatsRecorder` from their event loop (forwards with the tokens each row took,
first-token and inter-token times, how requests ended) and the replica reads `EngineStats` snapshots: the
tau controller, `/v1/status` and the replica autoscaling policy see the same figures whatever decodes.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mars_ray.serve.protocol import EngineMetrics


@dataclass(frozen=True)
class EngineStats:
    """A cheap snapshot of the replica: its operating point, its load and its recent speed and latency."""

    tau: float
    block_size: int
    waiting: int
    running: int
    max_batch_size: int
    tokens_per_s: float  # generated tokens over the last `window_s`
    forwards_per_s: float
    tokens_per_forward: float  # per row and forward, recent
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    window_s: float
    generated_tokens: int  # totals since start
    forward_passes: int
    finished: dict[str, int]  # requests by how they ended: stop, length, cancelled, error
    verify: bool = False  # the operating mode: verified decoding for greedy requests that do not choose


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class StatsRecorder:
    """Samples within the last `window_s` and totals since start. On the event loop only: the samples
    it trims are appended there."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._started = time.monotonic()
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, rows, tokens) within the window
        self._emitted: deque[tuple[float, int]] = deque()  # (time, tokens) streamed within the window
        self._ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # the most recent, within the window
        self._itl: deque[tuple[float, float]] = deque(maxlen=4096)
        self._generated = self._forwards = 0
        self._finished: Counter[str] = Counter()

    def forward(self, now: float, accepted: Sequence[int]) -> None:
        """One forward that gave these rows these many tokens each (their tokens also go through `tokens`)."""
        self._steps.append((now, len(accepted), sum(accepted)))
        self._forget_before(now - self.window_s)
        self._forwards += 1

    def tokens(
        self, now: float, arrived: float, last: float | None, count: int, metrics: EngineMetrics
    ) -> None:
        """A request's `count` new tokens at `now`: its time to first token (since `arrived`) if it had none
        before (`last` is None), else the time per token since its last ones at `last`. Both engines call
        this, so the window's latencies and the metrics' histograms are one measurement, and the tokens
        streamed (the window's tokens/s, the total generated) count as they reach the request."""
        self._emitted.append((now, count))
        self._forget_before(now - self.window_s)
        self._generated += count
        if last is None:
            self._ttft.append((now, now - arrived))
            metrics.first_token(now - arrived)
        elif count:
            self._itl.append((now, (now - last) / count))
            metrics.inter_token((now - last) / count)

    def ended(self, reason: str) -> None:
        self._finished[reason] += 1

    def snapshot(
        self, tau: float, block_size: int, verify: bool, waiting: int, running: int, max_batch_size: int
    ) -> EngineStats:
        now = time.monotonic()
        self._forget_before(now - self.window_s)
        span = min(self.window_s, now - self._started) or 1.0
        rows = sum(r for _, r, _ in self._steps)
        tokens = sum(t for _, _, t in self._steps)
        emitted = sum(t for _, t in self._emitted)
        ttft, itl = [v for _, v in self._ttft], [v for _, v in self._itl]
        return EngineStats(
            tau=tau,
            block_size=block_size,
            waiting=waiting,
            running=running,
            max_batch_size=max_batch_size,
            tokens_per_s=emitted / span,
            forwards_per_s=len(self._steps) / span,
            tokens_per_forward=tokens / rows if rows else 0.0,
            ttft_p50_s=percentile(ttft, 0.5),
            ttft_p95_s=percentile(ttft, 0.95),
            itl_p50_s=percentile(itl, 0.5),
            itl_p95_s=percentile(itl, 0.95),
            window_s=self.window_s,
            generated_tokens=self._generated,
            forward_passes=self._forwards,
            finished=dict(self._finished),
            verify=verify,
        )

    def _forget_before(self, horizon: float) -> None:
        for samples in (self._steps, self._emitted, self._ttft, self._itl):
            while samples and samples[0][0] < horizon:
                samples.popleft()
