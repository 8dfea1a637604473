"""The app's view of its replicas for `GET /v1/status`: each engine replica posts its operating point and
load every tick; the ingress reads the live ones."""

from __future__ import annotations

import time

from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0})
class StatusBoard:
    """Where every engine replica posts its operating point each tick; read by `GET /v1/status`.

    Every method is async, here and on `EngineDeployment`: Serve runs a sync method in a thread pool, where
    it would race the event loop's (or another call's) changes to the same state (iterating `replicas` while
    a post grows it, reading the engine's deques while a forward appends to them); async, they run one at a
    time on the replica's event loop."""

    def __init__(self, stale_after_s: float = 5.0) -> None:
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, dict] = {}

    async def post(self, replica: str, status: dict) -> None:
        self.replicas[replica] = {**status, "posted": time.time()}

    async def snapshot(self) -> dict[str, dict[str, dict]]:
        """{model: {replica id: status}}, replicas silent for `stale_after_s` dropped (they are gone)."""
        now = time.time()
        self.replicas = {r: s for r, s in self.replicas.items() if now - s["posted"] < self.stale_after_s}
        models: dict[str, dict[str, dict]] = {}
        for replica, status in sorted(self.replicas.items()):
            models.setdefault(status["model"], {})[replica] = status
        return models
