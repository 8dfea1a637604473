"""A prompt is checked before anything reads it: echo's forward over the prompt (`Engine.prompt_logprobs`)
refuses what a request would refuse, and runs no forward for it."""

from __future__ import annotations

import asyncio

import pytest

from mars_ray import models
from mars_ray.core.errors import ConfigError
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine


def test_echo_refuses_a_bad_prompt_before_any_forward():
    model, tokenizer = models.load("tiny")
    vocab = model.get_input_embeddings().num_embeddings
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))

    async def run() -> list[str]:
        engine = Engine(model, tokenizer, ModelConfig(model="tiny", max_context=64))
        try:
            for prompt in ([], [-1], [vocab], [10**9], [1] * 64, [1] * 500_000):
                with pytest.raises(ConfigError) as refused:
                    await engine.prompt_logprobs(prompt, 0)
                assert refused.value.field == "prompt", prompt
            assert forwards == []  # refused before the forward, not by it
            return [lp.token for lp in await engine.prompt_logprobs([5, 6, 7], 0)]
        finally:
            await engine.close()

    try:
        assert len(asyncio.run(run())) == 3 and forwards  # the hook does see echo's forward
    finally:
        hook.remove()
