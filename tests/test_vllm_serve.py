"""`engine: vllm` served: the project's app (ingress, API key, /v1/status, per-request tau) with vLLM + MARS
in each engine replica, on a real Ray cluster on 127.0.0.1, through the official `openai` client.

The checkpoint is a tiny random Llama with the tiny preset's tokenizer (test_vllm_mars.py writes it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest
import torch
from serving import local_app
from test_vllm_mars import write_checkpoint
from transformers import AutoModelForCausalLM

from mars_ray.data import chat_prompt_ids

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

KEY = "test-key-vllm"
MESSAGES = [[{"role": "user", "content": f"Count from {i} to {i + 6}."}] for i in range(16)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(checkpoint):
    model = {
        "model": checkpoint,
        "name": "mars",
        "engine": "vllm",
        "dtype": "float32",
        "max_context": 256,
        "num_cpus": 0.5,
        "tau": 1.0,
    }
    with local_app({"models": [model], "api_key": KEY}, 8640) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def greedy_reply(checkpoint, messages, max_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = chat_prompt_ids(tokenizer, messages)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt) :].tolist()


def ask(client, messages, max_tokens: int = 32, **fields):
    return client.chat.completions.create(
        model="mars", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=fields or None
    )


def test_greedy_replies_are_hf_greedy_at_any_tau_and_tau_sets_forward_passes(client, checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = tokenizer.decode(greedy_reply(checkpoint, MESSAGES[0], 32), skip_special_tokens=True)
    plain = ask(client, MESSAGES[0])
    assert plain.choices[0].message.content == expected
    assert plain.usage.mode == "ar" and plain.usage.forward_passes == plain.usage.completion_tokens
    passes = []
    for tau in (0.9, 0.5):
        reply = ask(client, MESSAGES[0], tau=tau, verify=True)
        assert reply.choices[0].message.content == expected
        assert reply.usage.mode == "verify" and reply.usage.tau == tau
        passes.append(reply.usage.forward_passes)
    assert min(passes) < plain.usage.forward_passes  # drafts held: fewer forwards than tokens


def test_sixteen_concurrent_requests_each_equal_their_solo_reply(client):
    solo = [ask(client, m, tau=0.5, verify=True).choices[0].message.content for m in MESSAGES]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda m: ask(client, m, tau=0.5, verify=True), MESSAGES))
    assert [r.choices[0].message.content for r in together] == solo


def test_streaming_status_key_and_bad_fields(server, client):
    pieces = list(
        client.chat.completions.create(
            model="mars",
            messages=MESSAGES[1],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"tau": 0.5, "verify": True},
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == (
        ask(client, MESSAGES[1], max_tokens=16).choices[0].message.content
    )
    deadline = time.monotonic() + 30
    headers = {"Authorization": f"Bearer {KEY}"}
    while not (status := httpx.get(f"{server}/v1/status", headers=headers).json())["models"]:
        assert time.monotonic() < deadline, "no replica posted its status"
        time.sleep(1)
    (replica,) = status["models"]["mars"].values()
    assert replica["stats"]["tau"] == 1.0
    assert httpx.get(f"{server}/v1/models").status_code == 401
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, MESSAGES[0], tau=1.5)
    assert refused.value.body["param"] == "tau"


def test_a_vllm_engine_reports_what_each_forward_took(checkpoint):
    """MARS acceptance on a vLLM replica: each finished request hands its metrics the tokens each of its
    forwards took (what the Prometheus families count by position): as many forwards as its usage reports,
    as many tokens as its reply, and at tau 0.5 forwards that accepted proposals. A running request that
    leaves tau unset follows the replica's point when it moves (the worker's proposer is told): AR before,
    drafting after, as on the native engine. The engine without Serve."""
    from mars_ray.serve.config import ModelConfig
    from mars_ray.serve.protocol import EngineMetrics
    from mars_ray.serve.types import SamplingParams
    from mars_ray.serve.vllm_engine import VllmEngine

    class Recorded(EngineMetrics):
        def __init__(self) -> None:
            self.requests: list[list[int]] = []

        def request_forwards(self, accepted) -> None:
            self.requests.append(list(accepted))

    metrics = Recorded()
    config = ModelConfig(model=checkpoint, name="mars", engine="vllm", dtype="float32", max_context=256)
    prompt = list(range(5, 40))

    async def run():
        engine = VllmEngine.load(config, metrics)
        try:
            finals = []
            for tau in (1.0, 0.5):
                async for chunk in engine.generate(
                    prompt, SamplingParams(max_tokens=24, tau=tau, ignore_eos=True)
                ):
                    last = chunk
                finals.append(last)
            engine.tau = 1.0
            # a long reply: the move lands mid-reply however slowly this reader keeps up
            stream = engine.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
            tokens = 0
            async for chunk in stream:  # the replica's point moves once the reply has 8 tokens
                tokens += len(chunk.token_ids)
                if tokens >= 8 and engine.tau == 1.0:
                    engine.verify, engine.tau = True, 0.05
            return finals
        finally:
            await engine.close()

    finals = asyncio.run(run())
    assert len(metrics.requests) == 3
    followed = metrics.requests[2]
    assert set(followed[:8]) == {1} and max(followed) > 1  # AR, then drafts: it followed mid-reply
    for final, steps in zip(finals, metrics.requests[:2], strict=True):
        assert (len(steps), sum(steps)) == (final.forward_passes, final.completion_tokens) == (len(steps), 24)
    assert set(metrics.requests[0]) == {1}  # tau 1: plain AR, a token a forward
    assert max(metrics.requests[1]) > 1


def test_a_vllm_engine_streams_an_intervals_forwards_as_one_chunk_and_counts_forwards_apart(checkpoint):
    """With `stream_interval_s`, after the first text a vLLM replica sends what the interval's forwards add
    as one chunk (Ray Serve LLM batches its stream alike): the same tokens in fewer messages. The window's
    tokens per forward stay the request's own (its forwards, not its chunks). The engine without Serve."""
    from mars_ray.serve.config import ModelConfig
    from mars_ray.serve.protocol import EngineMetrics
    from mars_ray.serve.types import SamplingParams
    from mars_ray.serve.vllm_engine import VllmEngine

    prompt = list(range(5, 40))

    async def run(interval: float):
        config = ModelConfig(
            model=checkpoint, name="mars", engine="vllm", dtype="float32", max_context=256,
            stream_interval_s=interval, compile=False,
        )  # fmt: skip
        engine = VllmEngine.load(config, EngineMetrics())
        try:
            params = SamplingParams(max_tokens=48, tau=0.5, ignore_eos=True)
            chunks = [chunk async for chunk in engine.generate(prompt, params)]
            return chunks, engine.stats()
        finally:
            await engine.close()

    (per_output, _), (coalesced, stats) = asyncio.run(run(0.0)), asyncio.run(run(0.2))
    assert [t for c in coalesced for t in c.token_ids] == [t for c in per_output for t in c.token_ids]
    assert len([c for c in coalesced if c.token_ids]) < len([c for c in per_output if c.token_ids]) / 2
    final = coalesced[-1]
    assert (final.completion_tokens, final.finish_reason) == (48, "length")
    assert stats.generated_tokens == 48 and stats.forward_passes == final.forward_passes
    assert stats.tokens_per_forward == pytest.approx(48 / final.forward_passes)
