"""The reference decoders keep the production decoder's contract: the block-cached decoder records the
log-probabilities a config asks for, and never feeds a mask past the tokens a row may still produce."""

from __future__ import annotations

import pytest
from conftest import MASK_ID, build_tiny, random_prompts

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.reference import decode_block_cached, decode_reference


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_block_cached_records_logprobs(tiny_llama, tau, fuse):
    """Every token carries its log-probability and top 3: at tau = 1 those of the other decoders (the
    model's own); below, a token's own slot's, where it is the likeliest."""
    prompts = random_prompts(4, seed=41)  # replies without the mask, which no top list holds
    config = DecodeConfig(tau=tau, max_new_tokens=14, logprobs=3)
    results = decode_block_cached(tiny_llama, prompts, MASK_ID, config, cache_block=4, fuse_extend=fuse)
    for prompt, result in zip(prompts, results, strict=True):
        assert [lp.token for lp in result.logprobs] == result.tokens
        assert all(lp.top[0][0] == lp.token and len(lp.top) == 3 for lp in result.logprobs)
        if tau == 1.0:
            reference = decode_reference(tiny_llama, prompt, MASK_ID, config)
            assert result.tokens == reference.tokens
            for got, expected in zip(result.logprobs, reference.logprobs, strict=True):
                assert got.logprob == pytest.approx(expected.logprob, abs=1e-6)
                assert [t for t, _ in got.top] == [t for t, _ in expected.top]


@pytest.mark.parametrize("fuse", [False, True])
def test_block_cached_windows_stop_at_the_end_of_the_context(fuse):
    """Rows decoding up to the model's last position in blocks wider than what they may still produce: no
    mask is fed at a position at or past `max_position_embeddings` (a row's masks past its budget are
    holes, as in `decode_cached`)."""
    limit = 40
    model = build_tiny("llama", max_position_embeddings=limit)
    prompts = random_prompts(3, seed=72)
    configs = [
        DecodeConfig(tau=tau, max_new_tokens=limit - len(p))
        for p, tau in zip(prompts, (0.3, 0.6, 1.0), strict=True)
    ]
    positions = []

    def record(module, args, kwargs):
        positions.append(int(kwargs["position_ids"].max()))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        results = decode_block_cached(model, prompts, MASK_ID, configs, cache_block=16, fuse_extend=fuse)
    finally:
        hook.remove()
    assert max(positions) == limit - 2  # the last token fed is the one before the last produced
    assert all(r.finish_reason == "length" for r in results)
