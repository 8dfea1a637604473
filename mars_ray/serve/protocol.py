"""The replica's contract with its engine, the same for the native engine (`engine.Engine`) and vLLM's
(`vllm_engine.VllmEngine`): what the replica asks of an engine (`ServingEngine`) and where an engine reports
what it does (`EngineMetrics`; the Serve deployment exports it as Prometheus metrics, `metrics.py`).
No Ray here: an engine runs and is tested without Serve.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from mars_ray.serve.config import ModelConfig
from mars_ray.serve.stats import EngineStats
from mars_ray.serve.types import Chunk, Logprob, SamplingParams


class EngineMetrics:
    """Where the engine reports what it does; the Serve deployment exports these (no-ops here).

    Shaped like vLLM's metric families, so that its dashboards' queries carry over: per row and forward,
    `drafted` is how many proposals the forward offered that row (a lossy row: its window's W-1 mask
    slots; a verified row: the drafts it checked; 0 at one token per forward) and `accepted` how many
    tokens it took (at most drafted + 1), as vLLM's speculative-decoding counters count them.
    """

    def step(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """One forward: per row, the tokens it accepted and the proposals it was offered."""

    def request_forwards(self, accepted: Sequence[int]) -> None:
        """A finished request's forwards on an engine that batches out of this process's sight (vLLM): the
        tokens each took, from its per-request speculative metrics (accepted drafts are accepted carried
        proposals: a mask slot is never accepted). No count of proposals offered: vLLM counts every mask
        slot as a draft."""

    def admitted(self, queued_seconds: float, prompt_tokens: int) -> None:
        """A request got its row after waiting this long."""

    def first_token(self, seconds: float) -> None:
        """Time from a request's arrival to its first accepted token."""

    def inter_token(self, seconds: float) -> None:
        """Time per token between two of a request's forwards."""

    def finished(self, reason: str, seconds: float) -> None:
        """A request ended (stop, length, cancelled or error) this long after it arrived."""

    def load(self, waiting: int, running: int) -> None:
        """Requests waiting for a row, and rows in the batch."""

    def tau(self, tau: float) -> None:
        """The operating tau changed."""


class ServingEngine(Protocol):
    """One model's engine as the replica drives it. A bad request raises `ConfigError` naming the field
    at fault (the ingress answers it with a 400); the operating point (`tau`, `verify`, `block_size`) is
    what requests that do not set their own take, checked as it is set."""

    tokenizer: PreTrainedTokenizerBase
    tau: float
    verify: bool
    block_size: int

    @property
    def max_context(self) -> int:
        """Tokens a request may fill, prompt and completion together."""
        ...

    @classmethod
    def load(cls, config: ModelConfig, metrics: EngineMetrics) -> ServingEngine:
        """The engine of `config`'s model, reporting to `metrics`."""
        ...

    async def warm_up(self) -> None:
        """A short request through the whole path, before the replica reports ready."""
        ...

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, prompt_field: str = "prompt"
    ) -> AsyncIterator[Chunk]:
        """Stream one request: an empty chunk once it is accepted, then its text, the last chunk with its
        `finish_reason`. Closing the iterator early cancels the request. `prompt_field`: the request field
        a bad prompt is reported under."""
        ...

    async def prompt_logprobs(self, prompt: Sequence[int], k: int) -> list[Logprob]:
        """Each prompt token's log-probability and its k likeliest alternatives (for `echo`)."""
        ...

    def check_token_ids(self, tokens: Sequence[int], field: str) -> None:
        """Refuse ids the model does not have, naming `field`."""
        ...

    def stats(self) -> EngineStats:
        """The replica's recent speed, latency and load (on the event loop only)."""
        ...

    def refresh_gauges(self) -> None:
        """Set the gauges again: Ray drops a gauge series that is not refreshed."""
        ...

    async def close(self) -> None:
        """Stop the engine; requests still running end with an error."""
        ...
