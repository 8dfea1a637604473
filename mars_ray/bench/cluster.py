"""The local Ray cluster a load driver starts on 127.0.0.1 for its own Serve app."""

from __future__ import annotations

import math
import os


def start_local_ray(replica_cpus: float, dashboard_port: int | None = None) -> str | None:
    """A fresh local cluster with room for the engine replica and the ingress beside it; with
    `dashboard_port`, its dashboard on 127.0.0.1 (Serve's REST API: what `serve deploy` talks to), whose URL
    it returns.

    Ray's CPUs are reservations: a replica that reserves every core of the machine would leave the ingress
    (0.1 CPU) unschedulable and the app would never start, so the cluster declares at least one CPU more than
    the replica takes. The threads the replica runs are set apart (`torch_threads`)."""
    import ray

    cpus = max(os.cpu_count() or 1, math.ceil(replica_cpus) + 1)
    dashboard = {"dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port} if dashboard_port else {}
    ray.init(
        address="local", num_cpus=cpus, include_dashboard=bool(dashboard), log_to_driver=False, **dashboard
    )
    return f"http://127.0.0.1:{dashboard_port}" if dashboard_port else None
