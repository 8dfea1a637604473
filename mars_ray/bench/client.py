"""The client side the load drivers share: one streamed chat request, timed, and the prompts they send.

`loadtest.py` and `ramp.py` time requests the same way through `stream_chat` (send to `[DONE]`, first text,
the server's own usage), so their latencies, TTFT and inter-token figures mean the same thing, and both
take their percentiles from `percentile`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import httpx
from pydantic import Field

from mars_ray import data
from mars_ray.serve.config import StreamInterval


@dataclass
class RequestRecord:
    """One streamed request as the client saw it (perf_counter seconds) and as the server counted it."""

    started: float
    first_token: float | None  # when the first text arrived
    finished: float
    completion_tokens: int
    forward_passes: int | None  # None: a peer that does not report it

    @property
    def latency(self) -> float:
        return self.finished - self.started

    @property
    def inter_token(self) -> float | None:
        """Mean seconds between tokens after the first: what a reader of the stream waits."""
        if self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.completion_tokens - 1)


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    """One streamed chat completion, timed from send to `[DONE]`; the token counts are the server's usage.

    An error the server reports inside the stream (its status line already sent) raises, as does a stream
    without usage: a record of it would count tokens nobody measured."""
    started, first, usage = time.perf_counter(), None, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
            usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{url} ended a stream without the usage it was asked for")
    return RequestRecord(
        started, first, time.perf_counter(), usage["completion_tokens"], usage.get("forward_passes")
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest rank; NaN for no values (a table cell with nothing measured)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


ServedSource = Literal["tasks", "chatterbot", "mix"]
SERVED_SOURCE_HELP = "held-out prompts: generated tasks, real dialogs, or the two taking turns (mix)"
# The drivers' flag for the replica they start: `ModelConfig.stream_interval_s`, its range from there
ReplicaStreamInterval = Annotated[
    StreamInterval,
    Field(description="the replica's stream_interval_s: after the first text, this long's text is one chunk"),
]


def heldout_chats(source: ServedSource, count: int) -> list[list[dict]]:
    """Prompts the model was not trained on: held-out chats without their last (assistant) turn. `mix` is
    a task, then a dialog, in turn (a server's real traffic is neither alone): `count` of them, or as many
    as both sources hold pairs of."""
    if source == "mix":
        pairs = zip(heldout_chats("tasks", count), heldout_chats("chatterbot", count), strict=False)
        return [chat for pair in pairs for chat in pair][:count]
    rows = (
        data.verifiable_tasks("heldout", count=count)
        if source == "tasks"
        else data.chatterbot_dialogs("heldout")
    )
    return [row["messages"][:-1] for row in rows[:count]]
