"""Load-adaptive tau: under load a replica first takes the speed that costs no quality (verified
decoding), then trades confidence for tokens per forward, then asks for replicas; when load falls it
restores quality.

The operating points form a ladder, best quality first (`ladder`): `tau_max`; verified decoding at
`verify_tau` when `tau_max` is exact and `verify_tau` is set (the output stays exactly greedy); then one
`tau_step` at a time down to `tau_min`. Every `interval_s` the replica's controller reads the engine's
snapshot and moves along it:
- over the objective for `patience` ticks in a row: one point down, never past the last;
- under `low_fraction` x the objective for `patience` ticks: one point up, never past the first;
- in between nothing moves: the band between the two thresholds is the hysteresis;
- an idle replica (nothing running or waiting) has no load, whatever latencies its window still holds.

A lower point only helps while it makes decoding faster: every extra mask or draft is compute, and at
large batches a forward stops being free. So the controller measures, whenever requests run, each point's
speed (tokens/s per running request) at each batch-size bucket, and keeps a point only while it beats the
one above it by `min_gain`, as measured at the batch size at hand:
- a point counts as measured after `goodput_samples` ticks at it (their mean): one second's goodput moves
  by more than a few percent, and single ticks compared with `min_gain` walked to points that did not pay;
- a point that does not pay at a batch size is taken not to pay at larger ones (a larger batch leaves
  less of a forward idle for the masks to fill), so growing load does not try it again at each size;
- it measures the point it holds before stepping down from it, and tries a point below never measured;
- it undoes a step that did not pay, and, where the point above was never measured at this batch size
  (the load moved it to a new bucket), goes back up to measure it rather than stay below it unjudged.
Measurements older than `memory_s` are forgotten, so it looks again later. No fixed table: what pays is
measured on the machine and load at hand.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mars_ray.serve.config import TauObjective
from mars_ray.serve.stats import EngineStats


@dataclass(frozen=True)
class OperatingPoint:
    """What requests that do not choose their own decode with: a tau, verified or not."""

    tau: float
    verify: bool = False


def ladder(objective: TauObjective) -> list[OperatingPoint]:
    """The operating points from best quality down: `tau_max`; then, when that is exact (1.0) and
    `verify_tau` is set, verified decoding (still exactly greedy, more tokens per forward); then one
    `tau_step` at a time down to `tau_min`."""
    o = objective
    points = [OperatingPoint(o.tau_max)]
    if o.verify_tau is not None and o.tau_max >= 1.0:
        points.append(OperatingPoint(o.verify_tau, verify=True))
    tau = o.tau_max
    while tau > o.tau_min:
        tau = round(max(o.tau_min, tau - o.tau_step), 6)
        points.append(OperatingPoint(tau))
    return points


@dataclass
class ControllerState:
    """What the replica reports to the autoscaling policy and the status endpoint."""

    tau: float
    verify: bool
    load: float  # the objective's metric, last tick
    over_objective: bool
    low_load: bool
    at_floor: bool  # the last point reached, or the next one does not pay: nothing left to trade
    at_ceiling: bool
    goodput: float  # tokens/s over the last tick


def _bucket(running: int) -> int:
    """Batch sizes grouped by powers of two: goodput is compared between like batches only."""
    return 1 << max(running - 1, 0).bit_length()


class TauController:
    """Moves one replica's operating point along the ladder from its own load; see the module docstring."""

    def __init__(self, objective: TauObjective, now: float) -> None:
        self.objective, self.points = objective, ladder(objective)
        self.rung = 0
        self._over = self._low = 0
        # (point, bucket) -> its last ticks' (tokens/s per running request, when)
        self._speeds: dict[tuple[OperatingPoint, int], deque[tuple[float, float]]] = {}
        self._last: tuple[float, int, OperatingPoint] | None = None  # (time, generated, point) last tick
        self.state = ControllerState(self.tau, False, 0.0, False, True, False, True, 0.0)

    @property
    def point(self) -> OperatingPoint:
        return self.points[self.rung]

    @property
    def tau(self) -> float:
        return self.point.tau

    def reconfigure(self, objective: TauObjective) -> None:
        """New knobs, live: the operating point moves to the nearest one of the new ladder at once."""
        current = self.point
        self.objective, self.points = objective, ladder(objective)
        same = [i for i, p in enumerate(self.points) if p == current]
        lossy = [i for i, p in enumerate(self.points) if not p.verify]
        self.rung = same[0] if same else min(lossy, key=lambda i: abs(self.points[i].tau - current.tau))

    def update(self, stats: EngineStats, now: float) -> OperatingPoint:
        """One tick: record goodput, move along the ladder by the objective; returns the operating point."""
        o = self.objective
        goodput = self._record_goodput(stats, now)
        load = self._load(stats)
        over, low = load > o.target, load < o.low_fraction * o.target
        self._over = self._over + 1 if over else 0
        self._low = self._low + 1 if low else 0
        bucket = _bucket(stats.running)
        last = len(self.points) - 1
        here = stats.running == 0 or self._measured(self.point, bucket) is not None
        pays, below = self._pays(self.rung, bucket), self._pays_below(bucket)
        step_down = self._over >= o.patience and self.rung < last and here
        if over and pays is False:
            self._move(-1)  # the last step down did not pay: undo it
        elif step_down and below is True:
            self._move(+1)
        elif over and pays is None and here:
            self._move(-1)  # the point above is not measured at this batch size: measure it first
        elif step_down and below is None:
            self._move(+1)  # never measured here: worth a try
        elif self._low >= o.patience:
            self._move(-1)
        at_floor = self._pays_below(bucket) is False
        self.state = ControllerState(
            self.tau, self.point.verify, load, over, low, at_floor, self.rung == 0, goodput
        )
        return self.point

    def _load(self, stats: EngineStats) -> float:
        if stats.running == 0 and stats.waiting == 0:
            return 0.0  # idle: the latencies its window still holds are of requests that have finished
        metric = self.objective.metric
        if metric == "queue_depth":
            return float(stats.waiting)
        value = stats.ttft_p95_s if metric == "ttft_p95" else stats.itl_p95_s
        return value or 0.0

    def _move(self, steps: int) -> None:
        self.rung = min(len(self.points) - 1, max(0, self.rung + steps))
        self._over = self._low = 0

    def _record_goodput(self, stats: EngineStats, now: float) -> float:
        """Tokens/s since the last tick; per running request, kept per (point, bucket) if the point held."""
        point = OperatingPoint(round(stats.tau, 6), stats.verify)
        last, self._last = self._last, (now, stats.generated_tokens, point)
        if last is None or now <= last[0]:
            return 0.0
        goodput = (stats.generated_tokens - last[1]) / (now - last[0])
        if stats.running > 0 and last[2] == point:
            samples = self._speeds.setdefault((point, _bucket(stats.running)), deque())
            samples.append((goodput / stats.running, now))
            while len(samples) > self.objective.goodput_samples:
                samples.popleft()
        return goodput

    def _pays(self, rung: int, bucket: int) -> bool | None:
        """Whether point `rung` beats the one above it, as measured at this batch size; if not measured
        here, False where it did not pay at a smaller one; else None."""
        verdict = self._pays_at(rung, bucket)
        smaller = bucket >> 1
        while verdict is None and smaller:
            verdict = False if self._pays_at(rung, smaller) is False else None
            smaller >>= 1
        return verdict

    def _pays_at(self, rung: int, bucket: int) -> bool | None:
        """Whether point `rung` beats the one above it, as measured at `bucket`; None while either is not."""
        if rung <= 0:
            return True
        mine, theirs = (
            self._measured(self.points[rung], bucket),
            self._measured(self.points[rung - 1], bucket),
        )
        if mine is None or theirs is None:
            return None
        return mine >= theirs * (1 + self.objective.min_gain)

    def _pays_below(self, bucket: int) -> bool | None:
        """Whether the next point down beats this one, as measured; False where there is none."""
        return self._pays(self.rung + 1, bucket) if self.rung < len(self.points) - 1 else False

    def _measured(self, point: OperatingPoint, bucket: int) -> float | None:
        """The point's mean speed over its last `goodput_samples` ticks, all within `memory_s`."""
        samples = self._speeds.get((point, bucket), ())
        o = self.objective
        if len(samples) < o.goodput_samples or self._last is None:
            return None
        if self._last[0] - samples[0][1] > o.memory_s:
            return None
        return sum(tokens for tokens, _ in samples) / len(samples)
