"""Shared fixtures: tiny models built from a config (no downloads), in float64 so ties never flip argmax."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
MASK_ID = VOCAB - 1
PAD_ID = 0
EOS_ID = 2


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    return LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)


def build_tiny(
    family: str = "llama", sharpness: float = 40.0, seed: int = 0, dtype=torch.float64, **overrides
):
    """A random tiny causal LM whose output distributions are peaked (confidences spread over (0, 1])."""
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM
    model = cls(tiny_config(family, **overrides)).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    return build_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny("llama")


def random_prompts(count: int, low: int = 3, high: int = 14, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(3, MASK_ID, (int(n),), generator=g).tolist() for n in lengths]
