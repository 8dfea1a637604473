"""The replica's operating point, the same on either engine: the tau, mode and window that new requests
without their own take (existing ones follow it from their next forward where the engine can move them).
The tau controller moves it; `serve deploy` sets it."""

from __future__ import annotations

from collections.abc import Sequence

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.serve.protocol import EngineMetrics
from mars_ray.serve.rules import RequestRules


class Operable:
    """An engine held to its `rules`: the operating point the controller moves, checked against them as it
    is set (its tau reported to `metrics`), and the limits they set."""

    rules: RequestRules
    metrics: EngineMetrics

    def _start_at(self, tau: float, verify: bool, block_size: int) -> None:
        self.tau, self.verify, self.block_size = tau, verify, block_size  # through the checks below

    @property
    def tau(self) -> float:
        return self._tau

    @tau.setter
    def tau(self, tau: float) -> None:
        DecodeConfig.check_tau(tau, "tau")
        self._tau = tau
        self.metrics.tau(tau)
        self._moved()

    @property
    def verify(self) -> bool:
        return self._verify

    @verify.setter
    def verify(self, verify: bool) -> None:
        self._verify = verify
        self._moved()

    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, block_size: int) -> None:
        self.rules.check_block_size(block_size)
        self._block_size = block_size
        self._moved()

    def _moved(self) -> None:
        """After the point moves: an engine whose running requests learn it elsewhere tells them here."""

    @property
    def max_context(self) -> int:
        return self.rules.max_context

    @property
    def max_block_size(self) -> int:
        return self.rules.max_block_size

    @property
    def vocab_size(self) -> int:
        return self.rules.vocab_size

    def check_token_ids(self, tokens: Sequence[int], field: str) -> None:
        self.rules.check_token_ids(tokens, field)
