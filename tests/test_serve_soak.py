"""A soak on a real Ray cluster and Serve on 127.0.0.1: minutes of mixed streaming, non-streaming, cancelled
and oversized requests at a bounded rate, from a few clients, while the tau controller moves the replica's
operating point between exact decoding and verified decoding under the load (mid-request). The requests
decode at tau 1, verified, in lossy MARS windows, sampled with a seed (at the operating point and in lossy
windows), with and without stop strings. Nothing is lost, duplicated or changed: every completed reply
equals its exact reference (greedy and verified rows: the model's greedy reply; lossy rows: their run alone
with the same config; seeded sampled rows: their seeded run alone), cut at its stop string; memory stays
flat, and no row is left behind.

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
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.data import chat_prompt_ids

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("MARS_RAY_SOAK_S", "600"))
CLIENTS = 4
MAX_TOKENS = 24
PROMPTS = [[{"role": "user", "content": f"Count from {i} to {i + 7}."}] for i in range(12)]
# The ladder holds exact points only (tau 1, then verified): a reply that follows the operating point has
# one reference however the point moves under it. Two rows a forward and four clients: requests wait, the
# controller steps down to verified decoding; the queue empties, it steps back up.
TAU_CONTROL = {
    "tau_min": 1.0,
    "tau_max": 1.0,
    "verify_tau": 1e-3,  # verified rows carry every proposal: switches leave drafts in flight
    "metric": "queue_depth",
    "target": 0.5,
    "patience": 1,
    "interval_s": 0.25,
    "min_gain": 0.0,
    "memory_s": 2.0,
}
VERIFY_POINT = (TAU_CONTROL["verify_tau"], True)
# What a request asks (beyond the prompt and max_tokens) and how its reference decodes it. The random tiny
# model's mask-slot confidences sit near 1e-3: these taus accept whole windows, or some slots, and none of
# these rows' confidences lies within 1e-4 (relative) of its tau, far beyond batched-versus-alone rounding.
# Each kind: the request's fields, and its reference's `DecodeConfig` fields (None: the greedy reply).
KINDS: dict[str, tuple[dict, dict | None]] = {
    "follows": ({}, None),
    "exact": ({"tau": 1.0}, None),
    "verified": ({"verify": True, "tau": 1e-3, "block_size": 4}, None),
    "lossy-4": ({"verify": False, "tau": 1e-3, "block_size": 4}, {"tau": 1e-3, "block_size": 4}),
    "lossy-2": ({"verify": False, "tau": 1.2e-3, "block_size": 2}, {"tau": 1.2e-3, "block_size": 2}),
    "sampled": ({"temperature": 0.8, "seed": 7}, {"temperature": 0.8, "seed": 7}),
    "sampled-lossy": (
        {"temperature": 0.8, "seed": 8, "tau": 3e-4, "block_size": 4},
        {"temperature": 0.8, "seed": 8, "tau": 3e-4, "block_size": 4},
    ),
}


@pytest.fixture(scope="module")
def server():
    engine = {"model": "tiny", "num_cpus": 1, "max_batch_size": 2, "max_queued_requests": 64}
    with local_app({"models": [{**engine, "tau_control": TAU_CONTROL}]}, 8190) as url:
        yield url


def references() -> dict[tuple[str, int], str]:
    """Each kind's exact reply to each prompt, decoded here, alone."""
    model, tokenizer = models.load("tiny")
    replies = {}
    for i, messages in enumerate(PROMPTS):
        prompt = chat_prompt_ids(tokenizer, messages)
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)
        greedy = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
        for kind, (_, solo) in KINDS.items():
            if solo is None:
                replies[kind, i] = greedy
                continue
            fields = {"block_size": None, **solo}
            block_size = fields.pop("block_size")
            config = DecodeConfig.for_model(
                model, tokenizer, block_size, allow_wider=True, max_new_tokens=MAX_TOKENS, **fields
            )
            (alone,) = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)
            replies[kind, i] = tokenizer.decode(alone.tokens, skip_special_tokens=True)
    return replies


def cut_at(text: str, stop: str | None) -> str:
    """The reply a stop string ends: the text before its first occurrence."""
    return text if stop is None or stop not in text else text[: text.index(stop)]


def replica_status(url: str) -> dict:
    status = httpx.get(f"{url}/v1/status", timeout=30).json()
    (replica,) = status["models"]["tiny"].values()
    return replica


def replica_rss(url: str) -> int:
    return psutil.Process(replica_status(url)["pid"]).memory_info().rss


def test_soak_loses_nothing_changes_nothing_and_leaks_nothing(server):
    expected = references()
    url = f"{server}/v1/chat/completions"
    outcomes: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    modes: Counter[str] = Counter()  # of the replies that follow the operating point
    points: set[tuple[float, bool]] = set()  # operating points the controller took
    wrong: list[tuple[str, int, str | None, str]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + SOAK_S

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < stop_at:
                i = rng.randrange(len(PROMPTS))
                kind = rng.choice(list(KINDS))
                reference = expected[kind, i]
                body = {"model": "tiny", "messages": PROMPTS[i], "max_tokens": MAX_TOKENS, **KINDS[kind][0]}
                stop = None
                if rng.random() < 0.3 and len(reference) > 8:  # a stop string from the middle of the reply
                    start = rng.randrange(2, len(reference) - 4)
                    stop = reference[start : start + 3]
                    body["stop"] = [stop]
                how = rng.choice(["stream", "whole", "whole", "cancel", "oversized"])
                text, usage = None, None
                if how == "whole":
                    response = http.post(url, json=body)
                    assert response.status_code == 200, response.text
                    text = response.json()["choices"][0]["message"]["content"]
                    usage = response.json()["usage"]
                elif how == "stream":
                    pieces = []
                    options = {"stream": True, "stream_options": {"include_usage": True}}
                    with http.stream("POST", url, json={**body, **options}) as stream:
                        assert stream.status_code == 200
                        for line in stream.iter_lines():
                            if line.startswith("data: {"):
                                chunk = httpx.Response(200, content=line[6:]).json()
                                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
                                usage = chunk.get("usage") or usage
                    text = "".join(pieces)
                elif how == "cancel":
                    with http.stream("POST", url, json={**body, "stream": True, "max_tokens": 200}) as stream:
                        next(stream.iter_lines())  # then the client goes away
                else:
                    response = http.post(url, json={**body, "user": "x" * (2 << 20)})
                    assert response.status_code == 413
                with lock:
                    outcomes[how] += 1
                    if text is not None:
                        kinds[kind] += 1
                        if kind == "follows":
                            modes[usage["mode"]] += 1
                        if text != cut_at(reference, stop):
                            wrong.append((kind, i, stop, text))
                time.sleep(rng.uniform(0.0, 0.2))  # a bounded rate

    def watch_the_operating_point() -> None:
        while time.monotonic() < stop_at:
            state = replica_status(server).get("controller")
            if state:
                with lock:
                    points.add((state["tau"], state["verify"]))
            time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    threads.append(threading.Thread(target=watch_the_operating_point))
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
    assert not wrong, wrong[:3]  # every completed reply is its exact reference, whole and once
    assert min(outcomes[k] for k in ("stream", "whole", "cancel", "oversized")) >= 1, outcomes
    assert set(kinds) == set(KINDS), kinds  # every kind completed at least once
    assert {(1.0, False), VERIFY_POINT} <= points, points  # the operating point did move, both ways
    assert modes["verify"] >= 1, modes  # replies that followed it were verified, and stayed exact
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
    print(
        f"soak {elapsed:.0f} s: {dict(outcomes)}; {dict(kinds)}; operating points {sorted(points)}, "
        f"modes {dict(modes)}; replica RSS {warm_rss >> 20} -> {end_rss >> 20} MiB"
    )
