"""The serving engine without Ray: streamed text, stop strings, continuous batching, cancellation, tau."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mars_ray import models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.errors import ConfigError
from mars_ray.data import chat_prompt_ids
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.text import TextStream
from mars_ray.serve.types import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return models.load("tiny")


def stream_in_chunks(tokenizer, ids, stop=(), seed=0):
    """Push `ids` in random chunks of 1-4 tokens (as multi-token acceptance does); return the deltas."""
    text, rng, deltas, i = TextStream(tokenizer, stop), random.Random(seed), [], 0
    while i < len(ids) and not text.stopped:
        n = rng.randint(1, 4)
        deltas.append(text.push(ids[i : i + n]))
        i += n
    deltas.append(text.finish())
    return deltas, text


def test_text_stream_concatenates_to_the_decoded_output(tiny):
    _, tokenizer = tiny
    sample = "Héllo wörld, naïve café 你好 🙂 ok"
    ids = tokenizer(sample)["input_ids"]
    assert len(ids) > len(sample.split())  # multi-byte characters really are split across tokens
    for seed in range(5):
        deltas, _ = stream_in_chunks(tokenizer, ids, seed=seed)
        assert "".join(deltas) == sample
        assert all("\ufffd" not in d for d in deltas)  # no half characters on the way
    garbage = torch.randint(3, 2048, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    deltas, _ = stream_in_chunks(tokenizer, garbage)
    assert "".join(deltas) == tokenizer.decode(garbage, skip_special_tokens=True)


def test_stop_strings_across_tokens_never_leak(tiny):
    _, tokenizer = tiny
    sample = "Count 1, 2, 3, 4, 5 and stop here."
    ids = tokenizer(sample)["input_ids"]
    for stop, expected in [(", 3", "Count 1, 2"), ("and st", "Count 1, 2, 3, 4, 5 "), ("nowhere", sample)]:
        for seed in range(5):
            deltas, text = stream_in_chunks(tokenizer, ids, stop=[stop, "zzz"], seed=seed)
            assert "".join(deltas) == expected
            assert text.stopped == (expected != sample)
    # A tail that could start a stop string is held back, and released when the output ends.
    text = TextStream(tokenizer, ["5 and go"])
    assert text.push(ids) == "Count 1, 2, 3, 4, 5 and stop here."
    text = TextStream(tokenizer, ["here.!"])
    assert text.push(ids) == "Count 1, 2, 3, 4, 5 and stop "
    assert text.finish() == "here."


def make_engine(tiny, **overrides) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, ModelConfig(model="tiny", **overrides))


async def collect(engine, prompt, params):
    chunks = [c async for c in engine.generate(prompt, params)]
    return "".join(c.text for c in chunks), chunks[-1]


def prompts_of(tokenizer, count):
    return [
        chat_prompt_ids(tokenizer, [{"role": "user", "content": f"Count from {i} to {i + 2 * i}."}])
        for i in range(count)
    ]


def test_batched_requests_equal_each_alone_and_greedy_generate(tiny):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, 6)
    params = [
        SamplingParams(max_tokens=12 + i, tau=1.0 if i % 2 else 1e-4, block_size=2 + i % 3) for i in range(6)
    ]

    async def run():
        engine = make_engine(tiny, max_batch_size=4)  # six requests: two wait for a row, then join mid-flight
        return await asyncio.gather(*(collect(engine, p, q) for p, q in zip(prompts, params, strict=True)))

    served = asyncio.run(run())
    for prompt, param, (text, last) in zip(prompts, params, served, strict=True):
        config = DecodeConfig.for_model(
            model, tokenizer, param.block_size, tau=param.tau, max_new_tokens=param.max_tokens
        )
        alone = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)[0]
        assert text == tokenizer.decode(alone.tokens, skip_special_tokens=True)
        assert (last.completion_tokens, last.forward_passes) == (len(alone.tokens), alone.forward_passes)
        assert last.prompt_tokens == len(prompt) and last.finish_reason == alone.finish_reason
        if param.tau == 1.0:
            greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=param.max_tokens)
            assert text == tokenizer.decode(greedy[0, len(prompt) :], skip_special_tokens=True)
            assert last.forward_passes == last.completion_tokens
        else:
            assert last.forward_passes < last.completion_tokens  # several tokens per forward


def test_a_long_prompt_joining_mid_stream_is_prefilled_in_chunks(tiny):
    """With `max_prefill_tokens`, a long prompt arriving while another request streams is cached a chunk per
    forward: no forward of the running request is wider than the budget or a window (the bound on its
    inter-token stall, in tokens computed rather than seconds), and both texts equal their solo runs."""
    model, tokenizer = tiny
    short = prompts_of(tokenizer, 1)[0]
    long = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Count from 1 to 9. " * 30}])
    params = SamplingParams(max_tokens=48, tau=0.5, block_size=4)
    widths, budget = [], 16
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    async def run():
        engine = make_engine(tiny, max_prefill_tokens=budget)
        first = engine.generate(short, params)
        texts = [(await anext(first)).text]
        texts.append((await anext(first)).text)  # it streams now
        widths.clear()
        joining = asyncio.ensure_future(collect(engine, long, params))
        texts += [chunk.text async for chunk in first]
        return "".join(texts), await joining

    try:
        first_text, (long_text, _) = asyncio.run(run())
    finally:
        hook.remove()
    assert len(long) > 8 * budget
    assert max(widths[: len(long) // budget]) <= max(budget, 2 * 4 - 1)
    for prompt, text in ((short, first_text), (long, long_text)):
        config = DecodeConfig.for_model(model, tokenizer, 4, tau=0.5, max_new_tokens=48)
        alone = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)[0]
        assert text == tokenizer.decode(alone.tokens, skip_special_tokens=True)


def test_cancelling_frees_the_row_and_the_queue(tiny):
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]

    async def run():
        engine = make_engine(tiny, max_batch_size=1)
        running = engine.generate(prompt, SamplingParams(max_tokens=500))
        waiting = engine.generate(prompt, SamplingParams(max_tokens=500))
        assert (await anext(running)).text == "" and (await anext(waiting)).text == ""
        await anext(running)  # it has a row now; the other one waits for it
        assert (engine.stats().running, engine.stats().waiting) == (1, 1)
        await waiting.aclose()
        await running.aclose()
        text, last = await collect(engine, prompt, SamplingParams(max_tokens=3))
        return engine.stats(), last

    stats, last = asyncio.run(run())
    assert last.completion_tokens == 3 and last.finish_reason == "length"
    assert stats.finished == {"cancelled": 2, "length": 1}
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.generated_tokens < 500


def test_forwards_run_on_the_given_thread_which_outlives_the_engine(tiny):
    """The bench hands the engine its own torch thread: every forward runs there, and closing the engine
    leaves that thread to its owner."""
    model, tokenizer = tiny
    threads = []
    hook = model.register_forward_hook(lambda *_: threads.append(threading.get_ident()))
    decode_thread = ThreadPoolExecutor(max_workers=1)

    async def run():
        engine = Engine(model, tokenizer, ModelConfig(model="tiny", max_batch_size=2), executor=decode_thread)
        params = SamplingParams(max_tokens=6, tau=0.5)
        done = await asyncio.gather(*(collect(engine, p, params) for p in prompts_of(tokenizer, 3)))
        await engine.close()
        return done

    try:
        served = asyncio.run(run())
    finally:
        hook.remove()
    ident = decode_thread.submit(threading.get_ident).result()  # still usable after the engine closed
    decode_thread.shutdown()
    assert all(last.completion_tokens == 6 for _, last in served)
    assert threads and set(threads) == {ident} and ident != threading.get_ident()


def test_the_next_forward_runs_while_the_last_one_is_delivered(tiny):
    """Turning tokens into text is off the forwards' critical path: each delivery here is held until the
    forward after the one it delivers has started (a loop that delivers first would wait forever), and
    the texts, a stop string's included, are the ones each request decodes alone."""
    _, tokenizer = tiny
    prompts = prompts_of(tokenizer, 3)
    params = [SamplingParams(max_tokens=10 + 4 * i, tau=0.5, block_size=3) for i in range(3)]

    async def run():
        engine = make_engine(tiny, max_batch_size=2)
        solo = [await collect(engine, p, q) for p, q in zip(prompts, params, strict=True)]
        stop = solo[1][0][4:7]  # ends the second request mid-stream, with rows still decoding
        params[1] = dataclasses.replace(params[1], stop=(stop,))
        step, deliver = engine._step, engine._deliver
        started, made_by, overlapped = [], {}, []

        def counted():  # in the decode thread
            started.append(True)
            outputs = step()
            made_by[id(outputs)] = len(started)
            return outputs

        def held(outputs, now):
            if outputs and engine.decoder.active:  # rows go on: the next forward must start meanwhile
                deadline = time.monotonic() + 5
                while len(started) <= made_by[id(outputs)] and time.monotonic() < deadline:
                    time.sleep(0.001)
                overlapped.append(len(started) > made_by[id(outputs)])
            deliver(outputs, now)

        engine._step, engine._deliver = counted, held
        pairs = zip(prompts, params, strict=True)
        together = await asyncio.gather(*(collect(engine, p, q) for p, q in pairs))
        return solo, stop, together, overlapped

    solo, stop, together, overlapped = asyncio.run(run())
    assert len(overlapped) >= 5 and all(overlapped)
    assert [text for text, _ in together] == [solo[0][0], solo[1][0][: solo[1][0].index(stop)], solo[2][0]]
    assert together[1][1].finish_reason == "stop"
    assert [last.completion_tokens for _, last in (together[0], together[2])] == [
        solo[0][1].completion_tokens,
        solo[2][1].completion_tokens,
    ]


def test_requests_follow_the_operating_tau_unless_pinned(tiny):
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]

    async def run():
        engine = make_engine(tiny, tau=1.0, block_size=4)
        follows = engine.generate(prompt, SamplingParams(max_tokens=40))
        pinned = engine.generate(prompt, SamplingParams(max_tokens=40, tau=1.0))
        for stream in (follows, pinned, follows):
            await anext(stream)
        engine.tau = 1e-4  # the tiny random model is never this unsure: every slot is accepted
        rest = [c async for c in follows][-1], [c async for c in pinned][-1]
        return engine.stats(), rest

    stats, (follows, pinned) = asyncio.run(run())
    assert stats.tau == 1e-4
    assert pinned.forward_passes == pinned.completion_tokens == 40
    assert follows.completion_tokens == 40 and follows.forward_passes < 20


def test_stats_snapshot_and_request_errors(tiny):
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]

    async def run():
        engine = make_engine(tiny, max_block_size=8)
        await engine.warm_up()
        await asyncio.gather(*(collect(engine, prompt, SamplingParams(max_tokens=8)) for _ in range(3)))
        errors = {}
        for name, ids, params in [
            ("too long", prompt, SamplingParams(max_tokens=engine.max_context)),
            ("empty", [], SamplingParams()),
            ("vocab", [engine.vocab_size], SamplingParams()),
            ("window", prompt, SamplingParams(block_size=9)),
            ("top_p", prompt, SamplingParams(top_p=2.0)),
        ]:
            with pytest.raises(ConfigError) as caught:
                await anext(engine.generate(ids, params, prompt_field="messages"))
            errors[name] = caught.value.field
        return engine.stats(), errors

    stats, errors = asyncio.run(run())
    assert errors == {
        "too long": "max_tokens",
        "empty": "messages",
        "vocab": "messages",
        "window": "block_size",
        "top_p": "top_p",
    }
    assert stats.finished == {"length": 4} and stats.generated_tokens == 8 + 3 * 8
    assert stats.tokens_per_s > 0 and stats.forwards_per_s > 0 and stats.tokens_per_forward >= 1
    assert 0 < stats.ttft_p50_s <= stats.ttft_p95_s and 0 < stats.itl_p50_s <= stats.itl_p95_s


def test_verified_requests_are_greedy_and_say_so(tiny):
    """`verify` per request or as the replica's mode: exactly the greedy text at any tau; usage names the
    mode. Sampling does not verify (refused when asked, skipped when it is only the replica's mode)."""
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, 3)

    async def run():
        engine = make_engine(tiny, max_batch_size=2, verify=True, tau=0.3)
        follows = [collect(engine, p, SamplingParams(max_tokens=16)) for p in prompts]
        lossy = collect(engine, prompts[0], SamplingParams(max_tokens=16, verify=False))
        sampled = collect(engine, prompts[1], SamplingParams(max_tokens=8, temperature=0.8, seed=1))
        done = await asyncio.gather(*follows, lossy, sampled)
        with pytest.raises(ConfigError) as refused:
            await anext(engine.generate(prompts[0], SamplingParams(verify=True, temperature=0.5)))
        return done, refused.value.field

    done, refused = asyncio.run(run())
    for prompt, (text, last) in zip(prompts, done[:3], strict=True):
        greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        assert text == tokenizer.decode(greedy[0, len(prompt) :], skip_special_tokens=True)
        assert (last.mode, last.tau) == ("verify", 0.3)
    # The verified mode's tau is no lossy operating point: the requests it does not verify decode exactly.
    assert (done[3][0], done[3][1].mode, done[3][1].tau) == (done[0][0], "ar", 1.0)
    assert (done[4][1].mode, done[4][1].tau) == ("ar", 1.0)
    assert refused == "verify"


def test_sampled_requests_never_decode_lossy_at_the_verify_rung(tiny):
    """The controller's verify rung (lossless, its tau below the operator's `tau_min`) reached mid-request:
    a sampled request that follows the operating point decodes at tau 1 there, exactly as a seeded run alone
    at tau 1; one that pins its own tau keeps it."""
    model, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]
    follows = SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
    pinned = dataclasses.replace(follows, tau=0.8)

    async def run():
        engine = make_engine(tiny, tau=1.0, block_size=4)
        streams = [engine.generate(prompt, follows), engine.generate(prompt, pinned)]
        texts = [[(await anext(s)).text, (await anext(s)).text] for s in streams]
        engine.tau, engine.verify = 0.5, True  # the rung at verify_tau 0.5, tau_min 0.7
        lasts = []
        for stream, text in zip(streams, texts, strict=True):
            chunks = [c async for c in stream]
            text += [c.text for c in chunks]
            lasts.append(chunks[-1])
        return ["".join(t) for t in texts], lasts

    (text, _), (last, pinned_last) = asyncio.run(run())
    assert (last.mode, last.tau) == ("ar", 1.0) and last.forward_passes == last.completion_tokens == 40
    assert (pinned_last.mode, pinned_last.tau) == ("mars", 0.8)
    config = DecodeConfig.for_model(model, tokenizer, 4, max_new_tokens=40, temperature=0.9, seed=7)
    config = dataclasses.replace(config, stop_token_ids=())
    alone = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)[0]
    assert text == tokenizer.decode(alone.tokens, skip_special_tokens=True)


def test_leaving_verified_decoding_mid_request_keeps_the_greedy_text(tiny):
    """The controller leaves the verify rung (or a deploy drops `verify_tau`) while greedy requests carry
    drafts: after the switch to lossy tau 1 every reply is still exactly `generate`'s."""
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, 4)

    async def run():
        engine = make_engine(tiny, verify=True, tau=1e-4, max_batch_size=4)  # every proposal is carried
        streams = [engine.generate(p, SamplingParams(max_tokens=64)) for p in prompts]
        texts = [[] for _ in streams]
        for _ in range(3):  # the accepted chunk, then two of text
            for stream, text in zip(streams, texts, strict=True):
                text.append((await anext(stream)).text)
        engine.tau, engine.verify = 1.0, False
        for stream, text in zip(streams, texts, strict=True):
            text += [c.text async for c in stream]
        return ["".join(t) for t in texts]

    for prompt, text in zip(prompts, asyncio.run(run()), strict=True):
        greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64)
        assert text == tokenizer.decode(greedy[0, len(prompt) :], skip_special_tokens=True)


def test_a_context_past_the_models_limit_is_refused(tiny):
    model, _ = tiny
    limit = model.config.max_position_embeddings
    with pytest.raises(ConfigError) as error:
        make_engine(tiny, max_context=limit + 1)
    assert error.value.field == "max_context"
    assert make_engine(tiny, max_context=limit).max_context == limit


def test_logprobs_are_the_plain_models_own(tiny):
    """The tiny preset is a plain model that MARS gave a mask row (appended past its vocabulary): reported
    log-probabilities, of generated tokens and of an echoed prompt, are log_softmax of the logits the model
    had before the row, not a softmax the mask row dilutes."""
    model, tokenizer = tiny
    mask = tokenizer.mask_token_id
    assert mask == model.get_output_embeddings().weight.shape[0] - 1  # the row MARS added, last
    prompt = prompts_of(tokenizer, 1)[0]

    async def run():
        engine = make_engine(tiny)
        params = SamplingParams(max_tokens=12, tau=1.0, logprobs=2, ignore_eos=True)
        chunks = [c async for c in engine.generate(prompt, params)]
        return chunks, await engine.prompt_logprobs(prompt, 2)

    chunks, echoed = asyncio.run(run())
    tokens = [t for c in chunks for t in c.token_ids]
    with torch.no_grad():
        original = model(torch.tensor([prompt + tokens])).logits[0, :, :mask]  # the model before the row
    expected = torch.log_softmax(original.float(), dim=-1)
    got = [lp.logprob for c in chunks for lp in c.logprobs or []]
    assert got == pytest.approx(
        [expected[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)], abs=1e-5
    )
    echo = [lp.logprob for lp in echoed[1:]]
    assert echo == pytest.approx([expected[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-5)


def test_window_defaults_to_the_trained_block_size(tiny):
    model, tokenizer = tiny
    model.config.mars_block_size = 2
    try:
        engine = make_engine(tiny)
        assert (engine.block_size, engine.max_block_size) == (2, 2)
        prompt = prompts_of(tokenizer, 1)[0]

        async def wider():
            await anext(engine.generate(prompt, SamplingParams(block_size=4)))

        with pytest.raises(ConfigError) as caught:
            asyncio.run(wider())
        assert caught.value.field == "block_size"
        assert make_engine(tiny, max_block_size=8).max_block_size == 8  # wider, asked for explicitly
    finally:
        del model.config.mars_block_size


def test_close_ends_waiting_and_running_requests(tiny):
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]

    async def run():
        engine = make_engine(tiny, max_batch_size=1)
        running = engine.generate(prompt, SamplingParams(max_tokens=500))
        waiting = engine.generate(prompt, SamplingParams(max_tokens=500))
        await anext(running)
        await anext(waiting)
        await anext(running)
        await engine.close()
        ends = []
        for stream in (running, waiting):
            with pytest.raises(RuntimeError, match="shut down"):
                async for _ in stream:
                    pass
            ends.append("error")
        return ends, engine.stats()

    ends, stats = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert ends == ["error", "error"] and stats.finished.get("error") == 2
    assert (stats.running, stats.waiting) == (0, 0)


def test_text_merged_before_a_failure_is_delivered(tiny, monkeypatch):
    _, tokenizer = tiny
    engine = make_engine(tiny)
    monkeypatch.setattr(engine, "_start", lambda: None)  # no decode loop: the outbox is filled by hand

    async def run():
        stream = engine.generate(prompts_of(tokenizer, 1)[0], SamplingParams(max_tokens=8))
        await anext(stream)
        request = engine._waiting[0]
        for text in ("Hel", "lo"):
            request.outbox.put_nowait(request.chunk(text, tokenizer))
        request.outbox.put_nowait(RuntimeError("decoding failed"))
        merged = await anext(stream)
        with pytest.raises(RuntimeError, match="decoding failed"):
            await anext(stream)
        return merged.text

    assert asyncio.run(run()) == "Hello"


def test_completion_tokens_stop_at_the_stop_string(tiny):
    """At tau 1e-4 a forward accepts 4 tokens: those past a stop string are decoded, not completion."""
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]
    params = SamplingParams(max_tokens=24, tau=1e-4, block_size=4)

    async def run():
        engine = make_engine(tiny)
        chunks = [c async for c in engine.generate(prompt, params)]
        full = "".join(c.text for c in chunks)
        ids = [t for c in chunks for t in c.token_ids]
        stop = full[6:9]
        stopped = await collect(engine, prompt, dataclasses.replace(params, stop=(stop,)))
        return full, ids, stop, stopped

    full, ids, stop, (text, last) = asyncio.run(run())
    assert text == full[: full.index(stop)] and last.finish_reason == "stop"
    reach = full.index(stop) + len(stop)
    through = next(
        k for k in range(1, 25) if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= reach
    )
    assert last.completion_tokens == through < 24


def test_cache_refuses_attention_it_cannot_hold():
    from conftest import build_tiny

    from mars_ray.core.errors import ConfigError
    from mars_ray.core.kv_cache import RaggedCache

    sliding = build_tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ConfigError) as error:
        RaggedCache(sliding)
    assert error.value.field == "model" and "sliding" in error.value.message
    model = build_tiny("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError) as error:
        RaggedCache(model)
    assert error.value.field == "attn_implementation"


def test_stream_interval_coalesces_chunks_without_changing_text(tiny):
    _, tokenizer = tiny
    prompt = prompts_of(tokenizer, 1)[0]

    async def run(interval):
        engine = make_engine(tiny, stream_interval_s=interval)
        chunks = [c async for c in engine.generate(prompt, SamplingParams(max_tokens=40))]
        await engine.close()
        return chunks

    per_forward, coalesced = asyncio.run(run(0.0)), asyncio.run(run(0.05))
    assert "".join(c.text for c in coalesced) == "".join(c.text for c in per_forward)
    assert [t for c in coalesced for t in c.token_ids] == [t for c in per_forward for t in c.token_ids]
    assert len(coalesced) < len(per_forward) / 2  # 40 forwards: a chunk each without the interval
    assert coalesced[-1].completion_tokens == 40 and coalesced[-1].finish_reason == "length"


@pytest.mark.slow
def test_a_compiled_engine_compiles_only_while_warming_up():
    """With `compile`, warm-up compiles every kind of step; then a mixed load (one row and several, AR,
    MARS and verified windows, rows joining a running batch) compiles nothing more and streams the text
    the eager engine streams."""
    compiled = models.load("tiny", dtype=torch.float32)
    eager = models.load("tiny", dtype=torch.float32)
    _, tokenizer = eager
    prompts = prompts_of(tokenizer, 5)
    params = [
        SamplingParams(max_tokens=16, block_size=1),
        SamplingParams(max_tokens=16, tau=0.5, block_size=4),
        SamplingParams(max_tokens=16, tau=0.5, block_size=4, verify=True),
        SamplingParams(max_tokens=24, tau=0.7, block_size=3),
        SamplingParams(max_tokens=12, block_size=1),
    ]

    async def serve(tiny, compile: bool):
        model, tokenizer = tiny
        engine = Engine(model, tokenizer, ModelConfig(model="tiny", compile=compile, max_batch_size=2))
        await engine.warm_up()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        together = await asyncio.gather(*map(lambda p, q: collect(engine, p, q), prompts, params))
        alone = await collect(engine, prompts[1], params[1])
        return [text for text, _ in [*together, alone]], graphs

    torch._dynamo.utils.counters.clear()
    expected, _ = asyncio.run(serve(eager, compile=False))
    texts, warmed_up = asyncio.run(serve(compiled, compile=True))
    assert warmed_up >= 4  # one row or more, a window of one or more: each compiled while warming up
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == warmed_up
    assert texts == expected
