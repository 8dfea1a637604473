"""LoRA: MARS trained into adapters (plus the mask token's row) teaches several tokens per forward, the
merged model is a plain transformers model that decodes exactly like greedy `generate` at tau = 1, and bad
LoRA settings fail naming their key."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny
from test_decoding import hf_greedy
from test_learning import copy_task
from transformers import AutoModelForCausalLM

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import ScoredLM, ar_loss, collate_ar, collate_mars, mars_loss
from mars_ray.train import lora
from mars_ray.train.config import LoraSettings, load_config


def train(model, loss_of, examples, steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        batch = examples[(step * 16) % len(examples) :][:16]
        loss = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def tokens_per_forward(results) -> float:
    return sum(len(r.tokens) for r in results) / sum(r.forward_passes for r in results)


def test_lora_mars_learns_several_tokens_per_forward_and_merges_to_plain_transformers(tmp_path):
    """An AR model that knows the copy task (the 'instruct model') gets MARS through rank-8 adapters alone:
    every base weight stays frozen, and it passes the bar of the full fine-tune's test."""
    torch.manual_seed(0)
    model = build_tiny("llama", sharpness=1.0, dtype=torch.float32).train()
    model.config.mask_token_id = MASK_ID
    examples = copy_task(4000, seed=0)
    train(
        model,
        lambda b: ar_loss(ScoredLM(model)(**collate_ar(b, PAD_ID).model_inputs()), collate_ar(b, PAD_ID)),
        examples,
        300,
        3e-3,
    )
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}

    adapted = lora.with_adapters(model, LoraSettings(r=8, alpha=16))
    lm = adapted.get_base_model()

    def mars(batch):
        collated = collate_mars(batch, 4, MASK_ID, PAD_ID, EOS_ID)
        return mars_loss(ScoredLM(lm)(**collated.model_inputs()), collated).total

    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "trainable_tokens" in n for n in trainable)
    train(adapted, mars, examples, 400, 3e-3)
    for name, p in adapted.named_parameters():  # the base weights never moved
        base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if not p.requires_grad and base_name in frozen:
            assert torch.equal(p, frozen[base_name]), name
    adapted.eval()

    held_out = [e.input_ids[:9] for e in copy_task(24, seed=1)]
    stop = (EOS_ID,)
    fast = decode_cached(
        lm, held_out, MASK_ID, DecodeConfig(tau=0.9, block_size=4, max_new_tokens=12, stop_token_ids=stop)
    )
    print(f"LoRA tokens per forward at tau=0.9: {tokens_per_forward(fast):.2f}")
    assert tokens_per_forward(fast) > 1.3

    adapted.save_pretrained(tmp_path / "adapter")
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()  # no peft in it
    assert not any("lora" in name or "trainable_tokens" in name for name in merged.state_dict())
    assert not torch.equal(
        merged.get_input_embeddings().weight[MASK_ID], frozen["model.embed_tokens.weight"][MASK_ID]
    )
    exact = decode_cached(
        merged, held_out, MASK_ID, DecodeConfig(tau=1.0, max_new_tokens=12, stop_token_ids=stop)
    )
    with torch.no_grad():
        assert [r.tokens for r in exact] == hf_greedy(merged, held_out, 12)
    again = decode_cached(
        merged, held_out, MASK_ID, DecodeConfig(tau=0.9, block_size=4, max_new_tokens=12, stop_token_ids=stop)
    )
    assert [r.tokens for r in again] == [r.tokens for r in fast]  # merging changed nothing


def test_lora_settings_fail_naming_their_key(tmp_path):
    config = load_config(None, ["model=tiny", "lora.r=4", "lora.target_modules=[q_proj, v_proj]"])
    assert config.lora == LoraSettings(r=4, target_modules=["q_proj", "v_proj"])
    assert load_config(None, ["model=tiny", "lora={}"]).lora == LoraSettings()
    with pytest.raises(ValueError, match=r"lora\.r"):
        load_config(None, ["model=tiny", "lora.r=0"])
    with pytest.raises(ValueError, match=r"lora\.rank"):
        load_config(None, ["model=tiny", "lora.rank=4"])
    gated = load_config(None, ["model=tiny", "stages=[mars]", "lora={r: 8, gated: true}"])
    assert gated.lora == LoraSettings(r=8, gated=True)
    with pytest.raises(ValueError, match=r"lora\.gated trains stage mars only"):  # an AR stage feeds no mask
        load_config(None, ["model=tiny", "lora={r: 8, gated: true}"])
    with pytest.raises(ValueError, match=r"lora\n.*strategy ddp only"):
        load_config(None, ["model=tiny", "stages=[mars]", "strategy=fsdp", "lora={gated: true}"])
    build_tiny("llama").save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as error:
        lora.check_targets(str(tmp_path), LoraSettings(target_modules=["q_proj", "query"]))
    assert error.value.field == "lora.target_modules" and "query" in error.value.message
    lora.check_targets(str(tmp_path), LoraSettings())
