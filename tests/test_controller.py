"""The tau controller and the replica policy, driven tick by tick with engine snapshots."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from mars_ray.serve.controller import OperatingPoint, TauController, TauObjective, ladder
from mars_ray.serve.policy import tau_first_policy
from mars_ray.serve.stats import EngineStats


def snapshot(
    tau: float, waiting: int, running: int, generated: int, ttft: float | None = None
) -> EngineStats:
    return EngineStats(
        tau=tau,
        block_size=4,
        waiting=waiting,
        running=running,
        max_batch_size=16,
        tokens_per_s=0.0,
        forwards_per_s=0.0,
        tokens_per_forward=1.0,
        ttft_p50_s=ttft,
        ttft_p95_s=ttft,
        itl_p50_s=None,
        itl_p95_s=None,
        window_s=10.0,
        generated_tokens=generated,
        forward_passes=0,
        finished={},
    )


class Replica:
    """Feeds the controller the goodput a replica would have at each point: `rate(point)` tokens/s
    (`rate(tau)` for a ladder without a verified point)."""

    def __init__(self, objective: TauObjective, rate) -> None:
        self.controller = TauController(objective, now=0.0)
        self.rate = rate if objective.verify_tau else lambda point: rate(point.tau)
        self.now, self.generated = 0.0, 0

    def tick(self, waiting: int, running: int = 16, ttft: float | None = None) -> float:
        point = self.controller.point
        self.now += 1.0
        self.generated += int(self.rate(point)) if running else 0
        stats = dataclasses.replace(
            snapshot(point.tau, waiting, running, self.generated, ttft), verify=point.verify
        )
        return self.controller.update(stats, self.now).tau


OBJECTIVE = TauObjective(tau_min=0.7, tau_max=1.0, tau_step=0.1, target=4, low_fraction=0.5, patience=2)


def test_overload_lowers_tau_to_the_floor_and_idle_restores_it():
    replica = Replica(OBJECTIVE, rate=lambda tau: 100 * (2.0 - tau))  # lower tau, more tokens/s
    taus = [replica.tick(waiting=10) for _ in range(12)]
    # three ticks measure tau 1.0 (the first tick has no goodput yet) before it steps down
    assert taus[:3] == [1.0, 1.0, 1.0] and taus[3] == pytest.approx(0.9)
    assert min(taus) == pytest.approx(0.7) and taus[-1] == pytest.approx(0.7)  # never below tau_min
    assert replica.controller.state.at_floor and replica.controller.state.over_objective
    taus = [replica.tick(waiting=0, running=1) for _ in range(10)]
    assert taus[-1] == 1.0 and replica.controller.state.at_ceiling and replica.controller.state.low_load


def test_hysteresis_band_holds_still():
    replica = Replica(OBJECTIVE, rate=lambda tau: 100 * (2.0 - tau))
    for _ in range(4):
        replica.tick(waiting=10)
    held = replica.controller.tau
    assert held < 1.0
    # between low_fraction x target (2) and target (4): neither over nor low, nothing moves
    assert {replica.tick(waiting=w) for w in [3, 4, 2, 3, 4, 3, 2, 4]} == {held}
    # alternating over and low never builds the patience either way
    assert {replica.tick(waiting=w) for w in [9, 0, 9, 0, 9, 0]} == {held}


def pays_down_to_09(tau: float) -> float:
    """Goodput that rises from tau 1.0 to 0.9, then falls: below 0.9 extra masks cost more than they bring."""
    return {1.0: 100.0, 0.9: 120.0, 0.8: 110.0, 0.7: 100.0}[round(tau, 1)]


def test_a_lower_tau_that_does_not_pay_is_refused():
    replica = Replica(OBJECTIVE, rate=pays_down_to_09)
    taus = [replica.tick(waiting=10) for _ in range(20)]
    assert min(taus) == pytest.approx(0.8)  # it tried 0.8 once...
    assert taus[-1] == pytest.approx(0.9)  # ...measured the loss, went back and stays
    assert taus[-8:].count(0.8) == 0
    assert replica.controller.state.at_floor  # nothing left to trade: the policy may add a replica


def test_one_ticks_noise_does_not_walk_past_a_point_that_does_not_pay():
    """Tau 0.9 brings 4% less than 1.0 on average, but a tick's goodput swings by 8%: compared one tick
    against one tick, the noise walks the controller down; averaged over three ticks it stays at 1.0."""
    mean = {1.0: 100.0, 0.9: 96.0, 0.8: 94.0, 0.7: 92.0}
    noise = [8.0, 0.0, -8.0]  # by tick: any three ticks in a row average to the mean

    def walk(samples: int) -> list[float]:
        replica = Replica(OBJECTIVE.model_copy(update={"goodput_samples": samples}), rate=None)
        replica.rate = lambda point: mean[round(point.tau, 1)] + noise[int(replica.now) % 3]
        return [replica.tick(waiting=10) for _ in range(30)]

    taus = walk(3)
    assert min(taus) == pytest.approx(0.9) and taus[-10:] == [1.0] * 10  # tried 0.9, measured, went back
    assert min(walk(1)) < 0.85  # one tick a point: the noise reads as gains


def test_goodput_is_compared_per_batch_size():
    """At batch 2 nothing measured at batch 16 counts: the controller first goes back up to measure the point
    above the one it holds, then tries afresh the tau that did not pay at batch 16."""
    replica = Replica(OBJECTIVE, rate=pays_down_to_09)
    for _ in range(20):
        replica.tick(waiting=10, running=16)
    assert replica.controller.tau == pytest.approx(0.9)
    taus = [replica.tick(waiting=10, running=2) for _ in range(20)]
    assert taus.index(1.0) < taus.index(pytest.approx(0.8))
    assert taus[-1] == pytest.approx(0.9)


def test_a_point_that_does_not_pay_at_a_batch_size_is_not_tried_at_larger_ones():
    """0.8 did not pay at batch 4: at batches 8 and 16 the controller holds 0.9 without trying 0.8 again
    (each try costs seconds at a worse point), while at batch 2 it tries it afresh."""
    replica = Replica(OBJECTIVE, rate=pays_down_to_09)
    for _ in range(20):
        replica.tick(waiting=10, running=4)
    assert replica.controller.tau == pytest.approx(0.9)
    for running in (8, 16):
        taus = [replica.tick(waiting=10, running=running) for _ in range(20)]
        assert min(taus) == pytest.approx(0.9) and replica.controller.state.at_floor
    assert min(replica.tick(waiting=10, running=2) for _ in range(20)) == pytest.approx(0.8)


def verify_does_not_pay(point: OperatingPoint) -> float:  # at this batch the drafts cost more than they bring
    return 80.0 if point.verify else 100.0


def test_a_latency_objective_below_a_full_batch_still_measures_before_it_walks():
    """Eight rows of sixteen, nothing waiting, the latency over its target: a lower tau is still only kept
    where it pays (the ramp's vLLM replica walked from verified decoding to tau 0.7 unmeasured here)."""
    objective = OBJECTIVE.model_copy(update={"metric": "ttft_p95", "target": 0.5})
    replica = Replica(objective, rate=pays_down_to_09)
    taus = [replica.tick(waiting=0, running=8, ttft=2.0) for _ in range(30)]
    assert min(taus) == pytest.approx(0.8) and taus[-10:] == [pytest.approx(0.9)] * 10


def test_live_reconfigure_clamps_and_validates():
    replica = Replica(OBJECTIVE, rate=lambda tau: 100 * (2.0 - tau))
    for _ in range(12):
        replica.tick(waiting=10)
    replica.controller.reconfigure(OBJECTIVE.model_copy(update={"tau_min": 0.85}))
    assert replica.controller.tau == pytest.approx(0.85)
    with pytest.raises(ValidationError, match="tau_min"):
        TauObjective(tau_min=0.9, tau_max=0.8)
    with pytest.raises(ValidationError, match="tau_step"):
        TauObjective(tau_step=0)


def test_verified_decoding_comes_first_and_stays_only_where_it_pays():
    objective = OBJECTIVE.model_copy(update={"verify_tau": 0.5})
    assert ladder(objective) == [
        OperatingPoint(1.0),
        OperatingPoint(0.5, verify=True),
        OperatingPoint(0.9),
        OperatingPoint(0.8),
        OperatingPoint(0.7),
    ]
    assert ladder(objective.model_copy(update={"tau_max": 0.95}))[1] == OperatingPoint(0.85)  # lossy ceiling

    def rate(point):  # verified decoding is free speed, lower taus add more
        return 155.0 if point.verify else 150 * (2.0 - point.tau)

    replica = Replica(objective, rate)
    points = []
    for _ in range(18):  # four points down, each measured over three ticks
        replica.tick(waiting=10)
        points.append(replica.controller.point)
    assert points[3] == OperatingPoint(0.5, verify=True)  # the lossless step is taken first
    assert points[-1] == OperatingPoint(0.7) and replica.controller.state.at_floor
    for _ in range(12):
        replica.tick(waiting=0, running=1)
    assert replica.controller.point == OperatingPoint(1.0)

    replica = Replica(objective, verify_does_not_pay)
    visited = set()
    for _ in range(12):
        replica.tick(waiting=10)
        visited.add(replica.controller.point)
    assert replica.controller.point == OperatingPoint(1.0) and replica.controller.state.at_floor
    assert OperatingPoint(0.9) not in visited  # it does not walk past a step that did not pay


def test_an_idle_replica_does_not_step_down_for_the_latencies_its_window_remembers():
    """The ramp's trace: after the last client left, the p95 of the finished requests was still over the
    objective, and the idle replica swung between tau 1.0 and verified decoding every other tick."""
    objective = OBJECTIVE.model_copy(update={"metric": "ttft_p95", "target": 0.5, "verify_tau": 0.5})
    controller = TauController(objective, now=0.0)
    for t in range(1, 9):
        controller.update(snapshot(controller.tau, waiting=0, running=0, generated=100, ttft=2.0), float(t))
        assert controller.point == OperatingPoint(1.0)
    for t in range(9, 13):  # load again: tau 1.0 measured over three ticks, then the step down
        controller.update(snapshot(1.0, waiting=0, running=4, generated=100 * t, ttft=2.0), float(t))
    assert controller.point == OperatingPoint(0.5, verify=True)


def test_latency_objective():
    objective = OBJECTIVE.model_copy(update={"metric": "ttft_p95", "target": 0.5})
    controller = TauController(objective, now=0.0)
    for t in range(1, 6):  # three ticks measure tau 1.0, then it steps down
        controller.update(
            snapshot(controller.tau, waiting=0, running=4, generated=100 * t, ttft=2.0), float(t)
        )
    assert controller.tau < 1.0


def context(
    flags: dict[str, float | list[float]], replicas: int, max_replicas: int = 2
) -> AutoscalingContext:
    deployment = DeploymentID(name="engine", app_name="mars")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=deployment) for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=deployment,
        deployment_name="engine",
        app_name="mars",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=ids,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={
            name: {r: v[i] if isinstance(v, list) else v for i, r in enumerate(ids)}
            for name, v in flags.items()
        },
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=None,
    )


def test_policy_adds_a_replica_only_when_tau_is_spent():
    spent = {"at_floor": 1.0, "over_objective": 1.0, "at_ceiling": 0.0, "low_load": 0.0}
    assert tau_first_policy(context(spent, 1))[0] == 2
    still_trading = {**spent, "at_floor": 0.0}
    assert tau_first_policy(context(still_trading, 1))[0] == 1
    assert tau_first_policy(context(spent, 2))[0] == 2  # max_replicas


def test_policy_removes_a_replica_only_when_quality_is_back_and_idle():
    calm = {"at_floor": 0.0, "over_objective": 0.0, "at_ceiling": 1.0, "low_load": 1.0}
    assert tau_first_policy(context(calm, 2))[0] == 1
    one_still_trading = {**calm, "at_ceiling": [1.0, 0.0]}
    assert tau_first_policy(context(one_still_trading, 2))[0] == 2
    assert tau_first_policy(context(calm, 1))[0] == 1  # min_replicas
