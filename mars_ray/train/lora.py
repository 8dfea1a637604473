"""LoRA training with `peft`: adapters on the chosen linear layers, and the mask token's embedding row
trainable (a new token's row is all the model knows of it, and LoRA alone never moves it).

A LoRA run's checkpoints hold the adapter only (the base is the stage's source model, which every worker
loads anyway); its `final/` is the adapter merged into a plain HF folder, and `final-adapter/` keeps it
unmerged, so that one base can carry several adapters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from mars_ray import models
from mars_ray.core.errors import ConfigError
from mars_ray.train.config import LoraSettings

ADAPTER_SUFFIX = "-adapter"  # `final-adapter/` beside `final/`


def check_targets(source: str, settings: LoraSettings) -> None:
    """Every target names a linear layer of the model at `source` (checked on the meta device, no weights);
    otherwise a `ConfigError` on `lora.target_modules` before any worker starts."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(set(settings.target_modules) - linear)
    if missing:
        found = ", ".join(sorted(linear))
        raise ConfigError("lora.target_modules", f"{', '.join(missing)} not among its linear layers: {found}")


def with_adapters(model: PreTrainedModel, settings: LoraSettings, saved: Path | None = None) -> PeftModel:
    """`model` with fresh trainable adapters, or those of the checkpoint `saved` (resumed, trainable)."""
    if saved is not None:
        return PeftModel.from_pretrained(model, str(saved), is_trainable=True)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        trainable_token_indices=[model.config.mask_token_id],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def export(adapter: Path, base: str, final: Path, block_size: int | None) -> None:
    """Merge the adapter folder `adapter` (with its tokenizer) into the model at `base` and save the result
    to `final` as a plain HF folder; `block_size`, when the stage was MARS, goes into its config."""
    model, tokenizer = models.load(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if block_size is not None:
        merged.config.mars_block_size = block_size
    merged.save_pretrained(final)
    tokenizer.save_pretrained(final)
