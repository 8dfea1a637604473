"""The OpenAI app end to end: a real Ray cluster, Serve on 127.0.0.1, the official `openai` client.

One app per session (two engine deployments of the `tiny` preset: `tiny`, and `tiny-small` with one row
and a one-request queue, to show backpressure and freed slots) on a local Ray of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import hypothesis
import openai
import psutil
import pytest
import torch
from serving import free_port, local_app

from mars_ray import models
from mars_ray.core.sampling import text_log_probs
from mars_ray.data import chat_prompt_ids

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Count from 3 to 9."}]


@pytest.fixture(scope="module")
def server():
    small = {"max_batch_size": 1, "max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 1}
    models = [
        {"model": "tiny", "num_cpus": 0.5},
        {"model": "tiny", "name": "tiny-small", "num_cpus": 0.25, **small},
    ]
    # The node's Prometheus endpoint on a port of its own (test_metrics_...).
    with local_app({"models": models}, 8123, _metrics_export_port=free_port(9471)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny():
    return models.load("tiny")


def greedy_text(tiny, prompt_ids, max_tokens):
    model, tokenizer = tiny
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_tokens)
    return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


def engine_stats(name):
    from ray import serve

    return serve.get_deployment_handle(f"engine-{name}", app_name="mars").stats.remote().result(timeout_s=60)


def test_health_and_models(server, client):
    health = httpx.get(f"{server}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert sorted(m.id for m in client.models.list().data) == ["tiny", "tiny-small"]


def test_tau_one_equals_transformers_greedy_streaming_or_not(server, client, tiny):
    _, tokenizer = tiny
    chat_ids = chat_prompt_ids(tokenizer, MESSAGES)
    expected_chat = greedy_text(tiny, chat_ids, 20)

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat
    assert chat.choices[0].finish_reason == "length"
    usage = chat.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(chat_ids),
        20,
        len(chat_ids) + 20,
    )
    assert usage.forward_passes == 20  # tau = 1: one token per forward

    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    pieces = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == expected_chat
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"
    assert pieces[-1].usage.completion_tokens == 20 and pieces[-1].usage.forward_passes == 20

    prompt = "Once upon a time"
    expected_text = greedy_text(tiny, tokenizer(prompt)["input_ids"], 16)
    completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
    assert completion.choices[0].text == expected_text and completion.usage.completion_tokens == 16
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, stream=True)
    assert "".join(p.choices[0].text for p in streamed) == expected_text

    # The wire format itself: server-sent events ending in `data: [DONE]`.
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_logprobs_through_the_official_client(server, client, tiny):
    """Chat `logprobs` + `top_logprobs` and completions `logprobs: k`, streaming and not: at tau = 1 each
    token's log-probability (and its alternatives) is the model's own for that token after the prompt and
    the tokens before it; bad values are a 400 naming the field."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"tau": 1.0}
    )
    content = whole.choices[0].logprobs.content
    ids = tokenizer(whole.choices[0].message.content, add_special_tokens=False)["input_ids"]
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)[0, len(prompt) :]
        logits = model(out.new_tensor([prompt + out.tolist()])).logits[0, len(prompt) - 1 : -1].float()
    expected = text_log_probs(logits, tokenizer.mask_token_id)  # the mask is not text: not in the normaliser
    assert len(content) == len(out) and len(ids) <= len(out)
    for i, (entry, token) in enumerate(zip(content, out.tolist(), strict=True)):
        assert entry.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert entry.bytes == list(entry.token.encode())

    verified = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, extra_body={"tau": 0.3, "verify": True}
    )  # lossless: the same tokens and the model's own log-probabilities
    assert verified.usage.mode == "verify"
    assert [e.logprob for e in verified.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=1e-4
    )
    lossy = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, extra_body={"tau": 1e-4}
    )
    assert lossy.usage.mode == "mars" and all(e.logprob <= 0 for e in lossy.choices[0].logprobs.content)

    streamed = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, stream=True, extra_body={"tau": 1.0}
    )
    pieces = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in pieces)

    text = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, logprobs=2, extra_body={"tau": 1.0}
    )
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.token_logprobs == pytest.approx(
        [expected[i, t].item() for i, t in enumerate(out[:6].tolist())], abs=1e-4
    )
    assert logprobs.text_offset[0] == 0 and all(len(top) <= 2 for top in logprobs.top_logprobs)

    # echo: the prompt first, each of its tokens with the log-probability the model gives it in context
    echo = {"prompt": "Count from 3 to 9.", "max_tokens": 4, "echo": True}
    echoed = client.completions.create(model="tiny", logprobs=1, extra_body={"tau": 1.0}, **echo)
    ids = tokenizer("Count from 3 to 9.")["input_ids"]
    choice = echoed.choices[0]
    assert choice.text.startswith("Count from 3 to 9.") and len(choice.logprobs.tokens) == len(ids) + 4
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    with torch.no_grad():
        prompt_logits = model(torch.tensor([ids])).logits[0, :-1].float()
    in_context = text_log_probs(prompt_logits, tokenizer.mask_token_id)[torch.arange(len(ids) - 1), ids[1:]]
    in_context = in_context.tolist()
    assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(in_context, abs=1e-4)
    streamed_echo = client.completions.create(model="tiny", stream=True, **echo)
    assert "".join(c.choices[0].text for c in streamed_echo if c.choices).startswith("Count from 3 to 9.")

    chat_url, text_url = f"{server}/v1/chat/completions", f"{server}/v1/completions"
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    for url, body, param in [
        (chat_url, {**base, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (chat_url, {**base, "top_logprobs": 2}, "top_logprobs"),
        (text_url, {"model": "tiny", "prompt": "hi", "logprobs": 6}, "logprobs"),
    ]:
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text


def test_n_choices_streaming_or_not(server, client, tiny):
    """`n` choices: greedy ones all equal the one greedy reply; seeded sampled ones are reproducible per
    choice; streamed chunks carry their choice's index; usage counts the prompt once."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    greedy = greedy_text(tiny, prompt, 10)
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [greedy] * 3
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == 3 * whole.usage.completion_tokens // 3 > 0

    def sampled():
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=10, n=3, temperature=1.0, seed=11
        )
        return [c.message.content for c in reply.choices]

    first = sampled()
    assert first == sampled() and len(set(first)) > 1  # per-choice seeds: distinct, reproducible

    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=10, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: greedy, 1: greedy}


def test_vllm_request_fields_and_routes(server, client, tiny):
    """What a client written for vLLM sends, unchanged: `min_tokens`, `stop_token_ids`, `ignore_eos` and
    `include_stop_str_in_output` in the body, `GET /v1/models/{id}`, `POST /tokenize` and `/detokenize`
    with vLLM's request and response shapes."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt) :]
    stop = int(greedy[0])  # ends the reply at once

    def reply(**extra):
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, extra_body={"tau": 1.0, **extra}
        )

    stopped = reply(stop_token_ids=[stop])
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = reply(stop_token_ids=[stop], min_tokens=6)
    expected = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=6, eos_token_id=stop
    )[0, len(prompt) :].tolist()
    expected = expected[: expected.index(stop) + 1] if stop in expected else expected
    assert held.usage.completion_tokens == len(expected)
    assert held.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply(ignore_eos=True).usage.completion_tokens == 12
    text = reply().choices[0].message.content
    stop_string = text[3:6]
    assert reply(stop=[stop_string]).choices[0].message.content == text[: text.index(stop_string)]
    with_stop = reply(stop=[stop_string], include_stop_str_in_output=True).choices[0].message.content
    assert with_stop == text[: text.index(stop_string) + len(stop_string)]

    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    tokenized = httpx.post(
        f"{server}/tokenize", json={"model": "tiny", "messages": MESSAGES}, timeout=60
    ).json()
    assert (
        tokenized["tokens"] == prompt and tokenized["count"] == len(prompt) and tokenized["max_model_len"] > 0
    )
    plain = httpx.post(
        f"{server}/tokenize", json={"model": "tiny", "prompt": "Count to 5."}, timeout=60
    ).json()
    assert plain["tokens"] == tokenizer("Count to 5.")["input_ids"]
    back = httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": plain["tokens"]}, timeout=60)
    assert back.json() == {"prompt": tokenizer.decode(plain["tokens"])}
    for route, body, param in [
        ("/detokenize", {"model": "tiny", "tokens": [10**9]}, "tokens"),
        ("/tokenize", {"model": "tiny"}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "min_tokens": -1}, "min_tokens"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": MESSAGES, "stop_token_ids": [-5]},
            "stop_token_ids",
        ),
    ]:
        response = httpx.post(f"{server}{route}", json=body, timeout=60)
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text


def test_max_tokens_stop_strings_and_per_request_tau(client):
    def chat(**fields):
        extra = {k: fields.pop(k) for k in ("tau", "block_size", "verify") if k in fields}
        return client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra, **fields)

    full = chat(max_tokens=30).choices[0].message.content
    short = chat(max_tokens=5)
    assert short.usage.completion_tokens == 5 and full.startswith(short.choices[0].message.content)

    stop = full[5:10]  # mid-token to mid-token: a stop string that spans tokens
    expected = full[: full.index(stop)]
    stopped = chat(max_tokens=30, stop=[stop, "never appears"])
    assert stopped.choices[0].message.content == expected and stopped.choices[0].finish_reason == "stop"
    streamed = chat(max_tokens=30, stop=stop, stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == "stop"

    # The tiny random model is never as unsure as tau = 1e-4, so every slot of the window is accepted.
    multi = chat(max_tokens=24, tau=1e-4, block_size=4).usage
    assert (multi.completion_tokens, multi.forward_passes) == (24, 6)
    assert (multi.tau, multi.mode) == (1e-4, "mars")
    default = chat(max_tokens=24, block_size=4).usage  # follows the replica's operating tau (1.0)
    assert (default.completion_tokens, default.forward_passes) == (24, 24)
    assert (default.tau, default.mode) == (1.0, "ar")

    # Verified: the greedy text whatever tau carries, and usage says so
    greedy = chat(max_tokens=24).choices[0].message.content
    for tau in (0.9, 1e-4):
        verified = chat(max_tokens=24, tau=tau, verify=True)
        assert verified.choices[0].message.content == greedy
        assert verified.usage.mode == "verify"


def test_32_concurrent_streams_each_get_their_output_alone(server, client):
    prompts = [f"Count from {i} to {i + 7}." for i in range(32)]
    requests = [(p, 1.0) for p in prompts] + [(p, 1e-4) for p in prompts[:8]]  # masks in the same batch

    def alone(prompt, tau):
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            extra_body={"tau": tau},
        )
        return reply.choices[0].message.content

    expected = [alone(p, tau) for p, tau in requests]
    concurrent = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)

    async def streamed(prompt, tau):
        stream = await concurrent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            stream=True,
            extra_body={"tau": tau},
        )
        text, reasons = "", []
        async for piece in stream:
            text += piece.choices[0].delta.content or ""
            reasons.append(piece.choices[0].finish_reason)
        return text, reasons[-1]

    async def everyone():
        return await asyncio.gather(*(streamed(p, tau) for p, tau in requests))

    results = asyncio.run(everyone())
    assert [text for text, _ in results] == expected
    assert all(reason in ("stop", "length") for _, reason in results)
    assert len(set(expected[:32])) > 1  # different prompts, different outputs: no mix-ups hidden


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_each_error_has_its_status_and_body(server, client):
    url = f"{server}/v1/chat/completions"
    broken = httpx.post(
        url, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "invalid JSON" in error_of(broken)["message"]

    base = {"model": "tiny", "messages": MESSAGES}
    for field, value, param in [
        ("messages", [], "messages"),
        ("tau", 1.5, "tau"),
        ("tau", 0, "tau"),
        ("temperature", -1, "temperature"),
        ("max_tokens", 0, "max_tokens"),
        ("n", 9, "n"),  # AppConfig.max_n is 8
        ("n", 0, "n"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("max_tokens", 2000, "max_tokens"),  # the prompt plus 2000 is beyond the 1024-token context
        ("block_size", 99, "block_size"),
        ("verify", "maybe", "verify"),
    ]:
        response = httpx.post(url, json={**base, field: value}, timeout=60)
        assert response.status_code == 400, (field, value, response.text)
        error = error_of(response)
        assert error["param"] == param and error["type"] == "invalid_request_error", error

    sampled = httpx.post(url, json={**base, "verify": True, "temperature": 0.7}, timeout=60)
    assert sampled.status_code == 400 and error_of(sampled)["param"] == "verify"  # greedy only
    missing = httpx.post(url, json={"model": "tiny"}, timeout=60)
    assert missing.status_code == 400 and error_of(missing)["param"] == "messages"
    unknown = httpx.post(url, json={**base, "model": "gpt-9"}, timeout=60)
    assert unknown.status_code == 404
    assert error_of(unknown) | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }

    # The official client sees the same: its typed errors carry the body.
    with pytest.raises(openai.BadRequestError) as bad_tau:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"tau": 2})
    assert bad_tau.value.status_code == 400 and bad_tau.value.body["param"] == "tau"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")


def test_bounds_and_bad_input_get_4xx_naming_the_field_and_the_server_stays_healthy(server):
    """Each bound (AppConfig defaults: 1 MiB body, 256 messages, 256-character stop strings) and each kind of
    malformed input is a 4xx with an OpenAI error body, never a 500 or a hang."""
    chat, completions = f"{server}/v1/chat/completions", f"{server}/v1/completions"
    json_headers = {"content-type": "application/json"}
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}

    huge = httpx.post(chat, json={**base, "user": "x" * (2 << 20)}, timeout=60)
    assert huge.status_code == 413 and error_of(huge)["param"] == "body"

    def chunked():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(5):
            yield b"y" * (256 << 10)
        yield b'"}]}'

    streamed = httpx.post(chat, content=chunked(), headers=json_headers, timeout=60)  # no Content-Length
    assert streamed.status_code == 413

    cases = [
        (chat, {**base, "messages": MESSAGES * 257}, "messages"),
        (chat, {**base, "stop": ["z" * 257]}, "stop"),
        (chat, {**base, "seed": 10**30}, "seed"),
        (chat, {**base, "seed": -1}, "seed"),
        (chat, {**base, "max_tokens": 10**30}, "max_tokens"),
        (chat, {**base, "n": 10**30}, "n"),
        (chat, {**base, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (completions, {"model": "tiny", "prompt": [10**9], "max_tokens": 4}, "prompt"),
        (completions, {"model": "tiny", "prompt": [-1], "max_tokens": 4}, "prompt"),
        (completions, {"model": "tiny", "prompt": [], "max_tokens": 4}, "prompt"),
        (completions, {"model": "tiny", "prompt": "", "max_tokens": 4}, "prompt"),
        # echo reads the prompt (its text, a forward for its log-probabilities): checked before, as any prompt
        (completions, {"model": "tiny", "prompt": [-1], "echo": True}, "prompt"),
        (completions, {"model": "tiny", "prompt": [-1], "echo": True, "stream": True}, "prompt"),
        (completions, {"model": "tiny", "prompt": [10**9], "echo": True, "logprobs": 0}, "prompt"),
        (completions, {"model": "tiny", "prompt": [2**64], "echo": True, "logprobs": 0}, "prompt"),
        (completions, {"model": "tiny", "prompt": [1] * 2000, "echo": True, "logprobs": 0}, "prompt"),
        (completions, {"model": "tiny", "prompt": [1] * 8, "echo": True, "max_tokens": 2000}, "max_tokens"),
    ]
    for url, body, param in cases:
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, (param, response.text)
        assert error_of(response)["param"] == param, response.text

    for raw in [b'{"model": "tiny", "messages": [], "tau": NaN}', b'{"model": "tiny", "tau": Infinity}']:
        response = httpx.post(chat, content=raw, headers=json_headers, timeout=60)
        assert response.status_code == 400, response.text
    bad_utf8 = b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    response = httpx.post(chat, content=bad_utf8, headers=json_headers, timeout=60)
    assert response.status_code == 400, response.text
    rejected = httpx.post(chat, json={**base, "messages": [{"role": "assistant", "content": "hi"}] * 2})
    assert rejected.status_code in (200, 400)  # a template that takes any roles serves it; never a 500
    healthy = httpx.post(chat, json=base, timeout=60)
    assert healthy.status_code == 200 and httpx.get(f"{server}/health", timeout=30).status_code == 200


def edge_values(vocab: int, context: int) -> dict[str, dict[str, list]]:
    """Per route, the values at each field's edges (valid and just past it) that a schema-driven generator
    seldom draws: token ids at and past the vocabulary, prompts at and past the context, max_tokens at and
    past the room left, n up to and past max_n, echo with logprobs, every MARS knob's bounds."""
    ids = [[], [0], [vocab - 1], [vocab], [-1], [10**9], [2**64], [3] * (context - 1), [3] * context]
    shared = {
        "max_tokens": [1, 2, context - 1, context, 10**6, 2**63],
        "n": [1, 2, 8, 9],
        "temperature": [0, 1e-9, 1.0, 2],
        "top_p": [1e-9, 0.5, 1],
        "seed": [0, 2**63 - 1, 2**63],
        "stop": ["", ["", "x"], " ", "z" * 256, "z" * 257, ["a", "b", "c", "d"]],
        "stop_token_ids": [[0], [vocab - 1], [vocab], [-1], list(range(16)), list(range(17))],
        "min_tokens": [1, 64, context, 10**6],
        "ignore_eos": [True],
        "include_stop_str_in_output": [True],
        "tau": [1e-9, 0.3, 1],
        "block_size": [1, 2, 16, 17, 10**6],
        "verify": [True, False],
        "stream": [True],
        "stream_options": [{"include_usage": True}],
    }
    user = {"role": "user", "content": "Count from 3 to 9."}
    return {
        "/v1/completions": {
            **shared,
            "prompt": ["", "x", ["x"], ["x", "y"], *ids],
            "echo": [True],
            "logprobs": [0, 1, 5, 6],
        },
        "/v1/chat/completions": {
            **shared,
            "messages": [[user], [{"role": "user", "content": ""}], [user] * 256, [user] * 257],
            "logprobs": [True],
            "top_logprobs": [0, 20, 21],
            "max_completion_tokens": [1, context],
        },
        "/tokenize": {"prompt": ["", "x" * 5000], "messages": [[user]], "add_generation_prompt": [False]},
        "/detokenize": {"tokens": ids},
    }


def fuzz_failure(response) -> str | None:
    """What is wrong with an answer: a 5xx, or a stream that reports a server error in an event."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if "text/event-stream" in str(response.headers.get("content-type")):  # schemathesis: a list of values
        errors = [line for line in response.text.splitlines() if '"server_error"' in line]
        return errors[0] if errors else None
    return None


# Examples per route: the two that decode get the most (their fields and edges are where the engine is
# reached); the rest only route, read or tokenize.
FUZZ_EXAMPLES = {"/v1/completions": 150, "/v1/chat/completions": 150}


def test_schema_fuzzer_finds_no_server_error_and_no_slow_answer(server, tiny):
    """schemathesis against the app's own OpenAPI schema, bounded but wide: per route, bodies valid and
    invalid from the schema, a random subset of their fields set to an edge value (`edge_values`), the model
    set to one that exists so that they reach the engine; no 5xx, no server error inside a stream, no answer
    slower than 60 s, and afterwards the server healthy and its greedy output unchanged."""
    import schemathesis
    from hypothesis import strategies as st

    model, tokenizer = tiny
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/health"}
    edges = edge_values(
        model.get_input_embeddings().num_embeddings, int(model.config.max_position_embeddings)
    )
    assert set(edges) <= {op.path for op in operations}
    before = httpx.post(
        f"{server}/v1/completions", json={"model": "tiny", "prompt": "Count to 5.", "max_tokens": 16}
    ).json()["choices"][0]["text"]

    for operation in operations:
        fields = edges.get(operation.path, {})
        overlay = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in fields.items()})

        @hypothesis.settings(
            max_examples=FUZZ_EXAMPLES.get(operation.path, 20),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(), overlay=overlay)
        def fuzz(case, overlay):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body.update(overlay, model="tiny")
            began = time.monotonic()
            response = case.call(timeout=90)
            failure = fuzz_failure(response)
            assert failure is None, (case.operation.path, case.body, failure)
            assert time.monotonic() - began < 60, (case.operation.path, case.body)

        fuzz()
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    after = httpx.post(
        f"{server}/v1/completions", json={"model": "tiny", "prompt": "Count to 5.", "max_tokens": 16}
    ).json()["choices"][0]["text"]
    assert after == before  # no request left the engine broken (on CUDA: a device-side assert)


def test_overload_gets_503_with_retry_after_and_a_disconnect_frees_the_slot(server):
    """tiny-small has one row and a one-request queue: A runs, B waits, C is turned away at once."""
    url = f"{server}/v1/chat/completions"
    before = engine_stats("tiny-small")
    long = {"model": "tiny-small", "messages": MESSAGES, "max_tokens": 1000, "stream": True}
    short = {**long, "max_tokens": 5, "stream": False}
    with httpx.Client(timeout=60) as a_client, a_client.stream("POST", url, json=long) as a:
        a_lines = a.iter_lines()
        assert a.status_code == 200 and next(a_lines).startswith("data: ")
        b_status = []
        b = threading.Thread(
            target=lambda: b_status.append(httpx.post(url, json=short, timeout=120).status_code)
        )
        b.start()
        time.sleep(1.0)  # B reaches the ingress's queue for tiny-small
        started = time.monotonic()
        c = httpx.post(url, json={**long, "stream": False}, timeout=60)
        assert time.monotonic() - started < 5  # turned away, not left hanging
        assert c.status_code == 503 and c.headers["retry-after"] == "1"
        assert error_of(c)["code"] == "overloaded"
        # A's client goes away mid-stream (leaving the `with` closes the connection).
    b.join(timeout=120)
    assert b_status == [200]  # B got A's row
    after = engine_stats("tiny-small")
    assert after.finished.get("cancelled", 0) == before.finished.get("cancelled", 0) + 1
    assert after.generated_tokens - before.generated_tokens < 1000  # A never ran to its 1000 tokens
    assert (after.running, after.waiting) == (0, 0)


def test_mars_ray_serve_command(tmp_path):
    port = free_port(8150)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    command = [sys.executable, "-m", "mars_ray.cli", "serve", "--model", "tiny", "--port", str(port)]
    command += ["--ray-address", "local", "--num-cpus", "0.25"]
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if "serving 'tiny'" in log.read_text():
                break
            assert process.poll() is None, log.read_text()
            time.sleep(1)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # do not leave a server and its Ray cluster running
            code = None
            for leftover in [*psutil.Process(process.pid).children(recursive=True), process]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    leftover.kill()
        assert code == 0, log.read_text()
    assert f"serving 'tiny' at http://127.0.0.1:{port}/v1" in log.read_text()


def test_loadtest_table_against_the_app(server, capsys, tmp_path):
    from mars_ray.bench import loadtest

    loadtest.main(
        ["--model", "tiny", "--url", server, "--model-name", "tiny", "--requests", "4", "--max-tokens", "8"]
        + ["--output", str(tmp_path / "rows.json")]
        + [
            "--verify-taus",
            "0.5",
            "--peer-url",
            server,
            "--peer-name",
            "tiny",
            "--peer-label",
            "the app as a peer",
        ]
    )
    out = capsys.readouterr().out
    assert "| AR baseline (KV cache, block_size=1) | 4 |" in out
    assert "| MARS tau=0.9 (block_size=4) | 4 |" in out
    assert "| MARS verified, tau=0.5 (block_size=4) | 4 |" in out
    assert "| the app as a peer | 4 | 32 |" in out  # the same budget, through the peer path
    written = json.loads((tmp_path / "rows.json").read_text())  # the table's rows, as JSON
    assert [row["setting"] for row in written][-2:] == [
        "MARS verified, tau=0.5 (block_size=4)",
        "the app as a peer",
    ]


def test_metrics_are_exported_per_model_and_the_dashboard_reads_them(server, client):
    """Every engine metric (vLLM's families under `mars_`) reaches Ray's Prometheus endpoint, labelled with
    the model it belongs to, and every query of the Grafana dashboard in k8s/ names a metric exported."""
    import ray

    client.completions.create(
        model="tiny", prompt="Count from 3 to 9.", max_tokens=8, extra_body={"tau": 1e-4}
    )
    client.completions.create(model="tiny", prompt="Count to 5.", max_tokens=8, extra_body={"tau": 1.0})
    port = ray.nodes()[0]["MetricsExportPort"]
    names = [
        "ray_mars_request_success_total",
        "ray_mars_prompt_tokens_total",
        "ray_mars_generation_tokens_total",
        "ray_mars_forward_passes_total",
        "ray_mars_spec_decode_num_drafts_total",
        "ray_mars_spec_decode_num_draft_tokens_total",
        "ray_mars_spec_decode_num_accepted_tokens_total",
        "ray_mars_spec_decode_num_accepted_tokens_per_pos_total",
        "ray_mars_tokens_per_forward_bucket",
        "ray_mars_tau",
        "ray_mars_num_requests_waiting",
        "ray_mars_num_requests_running",
        "ray_mars_time_to_first_token_seconds_bucket",
        "ray_mars_inter_token_latency_seconds_bucket",
        "ray_mars_e2e_request_latency_seconds_bucket",
        "ray_mars_request_queue_time_seconds_bucket",
    ]
    deadline, missing, text = time.monotonic() + 150, names, ""
    while missing and time.monotonic() < deadline:  # replicas report every few seconds
        time.sleep(2)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        labelled = [line for line in text.splitlines() if 'model="tiny"' in line]
        missing = [name for name in names if not any(line.startswith(name + "{") for line in labelled)]
    assert not missing, f"not exported for model tiny: {missing}"

    dashboard = json.loads((Path(__file__).parents[1] / "k8s" / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"ray_mars_[a-z0-9_]+", target["expr"])
    }
    exported = {line.split("{")[0] for line in text.splitlines() if line.startswith("ray_mars_")}
    assert len(queried) >= 12 and queried <= exported, sorted(queried - exported)
