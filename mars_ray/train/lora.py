"""LoRA training with `peft`: adapters on the chosen linear layers, and the mask token's embedding row
trainable (a new token's row is all the model knows of it, and LoRA alone never moves it).

A LoRA run's checkpoints hold the adapter only (the base is the stage's source model, which every worker
loads anyway); its `final/` is the adapter merged into a plain HF folder, and `final-adapter/` keeps it
unmerged, so that one base can carry several adapters.

`lora.gated` trains a gated adapter instead (`mars_ray.core.gated`: it acts at mask tokens only, the base
computes every real token). Merging it would change the user's model, so its `final/` stays a gated folder
that names its base; `mars_ray.models.load` applies the gate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from mars_ray import models
from mars_ray.checkpoint_meta import CheckpointMeta
from mars_ray.core import gated
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


class GatedAdapters:
    """A gated run's trainee, as the training loop sees a `PeftModel`: the base model carrying the gate
    (`get_base_model`, which the loss calls), saved as a gated folder (`save_pretrained`)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def get_base_model(self) -> PreTrainedModel:
        return self.model

    def train(self) -> GatedAdapters:
        self.model.train()
        return self

    def save_pretrained(self, folder: str | Path) -> None:
        gated.save(self.model, Path(folder))


def with_adapters(
    model: PreTrainedModel, settings: LoraSettings, saved: Path | None = None
) -> PeftModel | GatedAdapters:
    """`model` with fresh trainable adapters, or those of the checkpoint `saved` (resumed, trainable)."""
    if settings.gated:
        if saved is not None:
            gated.load(model, saved, trainable=True)
            return GatedAdapters(model)
        base = Path(model.name_or_path)  # the folder (or Hub id) it was loaded from: what final/ names
        spec = gated.GatedSpec(
            base=str(base.resolve()) if base.exists() else model.name_or_path,
            r=settings.r,
            alpha=settings.alpha,
            target_modules=list(settings.target_modules),
            dropout=settings.dropout,
        )
        gated.attach(model, spec, trainable=True)
        return GatedAdapters(model)
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
    to `final` as a plain HF folder; `block_size`, when the stage was MARS, goes into its config. A gated
    adapter is not merged: `final` is its folder (it names `base` and carries its `mars_block_size`)."""
    if gated.read_spec(adapter) is not None:
        shutil.copytree(adapter, final, dirs_exist_ok=True)
        return
    model, tokenizer = models.load(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    CheckpointMeta(block_size=block_size).apply(merged.config)
    merged.save_pretrained(final)
    tokenizer.save_pretrained(final)
