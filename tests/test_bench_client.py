"""The one streaming client of the load drivers (`mars_ray.bench.client`), against canned SSE streams: what
it times and counts, and that a failure inside a stream is an error rather than a record."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from mars_ray.bench.client import percentile, stream_chat


def sse(*events: dict | str) -> httpx.MockTransport:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return httpx.MockTransport(lambda request: httpx.Response(200, text=body))


def chunk(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}}]}


def record(transport: httpx.MockTransport):
    async def one():
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_chat(client, "http://test", {"model": "m", "messages": []})

    return asyncio.run(one())


def test_a_stream_becomes_one_record_with_the_server_counts():
    usage = {"choices": [], "usage": {"completion_tokens": 3, "forward_passes": 2}}
    got = record(
        sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            chunk("a"),
            chunk("bc"),
            usage,
            "[DONE]",
        )
    )
    assert (got.completion_tokens, got.forward_passes) == (3, 2)
    assert got.started <= got.first_token <= got.finished
    assert got.inter_token == pytest.approx((got.finished - got.first_token) / 2)
    peer = record(sse(chunk("a"), {"choices": [], "usage": {"completion_tokens": 1}}, "[DONE]"))
    assert peer.forward_passes is None and peer.inter_token is None  # a peer without forward counts


def test_a_failure_in_the_stream_raises():
    with pytest.raises(RuntimeError, match="generation failed"):
        record(sse(chunk("a"), {"error": {"message": "generation failed: boom"}}, "[DONE]"))
    with pytest.raises(RuntimeError, match="usage"):
        record(sse(chunk("a"), "[DONE]"))


def test_percentile_is_nearest_rank_and_nan_for_nothing():
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0
    assert math.isnan(percentile([], 0.5))
