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
    step that accepted j drafts, 1 for each forward without drafts. A reply cut inside its last step's
    accepted run emitted fewer than that step accepted: the largest step gives back the excess (the
    histogram does not say which step was last), so the tokens add up to the reply."""
    steps = sorted(accepted + 1 for accepted, count in enumerate(histogram) for _ in range(count))
    excess = sum(steps) - completion_tokens
    if excess > 0 and steps:
        steps[-1] = max(steps[-1] - excess, 1)
    return steps + [1] * max(completion_tokens - sum(steps), 0)


def histogram_of(metrics: object | Mapping | None) -> list[int]:
    """The acceptance histogram of vLLM's per-request metrics (its dataclass or its response dict)."""
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        return list(metrics.get("acceptance_histogram") or [])
    return list(getattr(metrics, "histogram", None) or [])
