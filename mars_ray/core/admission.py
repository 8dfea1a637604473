"""The one batch-admission rule: which waiting rows join a running batch, and how fast their prompts are
cached. The serving engine and `decode_continuous` (eval, calibrate, distill) both admit through it, so
offline runs batch exactly as serving does."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mars_ray.core.errors import ConfigError


@dataclass(frozen=True)
class Admission:
    """How rows join a batch.

    `max_rows`: rows decoded together (batched or joining); a waiting row takes a free row at once, never
    left idle to gather a group (each freed row costs one prefill forward, as in vLLM's scheduler; None: no
    limit). `prefill_budget`: prompt tokens cached per forward while other rows decode (chunked prefill,
    vLLM's max_num_batched_tokens less the decode rows), so a long prompt delays each of their forwards by
    at most this much (None: a joining prompt is cached whole).
    """

    max_rows: int | None = None
    prefill_budget: int | None = None

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ConfigError("max_batch_size", f"must be at least 1, got {self.max_rows}")
        if self.prefill_budget is not None and self.prefill_budget < 1:
            raise ConfigError("prefill_budget", f"must be at least 1, got {self.prefill_budget}")

    def joining(self, held: int, waiting: int) -> int:
        """How many of `waiting` rows join now, beside the `held` rows batched or joining already."""
        free = waiting if self.max_rows is None else self.max_rows - held
        return max(0, min(waiting, free))

    def prefill_chunks(self, pending: Sequence[int]) -> list[int]:
        """Per joining row (oldest first) with `pending` tokens not yet cached: how many to cache in this
        forward, oldest rows first, within the budget. Never a prompt's last token: the decode forward
        feeds it like any row's last accepted token."""
        budget = math.inf if self.prefill_budget is None else self.prefill_budget
        chunks = []
        for size in pending:
            chunk = int(min(size - 1, budget))
            chunks.append(chunk)
            budget -= chunk
        return chunks
