"""Linear weights packed once for oneDNN: the same logits as the stock bf16 model, and only where it runs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mars_ray import models
from mars_ray.core.prepack import PackedLinear, can_prepack, prepack_linears
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.types import SamplingParams

BF16_NATIVE = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())  # unpacked ones


@pytest.mark.skipif(not BF16_NATIVE, reason="this CPU has no native bf16 for oneDNN")
def test_packed_weights_give_the_stock_logits_bit_for_bit():
    stock, _ = models.load("tiny", dtype=torch.bfloat16)
    packed, _ = models.load("tiny", dtype=torch.bfloat16)
    assert can_prepack(packed)
    count = linears(stock)
    assert prepack_linears(packed) == count > 0
    assert linears(packed) == 0 and sum(isinstance(m, PackedLinear) for m in packed.modules()) == count
    ids = torch.randint(0, stock.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, stock(ids).logits)
        one_row = ids[:1, :7]  # another shape than the packing's batch hint
        assert torch.equal(packed(one_row).logits, stock(one_row).logits)


def test_the_engine_packs_bf16_only_where_it_runs():
    """fp32 weights are never packed; bf16 ones are on a CPU with native bf16, and serve the stock text."""
    fp32 = models.load("tiny", dtype=torch.float32)
    Engine(*fp32, ModelConfig(model="tiny"))
    assert not can_prepack(fp32[0]) and linears(fp32[0]) > 0

    async def reply(model, tokenizer, prepack: bool) -> str:
        engine = Engine(model, tokenizer, ModelConfig(model="tiny", prepack_weights=prepack))
        prompt = tokenizer("Count from 3 to 9.")["input_ids"]
        chunks = [
            c async for c in engine.generate(prompt, SamplingParams(max_tokens=16, tau=0.5, block_size=4))
        ]
        await engine.close()
        return "".join(c.text for c in chunks)

    stock = models.load("tiny", dtype=torch.bfloat16)
    packed = models.load("tiny", dtype=torch.bfloat16)
    expected = asyncio.run(reply(*stock, prepack=False))
    assert linears(stock[0]) > 0
    text = asyncio.run(reply(*packed, prepack=True))
    assert (linears(packed[0]) == 0) == BF16_NATIVE
    assert text == expected


@pytest.mark.skipif(not BF16_NATIVE, reason="this CPU has no native bf16 for oneDNN")
def test_a_gated_model_packs_with_its_gate():
    """Packing is in place: the adapted layers keep the gate's hooks and the stacked deltas are packed too,
    so the packed gated model's logits are the stock gated model's, its mask rows not the base's."""
    from conftest import MASK_ID
    from test_gated import gated_twin

    base, stock = gated_twin("llama", torch.bfloat16)
    _, packed = gated_twin("llama", torch.bfloat16)
    assert prepack_linears(packed) == linears(stock) > len(stock.mars_gate.stacks) * 2
    assert linears(packed) == 0
    ids = torch.tensor([[5, 17, 33, 8, MASK_ID, MASK_ID, MASK_ID], [9, 4, 4, 60, 3, 21, MASK_ID]])
    with torch.inference_mode():
        got, expected, plain = (
            packed(input_ids=ids).logits,
            stock(input_ids=ids).logits,
            base(input_ids=ids).logits,
        )
    assert torch.equal(got, expected)
    real = ids != MASK_ID
    assert torch.equal(got[real], plain[real]) and (got[~real] != plain[~real]).any(dim=-1).all()
