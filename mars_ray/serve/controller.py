"""Load-adaptive tau: under load a replica first trades confidence for tokens per forward, then asks for
replicas; when load falls it restores quality.

Every `interval_s` the replica's controller reads the engine's snapshot and moves the operating tau:
- over the objective for `patience` ticks in a row: one `tau_step` down, never below `tau_min`;
- under `low_fraction` x the objective for `patience` ticks: one step up, never above `tau_max`;
- in between nothing moves: the band between the two thresholds is the hysteresis.

A lower tau only helps while it raises throughput: every extra mask is compute, and at large batches a
forward stops being free. So while the replica is saturated (requests waiting, or the batch full) the
controller records the goodput (generated tokens/s) of each tau at each batch-size bucket, and refuses a
step down that did not pay (less than `min_gain` more goodput than the tau above it), undoing one that
turned out not to. Measurements older than `memory_s` are forgotten, so it looks again later.
No fixed table: what pays is measured on the machine and load at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_ray.serve.config import TauObjective
from mars_ray.serve.engine import EngineStats


@dataclass
class ControllerState:
    """What the replica reports to the autoscaling policy and the status endpoint."""

    tau: float
    load: float  # the objective's metric, last tick
    over_objective: bool
    low_load: bool
    at_floor: bool  # tau_min reached, or a lower tau does not pay: nothing left to trade
    at_ceiling: bool
    goodput: float  # tokens/s over the last tick


def _bucket(running: int) -> int:
    """Batch sizes grouped by powers of two: goodput is compared between like batches only."""
    return 1 << max(running - 1, 0).bit_length()


class TauController:
    """Moves one replica's operating tau from its own load; see the module docstring."""

    def __init__(self, objective: TauObjective, now: float) -> None:
        self.objective = objective
        self.tau = objective.tau_max
        self._over = self._low = 0
        self._goodput: dict[tuple[float, int], tuple[float, float]] = {}  # (tau, bucket) -> (tokens/s, when)
        self._last: tuple[float, int, float] | None = None  # (time, generated tokens, tau) at the last tick
        self.state = ControllerState(self.tau, 0.0, False, True, False, True, 0.0)

    def reconfigure(self, objective: TauObjective) -> None:
        """New knobs, live: tau is clamped into the new range at once."""
        self.objective = objective
        self.tau = min(max(self.tau, objective.tau_min), objective.tau_max)

    def update(self, stats: EngineStats, now: float) -> float:
        """One tick: record goodput, move tau by the objective; returns the operating tau."""
        o = self.objective
        goodput = self._record_goodput(stats, now)
        load = self._load(stats)
        over, low = load > o.target, load < o.low_fraction * o.target
        self._over = self._over + 1 if over else 0
        self._low = self._low + 1 if low else 0
        bucket = _bucket(stats.running)
        if over and not self._pays(self.tau, bucket):
            self._move(+o.tau_step)  # the last step down did not pay: undo it
        elif self._over >= o.patience and self._pays(self._down(), bucket):
            self._move(-o.tau_step)
        elif self._low >= o.patience:
            self._move(+o.tau_step)
        at_floor = self.tau <= o.tau_min or not self._pays(self._down(), bucket)
        self.state = ControllerState(self.tau, load, over, low, at_floor, self.tau >= o.tau_max, goodput)
        return self.tau

    def _load(self, stats: EngineStats) -> float:
        metric = self.objective.metric
        if metric == "queue_depth":
            return float(stats.waiting)
        value = stats.ttft_p95_s if metric == "ttft_p95" else stats.itl_p95_s
        return value or 0.0

    def _down(self) -> float:
        return round(max(self.objective.tau_min, self.tau - self.objective.tau_step), 6)

    def _move(self, delta: float) -> None:
        o = self.objective
        self.tau = round(min(o.tau_max, max(o.tau_min, self.tau + delta)), 6)
        self._over = self._low = 0

    def _record_goodput(self, stats: EngineStats, now: float) -> float:
        """Tokens/s since the last tick; kept per (tau, bucket) if tau held and the replica was full."""
        last, self._last = self._last, (now, stats.generated_tokens, stats.tau)
        if last is None or now <= last[0]:
            return 0.0
        goodput = (stats.generated_tokens - last[1]) / (now - last[0])
        saturated = stats.waiting > 0 or stats.running >= stats.max_batch_size
        if saturated and last[2] == stats.tau and stats.running > 0:
            key = (round(stats.tau, 6), _bucket(stats.running))
            previous = self._goodput.get(key)
            fresh = previous is not None and now - previous[1] < self.objective.memory_s
            self._goodput[key] = (0.5 * previous[0] + 0.5 * goodput if fresh else goodput, now)
        return goodput

    def _pays(self, tau: float, bucket: int) -> bool:
        """Whether `tau` beats the tau one step above it, as measured; unmeasured counts as worth a try."""
        above = round(min(self.objective.tau_max, tau + self.objective.tau_step), 6)
        if above == tau:
            return True
        mine, theirs = self._measured(tau, bucket), self._measured(above, bucket)
        if mine is None or theirs is None:
            return True
        return mine >= theirs * (1 + self.objective.min_gain)

    def _measured(self, tau: float, bucket: int) -> float | None:
        entry = self._goodput.get((tau, bucket))
        if entry is None or self._last is None or self._last[0] - entry[1] > self.objective.memory_s:
            return None
        return entry[0]
