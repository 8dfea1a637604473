"""The decoders: one acceptance rule; tau = 1 is exactly greedy AR; caches never change the answer."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, VOCAB, build_tiny, random_prompts

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeState, accept_length
from mars_ray.core.decoder import SlidingDecoder, decode_cached, decode_continuous
from mars_ray.core.errors import ConfigError
from mars_ray.core.reference import decode_block_cached, decode_reference
from mars_ray.core.sampling import propose


def hf_greedy(model, prompts, max_new_tokens, eos=EOS_ID):
    """transformers' own greedy decoding of a left-padded batch, cut at EOS (EOS kept, as generate does)."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (longest - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=attention,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
    )[:, longest:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


def without_mask(logits):
    """Logits with the mask token out of the softmax: it is not text (`text_log_probs`)."""
    return logits.index_fill(-1, torch.tensor([MASK_ID]), float("-inf"))


def frequent_token(model, prompts):
    """A token that greedy decoding emits mid-way for some prompts: a stop token that really stops."""
    counts = torch.bincount(
        torch.tensor([t for row in hf_greedy(model, prompts, 24, eos=-1) for t in row[3:]])
    )
    return int(counts.argmax())


@pytest.mark.parametrize(
    ("confidence", "tau", "limit", "expected"),
    [
        ([0.1, 0.2, 0.99, 0.99], 0.9, 4, 1),  # slot 0 forced; high slots after a failure are not taken
        ([0.1, 0.99, 0.99, 0.5], 0.9, 4, 3),
        ([0.1, 0.99, 0.99, 0.99], 0.9, 4, 4),
        ([0.1, 0.99, 0.99, 0.99], 0.9, 2, 2),  # cap
        ([1.0, 1.0, 1.0, 1.0], 1.0, 4, 1),  # tau >= 1 is one token even when p rounds to 1.0
        ([0.5, 0.9, 0.8], 0.9, 4, 2),  # >= is inclusive
    ],
)
def test_accept_length(confidence, tau, limit, expected):
    assert accept_length(confidence, tau, limit) == expected


def test_config_rejects_bad_values():
    for bad in [
        dict(tau=0.0),
        dict(tau=float("nan")),
        dict(block_size=0),
        dict(max_new_tokens=0),
        dict(top_p=0.0),
    ]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            DecodeConfig(**bad)


def test_tau_one_equals_generate_every_decoder(tiny_model):
    prompts = random_prompts(12, seed=1)
    stop = frequent_token(tiny_model, prompts)
    config = DecodeConfig(tau=1.0, block_size=4, max_new_tokens=24, stop_token_ids=(stop,))
    expected = hf_greedy(tiny_model, prompts, 24, eos=stop)
    assert [decode_reference(tiny_model, p, MASK_ID, config).tokens for p in prompts] == expected
    assert [r.tokens for r in decode_cached(tiny_model, prompts, MASK_ID, config)] == expected
    for cache_block in (4, 16):
        for fuse in (False, True):
            results = decode_block_cached(tiny_model, prompts, MASK_ID, config, cache_block, fuse_extend=fuse)
            assert [r.tokens for r in results] == expected
    # a left-padded batch equals the same prompts decoded one by one by transformers
    assert expected == [hf_greedy(tiny_model, [p], 24, eos=stop)[0] for p in prompts]
    assert any(len(t) < 24 for t in expected) and any(
        len(t) == 24 for t in expected
    )  # both stop reasons seen


@pytest.mark.parametrize("tau", [0.9, 0.7, 0.5, 0.3])
def test_cached_equals_reference_below_one(tiny_model, tau):
    prompts = random_prompts(8, seed=2)
    config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=24, stop_token_ids=(EOS_ID,))
    reference = [decode_reference(tiny_model, p, MASK_ID, config) for p in prompts]
    batched = decode_cached(tiny_model, prompts, MASK_ID, config)
    for ref, got in zip(reference, batched, strict=True):
        assert (got.tokens, got.accepted, got.forward_passes) == (
            ref.tokens,
            ref.accepted,
            ref.forward_passes,
        )
    if tau <= 0.5:
        assert sum(len(r.tokens) for r in reference) > 1.5 * sum(r.forward_passes for r in reference)


@pytest.mark.parametrize("tau", [0.9, 0.5])
@pytest.mark.parametrize("fuse", [False, True])
def test_block_cached_batch_equals_rows_alone(tiny_model, tau, fuse):
    prompts = random_prompts(6, seed=3)
    config = DecodeConfig(tau=tau, max_new_tokens=20, stop_token_ids=(EOS_ID,))
    batch = decode_block_cached(tiny_model, prompts, MASK_ID, config, cache_block=8, fuse_extend=fuse)
    alone = [
        decode_block_cached(tiny_model, [p], MASK_ID, config, cache_block=8, fuse_extend=fuse)[0]
        for p in prompts
    ]
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.accepted for r in batch] == [r.accepted for r in alone]


def test_block_cached_fused_extend_saves_forwards(tiny_llama):
    prompts = random_prompts(4, seed=4)
    config = DecodeConfig(tau=0.7, max_new_tokens=32)
    paper = decode_block_cached(tiny_llama, prompts, MASK_ID, config, cache_block=8)
    fused = decode_block_cached(tiny_llama, prompts, MASK_ID, config, cache_block=8, fuse_extend=True)
    assert [r.tokens for r in paper] == [r.tokens for r in fused]
    assert all(f.forward_passes < p.forward_passes for p, f in zip(paper, fused, strict=True))


def test_mixed_taus_and_windows_share_a_batch(tiny_llama):
    prompts = random_prompts(6, seed=5)
    configs = [
        DecodeConfig(tau=t, block_size=w, max_new_tokens=20, stop_token_ids=(EOS_ID,))
        for t, w in [(1.0, 4), (0.5, 4), (0.5, 2), (0.3, 8), (0.9, 4), (1.0, 1)]
    ]
    batch = decode_cached(tiny_llama, prompts, MASK_ID, configs)
    alone = [decode_reference(tiny_llama, p, MASK_ID, c) for p, c in zip(prompts, configs, strict=True)]
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert max(r.accepted[0] for r in batch) > 1
    assert all(max(r.accepted) <= c.window for r, c in zip(batch, configs, strict=True))


def test_rows_join_and_leave_mid_flight(tiny_llama):
    """Continuous batching: a row joining a running batch, or others leaving, changes nothing for it."""
    prompts = random_prompts(5, seed=6)
    config = DecodeConfig(tau=0.5, block_size=4, max_new_tokens=16)
    alone = [decode_reference(tiny_llama, p, MASK_ID, config).tokens for p in prompts]
    decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID)
    states = [DecodeState(p, config) for p in prompts]
    decoder.add(states[0])
    decoder.add(states[1])
    decoder.step()
    decoder.add(states[2])
    decoder.step()
    decoder.remove([states[1]])  # a client went away
    decoder.add(states[3])
    decoder.add(states[4])
    while decoder.active:
        decoder.step()
    assert decoder.cache.valid.shape[0] == 0
    for i in (0, 2, 3, 4):
        assert states[i].tokens == alone[i]


@pytest.mark.parametrize("budget", [1, 5, None])
def test_chunked_prefill_bounds_each_forward_and_changes_no_token(tiny_llama, budget):
    """Long prompts joining a running batch are cached at most `budget` tokens a forward (oldest first)
    while the batch keeps decoding; every row still decodes exactly what it would alone."""
    short = random_prompts(2, seed=30)
    long = random_prompts(2, 30, 31, seed=31)
    config = DecodeConfig(tau=0.5, block_size=4, max_new_tokens=24)
    prompts = short + long
    alone = [decode_reference(tiny_llama, p, MASK_ID, config).tokens for p in prompts]
    widths = []
    hook = tiny_llama.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID, prefill_budget=budget)
        states = [DecodeState(p, config) for p in prompts]
        decoder.add(states[0])
        decoder.add(states[1])
        decoder.step()  # an idle decoder: they join at once
        widths.clear()
        for state in states[2:]:
            decoder.add(state)
        decoded_while_joining, busy_widths = 0, []
        while decoder.active:
            joining, busy = bool(decoder.joining), bool(decoder.seqs)
            widths.clear()
            decoded = decoder.step()
            if joining and busy:  # rows were decoding while the long prompts were cached
                decoded_while_joining += bool(decoded)
                busy_widths += [width for _, width in widths]
    finally:
        hook.remove()
    assert [s.tokens for s in states] == alone
    assert decoded_while_joining >= 1
    window = 2 * 4 - 1  # a running row's accepted tokens (<= 4) and 3 masks
    if budget is None:
        assert max(busy_widths) == 29  # both prompts, but their last tokens, in one forward
    else:
        assert max(busy_widths) <= max(budget, window)  # no forward wider than the budget or a window
        assert decoded_while_joining >= min(29 // budget, 5)


@pytest.mark.parametrize("budget", [None, 3])
def test_random_joins_and_cancellations_change_no_token(tiny_llama, budget):
    """A seeded storm of rows joining (mid-prefill too), being cancelled and finishing, lossy and verified,
    with and without chunked prefill: every row that finishes decodes exactly what it would alone (a
    verified row: greedy decoding)."""
    rng = random.Random(budget or 0)
    decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID, prefill_budget=budget)
    states, cancelled = [], set()
    for _ in range(60):
        if rng.random() < 0.35:
            prompt = [rng.randrange(3, MASK_ID) for _ in range(rng.randint(1, 20))]
            config = DecodeConfig(
                tau=rng.choice([1.0, 0.6, 0.3]),
                block_size=rng.choice([2, 4]),
                max_new_tokens=rng.randint(1, 12),
                verify=rng.random() < 0.4,
            )
            states.append(DecodeState(prompt, config))
            decoder.add(states[-1])
        if rng.random() < 0.1 and decoder.active:
            victim = rng.choice(decoder.seqs + decoder.joining)
            cancelled.add(id(victim))
            decoder.remove([victim])
        decoder.step()
    while decoder.active:
        decoder.step()
    assert decoder.cache.valid.shape[0] == 0 and decoder.side.valid.shape[0] == 0
    finished = [s for s in states if id(s) not in cancelled]
    assert len(finished) >= 8
    for state in finished:
        config = state.config
        expected = dataclasses.replace(config, tau=1.0, verify=False) if config.verify else config
        assert state.tokens == decode_reference(tiny_llama, state.prompt, MASK_ID, expected).tokens


@pytest.mark.parametrize(("tau", "verify"), [(1.0, False), (0.3, True), (0.3, False)])
def test_logprobs_are_the_models_own_for_greedy_and_verified_tokens(tiny_llama, tau, verify):
    """At tau = 1 and verified at any tau, every token's log-probability (and its top 3) is what a plain
    forward over prompt + output gives at that position, over the text tokens (the mask is none); a lossy
    token from a mask slot carries a log-probability of its own slot, where it is the likeliest."""
    prompts = random_prompts(3, seed=41)  # replies without the mask, an ordinary row of this random model
    config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=10, verify=verify, logprobs=3)
    for result, prompt in zip(decode_cached(tiny_llama, prompts, MASK_ID, config), prompts, strict=True):
        assert [lp.token for lp in result.logprobs] == result.tokens
        with torch.no_grad():
            logits = tiny_llama(torch.tensor([prompt + result.tokens])).logits[0].float()
        expected = torch.log_softmax(without_mask(logits[len(prompt) - 1 : -1]), dim=-1)
        exact = [1] * len(result.tokens) if tau >= 1 or verify else None
        if exact is None:  # lossy: a forward's first token is exact, the others came from mask slots
            exact = [j == 0 for n in result.accepted for j in range(n)]
        for i, (lp, is_ar) in enumerate(zip(result.logprobs, exact, strict=True)):
            assert lp.top[0][0] == lp.token and len(lp.top) == 3  # greedy: the token is its slot's best
            if is_ar:
                assert lp.logprob == pytest.approx(expected[i, lp.token].item(), abs=1e-6)
                assert [t for t, _ in lp.top] == expected[i].topk(3).indices.tolist()
            else:
                assert lp.logprob <= 0


@pytest.mark.parametrize(("tau", "verify"), [(1.0, False), (0.3, True), (0.3, False)])
def test_min_tokens_holds_stop_tokens_back_as_generate_does(tiny_llama, tau, verify):
    """A stop token the model would emit early is never proposed before `min_tokens`: greedy and verified
    decoding equal HF `generate(min_new_tokens=...)`; lossy decoding stops no earlier either."""
    for prompt in random_prompts(3, seed=50):
        free = decode_reference(tiny_llama, prompt, MASK_ID, DecodeConfig(max_new_tokens=12)).tokens
        stop = free[1]  # the second token would end the reply at once
        config = DecodeConfig(
            tau=tau, block_size=4, max_new_tokens=12, stop_token_ids=(stop,), min_tokens=6, verify=verify
        )
        got = decode_cached(tiny_llama, [prompt], MASK_ID, config)[0].tokens
        assert stop not in got[:6]
        if tau >= 1 or verify:
            options = {"max_new_tokens": 12, "min_new_tokens": 6, "eos_token_id": stop}
            expected = tiny_llama.generate(torch.tensor([prompt]), do_sample=False, **options)
            expected = expected[0, len(prompt) :].tolist()
            expected = expected[: expected.index(stop) + 1] if stop in expected else expected
            assert got == expected


def test_window_slots_do_not_depend_on_trailing_masks(tiny_llama):
    prompt = torch.tensor([random_prompts(1, seed=7)[0]])
    w = 4
    short = tiny_llama(torch.cat([prompt, torch.full((1, w), MASK_ID)], 1)).logits[:, -w - 1 : -1]
    long = tiny_llama(torch.cat([prompt, torch.full((1, 2 * w), MASK_ID)], 1)).logits[:, -2 * w - 1 : -w - 1]
    torch.testing.assert_close(short, long, rtol=0, atol=1e-12)


def test_stop_tokens_and_budget(tiny_llama):
    prompt = random_prompts(1, seed=8)[0]
    free = decode_reference(tiny_llama, prompt, MASK_ID, DecodeConfig(tau=0.3, max_new_tokens=12))
    assert len(free.tokens) == 12 and free.finish_reason == "length"
    stop = free.tokens[5]
    first = free.tokens.index(stop)
    for decode in (decode_cached, decode_block_cached):
        got = decode(
            tiny_llama, [prompt], MASK_ID, DecodeConfig(tau=0.3, max_new_tokens=12, stop_token_ids=(stop,))
        )[0]
        assert got.tokens == free.tokens[: first + 1] and got.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny_llama):
    prompt = random_prompts(1, seed=9)[0]
    config = DecodeConfig(tau=0.5, temperature=1.0, top_p=0.9, seed=123, max_new_tokens=16)
    first = decode_cached(tiny_llama, [prompt], MASK_ID, config)[0].tokens
    assert first == decode_cached(tiny_llama, [prompt], MASK_ID, config)[0].tokens
    other = DecodeConfig(tau=0.5, temperature=1.0, top_p=0.9, seed=124, max_new_tokens=16)
    greedy = decode_cached(tiny_llama, [prompt], MASK_ID, DecodeConfig(tau=0.5, max_new_tokens=16))[0].tokens
    assert first != decode_cached(tiny_llama, [prompt], MASK_ID, other)[0].tokens or first != greedy


def test_seeded_sampling_does_not_depend_on_its_neighbours(tiny_llama):
    """A seeded row draws for its own window's slots only: beside a wider window, and beside a verified row
    whose drafts move every row's window right, it samples what it samples alone, and what the reference
    decoder samples."""
    prompts = random_prompts(3, seed=60)
    neighbours = [
        DecodeConfig(tau=0.5, block_size=8, max_new_tokens=16),
        DecodeConfig(tau=0.1, block_size=4, max_new_tokens=16, verify=True),
    ]
    for tau in (0.5, 1.0):
        seeded = DecodeConfig(tau=tau, block_size=4, temperature=1.0, seed=7, max_new_tokens=16)
        alone = decode_cached(tiny_llama, prompts[:1], MASK_ID, seeded)[0].tokens
        batched = decode_cached(tiny_llama, prompts, MASK_ID, [seeded, *neighbours])
        assert batched[0].tokens == alone
        assert decode_reference(tiny_llama, prompts[0], MASK_ID, seeded).tokens == alone
        assert sum(batched[2].drafted) > 0  # the verified neighbour did carry drafts


def test_windows_stop_at_the_end_of_the_context(tiny_llama):
    """Rows decoding up to the model's last position, beside wider windows and verified drafts: no mask or
    draft is fed at a position at or past `max_position_embeddings` (a row's window is capped by what it may
    still produce; a neighbour's wider window is holes there), and every row decodes its reference tokens."""
    limit = 40
    model = build_tiny("llama", max_position_embeddings=limit)
    prompts = random_prompts(5, seed=62)
    kinds = [(0.3, 4, False, 0.0), (0.5, 8, False, 0.0), (0.1, 4, True, 0.0), (1.0, 4, False, 0.0)]
    kinds.append((0.5, 4, False, 1.0))
    configs = [
        DecodeConfig(tau=t, block_size=w, verify=v, temperature=temp, seed=3, max_new_tokens=limit - len(p))
        for p, (t, w, v, temp) in zip(prompts, kinds, strict=True)
    ]
    positions = []

    def record(module, args, kwargs):
        given = kwargs.get("position_ids")
        positions.append(kwargs["input_ids"].shape[1] - 1 if given is None else int(given.max()))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        results = decode_cached(model, prompts, MASK_ID, configs)
        for prompt, config, result in zip(prompts, configs, results, strict=True):
            expected = dataclasses.replace(config, tau=1.0, verify=False) if config.verify else config
            assert result.tokens == decode_reference(model, prompt, MASK_ID, expected).tokens
            assert result.finish_reason == "length"
    finally:
        hook.remove()
    assert max(positions) == limit - 2  # the last token fed is the one before the last produced


def test_a_row_that_leaves_verified_decoding_drops_its_drafts(tiny_llama):
    """Verified rows switched to lossy tau 1 mid-flight (as the engine's operating point leaves the verify
    rung) stay exactly greedy: the drafts they carried are never fed as a lossy row's context."""
    prompts = random_prompts(4, seed=61)
    config = DecodeConfig(tau=0.1, block_size=4, max_new_tokens=24, verify=True)
    decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID)
    states = [DecodeState(p, config) for p in prompts]
    for state in states:
        decoder.add(state)
    decoder.step()
    while not any(state.drafts for state in states):  # until some row carries drafts into the switch
        decoder.step()
    assert not any(state.finished for state in states)
    for state in states:
        state.reconfigure(dataclasses.replace(config, tau=1.0, verify=False))
    for _ in range(24):  # a token a forward now: enough to finish every row
        decoder.step()
    assert not decoder.active
    assert [state.tokens for state in states] == hf_greedy(tiny_llama, prompts, 24, eos=-1)


def test_eager_attention_matches_sdpa():
    prompts = random_prompts(4, seed=10)
    config = DecodeConfig(tau=0.5, max_new_tokens=16, stop_token_ids=(EOS_ID,))
    sdpa = build_tiny("llama", attn_implementation="sdpa")
    eager = build_tiny("llama", attn_implementation="eager")
    assert [r.tokens for r in decode_cached(sdpa, prompts, MASK_ID, config)] == [
        r.tokens for r in decode_cached(eager, prompts, MASK_ID, config)
    ]


def test_compaction_keeps_answers(tiny_llama):
    """Many short rows leaving after a long one joined leave holes; compaction must not change tokens."""
    prompts = [random_prompts(1, 40, 41, seed=11)[0]] + random_prompts(3, seed=12)
    config = DecodeConfig(tau=0.3, block_size=8, max_new_tokens=40)
    alone = [decode_reference(tiny_llama, p, MASK_ID, config).tokens for p in prompts]
    decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID)
    states = [DecodeState(p, config) for p in prompts]
    for s in states:
        decoder.add(s)
    widths = []
    while decoder.active:
        decoder.step()
        widths.append(decoder.cache.valid.shape[1])
    assert [s.tokens for s in states] == alone
    assert any(b < a for a, b in zip(widths, widths[1:], strict=False))  # the cache shrank at least once


def test_continuous_decoding_equals_each_prompt_alone(tiny_llama):
    """At most 4 rows at a time over 11 prompts: rows join a running batch in groups, results in order."""
    prompts = random_prompts(11, seed=13)
    config = DecodeConfig(tau=0.5, block_size=4, max_new_tokens=14, stop_token_ids=(EOS_ID,))
    found = dict(decode_continuous(tiny_llama, prompts, MASK_ID, config, PAD_ID, max_batch=4))
    assert sorted(found) == list(range(11))
    for i, prompt in enumerate(prompts):
        alone = decode_reference(tiny_llama, prompt, MASK_ID, config)
        assert (found[i].tokens, found[i].accepted, found[i].forward_passes) == (
            alone.tokens,
            alone.accepted,
            alone.forward_passes,
        )


class FakeTokenizer:
    eos_token_id = EOS_ID

    def __len__(self) -> int:
        return VOCAB - 6  # as if the embedding had padded rows past the tokenizer


def test_config_for_a_model_reads_its_checkpoint(tiny_llama):
    model = build_tiny("llama")
    model.generation_config.eos_token_id = [EOS_ID, 7]
    default = DecodeConfig.for_model(model, FakeTokenizer(), tau=0.9)
    assert default.block_size == 4 and default.stop_token_ids == (EOS_ID, 7) and default.tau == 0.9
    assert default.vocab_limit == VOCAB - 6
    model.config.mars_block_size = 8  # what training writes
    assert DecodeConfig.for_model(model, FakeTokenizer()).block_size == 8
    assert DecodeConfig.for_model(model, FakeTokenizer(), block_size=2).block_size == 2
    with pytest.raises(ConfigError) as error:
        DecodeConfig.for_model(model, FakeTokenizer(), block_size=16)
    assert error.value.field == "block_size"
    assert DecodeConfig.for_model(model, FakeTokenizer(), block_size=16, allow_wider=True).block_size == 16
    model.config.mars_slot_temperatures = [1.0, 1.5, 2.0]
    assert DecodeConfig.for_model(model, FakeTokenizer()).slot_temperatures == (1.0, 1.5, 2.0)
    assert DecodeConfig.for_model(model, FakeTokenizer(), calibrated=False).slot_temperatures == ()


def test_slot_temperatures_change_confidence_not_tokens(tiny_llama):
    prompts = random_prompts(6, seed=14)

    def run(tau, temperatures, decode=decode_cached):
        config = DecodeConfig(tau=tau, max_new_tokens=20, slot_temperatures=temperatures)
        return decode(tiny_llama, prompts, MASK_ID, config)

    greedy = [r.tokens for r in run(1.0, ())]
    for temperatures in ((1.0, 0.5, 0.5, 0.5), (1.0, 3.0, 3.0, 3.0)):
        assert [r.tokens for r in run(1.0, temperatures)] == greedy
        assert [r.tokens for r in run(1.0, temperatures, decode_block_cached)] == greedy
    # a sharper slot is more confident (fewer forwards for the same budget), a softer one less
    sharp, raw, soft = ((1.0, 0.5, 0.5, 0.5), (), (1.0, 3.0, 3.0, 3.0))
    forwards = {t: sum(r.forward_passes for r in run(0.5, t)) for t in (sharp, raw, soft)}
    assert forwards[sharp] < forwards[raw] < forwards[soft]
    # the reference decoder reads the same calibrated confidences
    config = DecodeConfig(tau=0.5, max_new_tokens=20, slot_temperatures=(1.0, 0.7, 1.3, 2.0))
    assert [decode_reference(tiny_llama, p, MASK_ID, config).tokens for p in prompts] == [
        r.tokens for r in decode_cached(tiny_llama, prompts, MASK_ID, config)
    ]


@pytest.mark.parametrize("tau", [0.9, 0.5, 0.1])
def test_verified_decoding_is_exactly_greedy(tiny_model, tau):
    """Whatever the masks propose, verification keeps exactly greedy AR: batch 1 and a ragged batch."""
    prompts = random_prompts(10, seed=15)
    stop = frequent_token(tiny_model, prompts)
    expected = hf_greedy(tiny_model, prompts, 24, eos=stop)
    config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=24, stop_token_ids=(stop,), verify=True)
    alone = [decode_cached(tiny_model, [p], MASK_ID, config)[0] for p in prompts]
    assert [r.tokens for r in alone] == expected
    assert [r.tokens for r in decode_cached(tiny_model, prompts, MASK_ID, config)] == expected
    found = dict(decode_continuous(tiny_model, prompts, MASK_ID, config, PAD_ID, max_batch=3))
    assert [found[i].tokens for i in range(len(prompts))] == expected
    drafted = sum(sum(r.drafted) for r in alone)
    assert drafted > 0  # proposals were carried and checked
    if tau <= 0.1:
        assert all(sum(r.drafted) >= sum(r.accepted) - len(r.accepted) for r in alone)


def test_verified_rows_share_a_batch_with_lossy_ones_and_join_mid_flight(tiny_llama):
    prompts = random_prompts(6, seed=16)
    configs = [
        DecodeConfig(tau=t, block_size=w, max_new_tokens=18, verify=v)
        for t, w, v in [
            (0.3, 4, True),
            (0.5, 4, False),
            (0.6, 2, True),
            (1.0, 4, True),
            (0.2, 8, True),
            (0.9, 4, False),
        ]
    ]
    alone = [decode_cached(tiny_llama, [p], MASK_ID, c)[0] for p, c in zip(prompts, configs, strict=True)]
    decoder = SlidingDecoder(tiny_llama, MASK_ID, PAD_ID)
    states = [DecodeState(p, c) for p, c in zip(prompts, configs, strict=True)]
    for s in states[:3]:
        decoder.add(s)
    decoder.step()
    decoder.step()
    for s in states[3:]:
        decoder.add(s)
    while decoder.active:
        decoder.step()
    assert [s.tokens for s in states] == [r.tokens for r in alone]
    greedy = hf_greedy(tiny_llama, prompts, 18, eos=-1)
    for state, expected in zip(states, greedy, strict=True):
        if state.config.verify:
            assert state.tokens == expected


def test_verify_refuses_sampling_and_the_block_cache(tiny_llama):
    with pytest.raises(ConfigError) as error:
        DecodeConfig(verify=True, temperature=0.7)
    assert error.value.field == "verify"
    with pytest.raises(ConfigError):
        decode_block_cached(tiny_llama, random_prompts(1), MASK_ID, DecodeConfig(verify=True, tau=0.5))


def test_mask_slots_never_propose_the_mask_or_padded_rows():
    """Logits that favour the mask token, then a padded row: slot 0 keeps the model's greedy choice (as
    `generate` would), every mask slot takes the best real token."""
    logits = torch.zeros(2, 4, VOCAB)
    logits[:, :, MASK_ID] = 9.0
    logits[:, :, VOCAB - 3] = 8.0  # a padded row (past vocab_limit)
    logits[:, :, 11] = 7.0
    seqs = [
        DecodeState([1], DecodeConfig(vocab_limit=VOCAB - 6)),
        DecodeState([1], DecodeConfig()),
    ]
    tokens, _, _ = propose(logits, seqs, first_slot=[0, 1], mask_id=MASK_ID)
    assert tokens[0] == [MASK_ID, 11, 11, 11]
    assert tokens[1] == [MASK_ID, MASK_ID, VOCAB - 3, VOCAB - 3]  # no limit: only the mask is banned


def test_tau_one_at_batch_one_is_generate_bit_for_bit_in_bf16():
    """Without holes the decoder lets the model build its causal mask, so at batch 1 it runs the kernels
    HF `generate` runs: in bf16, where a masked and an unmasked attention kernel round differently, the
    tokens and every log-probability (over the text tokens) are equal exactly, not within a tolerance."""
    model = build_tiny(
        "llama", sharpness=1.0, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512
    )  # wide enough that the two kernels round differently on some of these rows
    config = DecodeConfig(tau=1.0, block_size=4, max_new_tokens=24, logprobs=1)
    for prompt in random_prompts(6, low=20, high=60, seed=41):
        (result,) = decode_cached(model, [prompt], MASK_ID, config, PAD_ID)
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=-1,
            pad_token_id=PAD_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(without_mask(step[0].float()), dim=-1)[token].item()
            for step, token in zip(out.logits, tokens, strict=True)
        ]
        assert result.tokens == tokens
        assert [lp.logprob for lp in result.logprobs] == logprobs


@pytest.mark.slow
def test_compiled_steps_decode_the_eager_tokens():
    """`compile_steps` runs the cached steps through torch.compile: same tokens, AR and MARS, batched."""
    from mars_ray.core.compile import compile_steps

    eager = build_tiny("llama", dtype=torch.float32)
    compiled = build_tiny("llama", dtype=torch.float32)
    compile_steps(compiled)
    torch._dynamo.utils.counters.clear()
    prompts = random_prompts(4, seed=3)
    for tau, rows in ((1.0, prompts[:1]), (0.5, prompts)):
        config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=12)
        expected = [r.tokens for r in decode_cached(eager, rows, MASK_ID, config)]
        assert [r.tokens for r in decode_cached(compiled, rows, MASK_ID, config)] == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the steps did run compiled
