"""The replica's operating point, the same on either engine: the tau, mode and window that new requests
without their own take (existing ones follow it from their next forward where the engine can move them).
The tau controller moves it; `serve deploy` sets it."""

from __future__ import annotations

from mars_ray.serve.rules import RequestRules


class Operable:
    """An engine whose operating point the controller moves: it keeps the point, checks it against its
    `rules` and reports its tau to `metrics`."""

    rules: RequestRules
    metrics: object  # an `EngineMetrics`

    def _start_at(self, tau: float, verify: bool, block_size: int) -> None:
        self.tau, self.verify, self.block_size = tau, verify, block_size  # through the checks below

    @property
    def tau(self) -> float:
        return self._tau

    @tau.setter
    def tau(self, tau: float) -> None:
        self.rules.check_tau(tau)
        self._tau = tau
        self.metrics.tau(tau)

    @property
    def verify(self) -> bool:
        return self._verify

    @verify.setter
    def verify(self, verify: bool) -> None:
        self._verify = verify

    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, block_size: int) -> None:
        self.rules.check_block_size(block_size)
        self._block_size = block_size
