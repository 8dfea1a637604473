"""Faults in serving, on a real Ray cluster and Serve on 127.0.0.1: an engine replica killed mid-stream, and a
redeploy that restarts replicas while a stream is in flight. Bounded in time and count."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from serving import local_app

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Count from 3 to 9."}]


def app_args(**model) -> dict:
    # A drain time far above what the streams need: on a loaded 2-core machine six 1,000-token streams took
    # over 60 s, and the drain ends as soon as they do.
    return {"models": [{"model": "tiny", "num_cpus": 0.5, "graceful_shutdown_timeout_s": 240, **model}]}


@pytest.fixture(scope="module")
def server():
    with local_app(app_args(), 8170) as url:
        yield url


def replica_pids(url: str) -> set[int]:
    status = httpx.get(f"{url}/v1/status", timeout=30).json()
    return {replica["pid"] for replica in status["models"].get("tiny", {}).values()}


def wait_healthy(url: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200:
            return
        time.sleep(2)
    raise AssertionError("the app did not serve again")


def test_a_killed_replica_ends_its_streams_with_an_error_and_is_replaced(server):
    """SIGKILL the engine replica while a stream and a non-streaming request run on it: the stream ends with
    an error event and [DONE], the other gets a 503 with an OpenAI body, Serve starts a new replica, and
    requests after it succeed with nothing left over (no running or waiting rows)."""
    deadline = time.monotonic() + 60
    while not replica_pids(server) and time.monotonic() < deadline:
        time.sleep(1)  # the status board hears from a replica within a tick
    (pid,) = replica_pids(server)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True}
    whole: list[httpx.Response] = []
    other = threading.Thread(
        target=lambda: whole.append(httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120))
    )
    events = []
    streaming = {**body, "stream": True}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{server}/v1/chat/completions", json=streaming) as stream,
    ):
        lines = stream.iter_lines()
        events.append(next(lines))
        other.start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        events += [line for line in lines if line.startswith("data: ")]
    other.join(timeout=120)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error"
    assert len(whole) == 1 and whole[0].status_code == 503, whole[0].text
    assert whole[0].json()["error"]["code"] == "replica_failed" and whole[0].headers["retry-after"] == "1"

    wait_healthy(server)
    assert pid not in replica_pids(server)
    from ray import serve

    stats = serve.get_deployment_handle("engine-tiny", app_name="mars").stats.remote().result(timeout_s=60)
    assert (stats.running, stats.waiting) == (0, 0)


def test_a_redeploy_that_restarts_replicas_drains_streams_in_flight(server):
    """`serve.run` with a changed model config replaces the replica; the old one first finishes the streams it
    was serving (graceful_shutdown_timeout_s): six 1000-token streams, longer than a new replica takes to
    start, each arrive whole."""
    from ray import serve

    from mars_ray.serve.app import build_app

    wait_healthy(server)
    before = replica_pids(server)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "tau": 1.0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    url = f"{server}/v1/chat/completions"
    results: list[tuple[list[str], int, float]] = []
    started = threading.Barrier(7)

    def stream_one():
        finish, tokens = [], 0
        with httpx.Client(timeout=300) as client, client.stream("POST", url, json=body) as stream:
            lines = stream.iter_lines()
            next(lines)
            started.wait(timeout=120)
            for line in lines:
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    assert "error" not in chunk, chunk
                    finish += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        results.append((finish, tokens, time.monotonic()))

    streams = [threading.Thread(target=stream_one) for _ in range(6)]
    for thread in streams:
        thread.start()
    started.wait(timeout=120)  # every stream has its first chunk: all run on the old replica
    redeploying = time.monotonic()
    serve.run(build_app(app_args(max_tokens=200)), name="mars", route_prefix="/")
    for thread in streams:
        thread.join(timeout=300)
    assert len(results) == 6
    assert all(finish == ["length"] and tokens == 1000 for finish, tokens, _ in results)  # whole, not cut
    assert min(end for _, _, end in results) > redeploying  # the replacement began while all of them ran
    wait_healthy(server)
    assert replica_pids(server).isdisjoint(before)  # a new replica serves now
