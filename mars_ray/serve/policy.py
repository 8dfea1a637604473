"""Replicas last: a Ray Serve autoscaling policy that scales out only once tau has nothing left to give.

Each engine replica reports its controller's state through `record_autoscaling_stats` (`at_floor`,
`over_objective`, `at_ceiling`, `low_load`, as 0/1, averaged by Serve over the look-back window).
- Add a replica only while every replica sits at its floor (tau_min, or a lower tau no longer pays) and is
  still over the objective: trading quality could not absorb the load.
- Remove one only when every replica is back at tau_max and lightly loaded.
Serve applies min/max replicas and the upscale/downscale delays on top.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext


def _everywhere(ctx: AutoscalingContext, name: str) -> bool:
    values = (ctx.aggregated_metrics or {}).get(name, {})
    replicas = ctx.running_replicas
    return bool(replicas) and all(values.get(r, 0.0) >= 0.5 for r in replicas)


def tau_first_policy(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    """Desired replicas: +1 when tau is spent and load still too high, -1 when quality is back and idle."""
    replicas = ctx.current_num_replicas
    if _everywhere(ctx, "at_floor") and _everywhere(ctx, "over_objective"):
        replicas += 1
    elif _everywhere(ctx, "at_ceiling") and _everywhere(ctx, "low_load"):
        replicas -= 1
    replicas = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, replicas))
    return replicas, ctx.policy_state
