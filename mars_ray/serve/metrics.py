"""The metric families a replica exports (Ray Serve metrics, scraped by Prometheus): what its engine
reports through `EngineMetrics`, in vLLM's shapes."""

from __future__ import annotations

from collections.abc import Sequence

from ray.serve import metrics

from mars_ray.serve.protocol import EngineMetrics

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
MAX_DRAFT_POSITIONS = 16  # per-position acceptance is counted for the first this many proposals


class ServeMetrics(EngineMetrics):
    """The engine's figures as Ray Serve metrics, labelled by model (Serve adds deployment and replica).

    vLLM's families under the `mars_` prefix (Ray exports each as `ray_mars_...`): TTFT, inter-token,
    end-to-end and queue-time histograms, running and waiting gauges, prompt and generation token counters,
    and the speculative-decoding counters (`spec_decode_num_drafts`, `..._num_draft_tokens`,
    `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), so that the mean accepted length is
    1 + accepted / drafts, as vLLM's users compute it. Plus MARS's own: tau, forwards, tokens per forward.
    """

    def __init__(self, model: str) -> None:
        def labelled(metric):
            metric.set_default_tags({"model": model})
            return metric

        def counter(name: str, description: str, *tags: str):
            return labelled(metrics.Counter(name, description, tag_keys=("model", *tags)))

        def histogram(name: str, description: str, boundaries: list[float]):
            return labelled(metrics.Histogram(name, description, boundaries=boundaries, tag_keys=("model",)))

        def gauge(name: str, description: str):
            return labelled(metrics.Gauge(name, description, tag_keys=("model",)))

        self.requests = counter("mars_request_success", "Requests that ended, by how", "finished_reason")
        self.prompt_tokens = counter("mars_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("mars_generation_tokens", "Tokens generated")
        self.forwards = counter("mars_forward_passes", "Batched forward passes")
        self.drafts = counter("mars_spec_decode_num_drafts", "Row-forwards that offered proposals")
        self.draft_tokens = counter(
            "mars_spec_decode_num_draft_tokens", "Proposals offered (mask slots, drafts)"
        )
        self.accepted_tokens = counter("mars_spec_decode_num_accepted_tokens", "Proposals accepted")
        self.accepted_per_pos = counter(
            "mars_spec_decode_num_accepted_tokens_per_pos", "Proposals accepted, by position", "position"
        )
        self.tokens_per_forward = histogram(
            "mars_tokens_per_forward",
            "Tokens a request accepted in one forward",
            [1, 2, 3, 4, 5, 6, 8, 12, 16],
        )
        self.ttft = histogram(
            "mars_time_to_first_token_seconds", "Arrival at the replica to the first token", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "mars_inter_token_latency_seconds",
            "Time per token between a request's forwards",
            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1],
        )
        self.e2e = histogram("mars_e2e_request_latency_seconds", "Arrival to the end", LATENCY_BUCKETS)
        self.queue_time = histogram("mars_request_queue_time_seconds", "Arrival to a row", LATENCY_BUCKETS)
        self.operating_tau = gauge("mars_tau", "Operating tau of the replica")
        self.waiting = gauge("mars_num_requests_waiting", "Requests waiting for a row")
        self.running = gauge("mars_num_requests_running", "Rows in the running batch")

    def step(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        self.forwards.inc()
        self.generation_tokens.inc(sum(accepted))
        for taken, offered in zip(accepted, drafted, strict=True):
            if offered:
                self.drafts.inc()
                self.draft_tokens.inc(offered)
            self._took(taken)

    def request_forwards(self, accepted: Sequence[int]) -> None:
        self.generation_tokens.inc(sum(accepted))
        for taken in accepted:
            self._took(taken)

    def _took(self, taken: int) -> None:
        """One row's forward took `taken` tokens: the proposals it accepted and one of the target's own."""
        self.tokens_per_forward.observe(taken)
        kept = max(taken - 1, 0)
        if kept:
            self.accepted_tokens.inc(kept)
        for position in range(min(kept, MAX_DRAFT_POSITIONS)):
            self.accepted_per_pos.inc(tags={"position": str(position)})

    def admitted(self, queued_seconds: float, prompt_tokens: int) -> None:
        self.queue_time.observe(queued_seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.inc(tags={"finished_reason": reason})
        self.e2e.observe(seconds)

    def load(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def tau(self, tau: float) -> None:
        self.operating_tau.set(tau)
