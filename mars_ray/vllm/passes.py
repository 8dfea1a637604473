"""A request's forward passes on vLLM, from vLLM's own per-request speculative metrics.

With `per_request_spec_decode_metrics` on, each finished sequence carries the histogram of drafts accepted
per verify step (`acceptance_histogram[j]`: steps that accepted j drafts, each also emitting one token of the
target's own). A step without drafts (the prefill, a request at tau = 1) emits exactly one token. So the
forwards are the verify steps plus the tokens no verify step emitted. (A reply cut by a stop string or
`max_tokens` inside a step's accepted run counts that step's tokens as emitted: at most one forward off.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

METRICS_LEVEL = "summary"  # vLLM's `per_request_spec_decode_metrics`: the histogram is all this needs


def accepted_per_forward(completion_tokens: int, histogram: Sequence[int]) -> list[int]:
    """The tokens each of the request's forwards emitted (in no particular order): j + 1 for each verify
    step that accepted j drafts, 1 for each forward without drafts."""
    verify_steps = [accepted + 1 for accepted, steps in enumerate(histogram) for _ in range(steps)]
    return verify_steps + [1] * max(completion_tokens - sum(verify_steps), 0)


def forward_passes(completion_tokens: int, histogram: Sequence[int]) -> int:
    return len(accepted_per_forward(completion_tokens, histogram))


def histogram_of(metrics: object | Mapping | None) -> list[int]:
    """The acceptance histogram of vLLM's per-request metrics (its dataclass or its response dict)."""
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        return list(metrics.get("acceptance_histogram") or [])
    return list(getattr(metrics, "histogram", None) or [])
