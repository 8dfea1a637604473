"""A soak on a real Ray cluster and Serve on 127.0.0.1: minutes of mixed streaming, non-streaming, cancelled
and oversized requests at a bounded rate, from a few clients. Nothing is lost, duplicated or changed (every
completed reply equals the model's greedy reply), memory stays flat, and no row is left behind.

`MARS_RAY_SOAK_S` sets the length (default 600 s, what CI runs; a short value checks the test itself).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
import torch
from serving import local_app

from mars_ray import models
from mars_ray.data import chat_prompt_ids

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("MARS_RAY_SOAK_S", "600"))
CLIENTS = 4
MAX_TOKENS = 24
PROMPTS = [[{"role": "user", "content": f"Count from {i} to {i + 7}."}] for i in range(12)]


@pytest.fixture(scope="module")
def server():
    app = {"models": [{"model": "tiny", "num_cpus": 1, "max_batch_size": 8, "max_queued_requests": 64}]}
    with local_app(app, 8190) as url:
        yield url


def greedy_replies() -> list[str]:
    model, tokenizer = models.load("tiny")
    replies = []
    for messages in PROMPTS:
        prompt = chat_prompt_ids(tokenizer, messages)
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)
        replies.append(tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True))
    return replies


def replica_rss(url: str) -> int:
    status = httpx.get(f"{url}/v1/status", timeout=30).json()
    (replica,) = status["models"]["tiny"].values()
    return psutil.Process(replica["pid"]).memory_info().rss


def test_soak_loses_nothing_changes_nothing_and_leaks_nothing(server):
    expected = greedy_replies()
    url = f"{server}/v1/chat/completions"
    outcomes: Counter[str] = Counter()
    wrong: list[tuple[int, str]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + SOAK_S

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < stop_at:
                i = rng.randrange(len(PROMPTS))
                body = {"model": "tiny", "messages": PROMPTS[i], "max_tokens": MAX_TOKENS, "tau": 1.0}
                kind = rng.choice(["stream", "whole", "whole", "cancel", "oversized"])
                text = None
                if kind == "whole":
                    response = http.post(url, json=body)
                    assert response.status_code == 200, response.text
                    text = response.json()["choices"][0]["message"]["content"]
                elif kind == "stream":
                    pieces = []
                    with http.stream("POST", url, json={**body, "stream": True}) as stream:
                        assert stream.status_code == 200
                        for line in stream.iter_lines():
                            if line.startswith("data: {"):
                                chunk = httpx.Response(200, content=line[6:]).json()
                                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
                    text = "".join(pieces)
                elif kind == "cancel":
                    with http.stream("POST", url, json={**body, "stream": True, "max_tokens": 200}) as stream:
                        next(stream.iter_lines())  # then the client goes away
                else:
                    response = http.post(url, json={**body, "user": "x" * (2 << 20)})
                    assert response.status_code == 413
                with lock:
                    outcomes[kind] += 1
                    if text is not None and text != expected[i]:
                        wrong.append((i, text))
                time.sleep(rng.uniform(0.0, 0.2))  # a bounded rate

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(min(60.0, SOAK_S / 4))
    warm_rss = replica_rss(server)
    for thread in threads:
        thread.join(timeout=SOAK_S + 300)
    elapsed = time.monotonic() - started
    end_rss = replica_rss(server)

    assert not any(thread.is_alive() for thread in threads)
    assert not wrong, wrong[:3]  # every completed reply is the greedy reply, whole and once
    assert min(outcomes[k] for k in ("stream", "whole", "cancel", "oversized")) >= 1, outcomes
    assert end_rss <= 1.10 * warm_rss, (warm_rss, end_rss)
    from ray import serve

    engine = serve.get_deployment_handle("engine-tiny", app_name="mars")
    deadline = time.monotonic() + 30
    while True:  # a cancelled row leaves at the engine's next step
        stats = engine.stats.remote().result(timeout_s=60)
        if (stats.running, stats.waiting) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.finished.get("error", 0) == 0
    print(f"soak {elapsed:.0f} s: {dict(outcomes)}; replica RSS {warm_rss >> 20} -> {end_rss >> 20} MiB")
