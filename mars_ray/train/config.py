"""One typed object describes a training run; it is checked in full before any Ray worker starts.

A YAML file sets the fields and `key=value` overrides (values parsed as YAML) replace them, nanoGPT style.
Unknown keys, wrong types, bad ranges and a model path that does not exist fail here, naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mars_ray import data, models
from mars_ray.core.errors import ConfigError

Stage = Literal["ar-sft", "mars"]


class LoraSettings(BaseModel):
    """`lora:` in a training config; the names are peft's (`alpha` is `lora_alpha`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(default=16, ge=1, description="adapter rank")
    alpha: float = Field(default=32.0, gt=0, description="scale numerator: updates are scaled by alpha / r")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names (last part) of the linear layers that get adapters",
    )
    gated: bool = Field(
        default=False,
        description="the adapters (and the mask token's row) apply only where the input is the mask token:"
        " every real token is the frozen base model's, so tau 1 and verified decoding write exactly its"
        " greedy text; the clean stream is the base, its AR loss a constant (dropped); stage mars only",
    )


class TrainConfig(BaseModel):
    """The two-stage MARS recipe (AR SFT, then MARS from its result) with one set of hyperparameters.

    Defaults follow the paper's 0.5B recipe (lr 5e-6, cosine, 3% warmup, clip 1.0, no weight decay, B=4,
    ar_weight 1, max_length 512, seed 42) except the batch, which is per worker and micro-step here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # what to train, on what, and where results go
    model: str = Field(description="preset (tiny, smollm2-135m), local HF folder or Hub id")
    datasets: list[str] = Field(
        default=["tasks", "chatterbot"],
        min_length=1,
        description="mixed sources: bundled (tasks, chatterbot), .jsonl/.json/.parquet/folders, Hub ids",
    )
    dataset_split: str = Field(
        default="train", description="split of Hub and folder datasets (bundled: train)"
    )
    tasks_count: int = Field(default=4000, ge=1, description="rows generated for the bundled `tasks`")
    streaming: bool = Field(
        default=False,
        description="read the datasets as a Ray Data stream, tokenized in parallel and split over the"
        " workers as they train (data that does not fit the driver); false: tokenized on the driver",
    )
    max_length: int = Field(default=512, ge=2, description="tokens kept per chat (its first ones)")
    name: str = Field(default="mars", pattern=r"^[\w.-]+$", description="run name; rerunning it resumes")
    output_dir: str = Field(default=str(models.home() / "runs"), description="runs live in output_dir/name")
    stages: list[Stage] = Field(
        default=["ar-sft", "mars"], min_length=1, description="both, or one (`[mars]` starts from model)"
    )
    # the MARS objective
    block_size: int = Field(default=4, ge=2, description="B: tokens predicted per block in stage mars")
    ar_weight: float = Field(
        default=1.0, ge=0, description="weight of the clean-stream (AR) loss (unused with lora.gated)"
    )
    block_offsets: int = Field(
        default=1,
        ge=1,
        description="noisy streams per chat, block boundaries shifted by k*B/n (1: the paper's layout;"
        " B: every token from every window slot in one forward)",
    )
    # optimisation (the same for both stages)
    epochs: float = Field(
        default=5.0, gt=0, description="passes over the data per stage, unless steps is set"
    )
    steps: int | None = Field(default=None, ge=1, description="optimizer steps per stage")
    batch_size: int = Field(default=8, ge=1, description="examples per worker per micro-step")
    grad_accum: int = Field(default=1, ge=1, description="micro-steps per optimizer step")
    group_by_length: bool = Field(default=False, description="batch chats of similar length (less padding)")
    lr: float = Field(default=5e-6, gt=0, description="AdamW peak learning rate (cosine after the warmup)")
    warmup_ratio: float = Field(default=0.03, ge=0, lt=1, description="share of the steps warming up")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping")
    seed: int = Field(default=42, description="batches, shuffles and initialisation")
    # Ray Train
    num_workers: int = Field(default=2, ge=1, description="Ray Train workers")
    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="ddp: every worker holds the whole model; fsdp: model, gradients and AdamW states"
        " sharded over the workers (FSDP2), checkpoints sharded too",
    )
    cpus_per_worker: int = Field(default=1, ge=1, description="also the torch threads of a CPU worker")
    use_gpu: bool = Field(default=False, description="one GPU per worker, NCCL")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="bf16: the forward under bf16 autocast (fp32 weights and AdamW); auto: bf16 on a GPU"
        " and on a CPU with native bf16 (AVX512-BF16), fp32 elsewhere",
    )
    checkpoint_every: int = Field(default=100, ge=1, description="steps between checkpoints (and at the end)")
    keep_checkpoints: int = Field(default=2, ge=1, description="checkpoints kept per stage (the newest)")
    max_failures: int = Field(default=3, ge=0, description="worker-group restarts from the last checkpoint")
    # parameter-efficient training
    lora: LoraSettings | None = Field(
        default=None,
        description="train LoRA adapters and the mask token's embedding row instead of every weight"
        " (`lora={r: 16}`, or `lora.r=16`); final/ is merged, final-adapter/ is not",
    )

    @field_validator("datasets", "stages", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        """`datasets=tasks,chatterbot` on the command line means a list."""
        return [item.strip() for item in value.split(",")] if isinstance(value, str) else value

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str) -> str:
        """A path must be a model folder now; presets are built and Hub ids fetched when the run starts."""
        if value not in models.PRESETS:
            try:
                models.resolve(value)
            except ConfigError as error:
                raise ValueError(error.message) from None
        return value

    @field_validator("output_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().resolve())

    @field_validator("block_offsets")
    @classmethod
    def _offsets_fit_the_block(cls, value: int, info: ValidationInfo) -> int:
        block_size = info.data.get("block_size")
        if block_size is not None and value > block_size:
            raise ValueError(f"at most block_size ({block_size}) offsets, got {value}")
        return value

    @field_validator("lora")
    @classmethod
    def _lora_on_ddp(cls, value: LoraSettings | None, info: ValidationInfo) -> LoraSettings | None:
        if value is not None and info.data.get("strategy") == "fsdp":
            raise ValueError("LoRA trains with strategy ddp only (its adapters are small: nothing to shard)")
        if value is not None and value.gated and info.data.get("stages") != ["mars"]:
            raise ValueError(
                "lora.gated trains stage mars only (stages=[mars]): its adapters act on mask tokens alone,"
                " which an AR stage never feeds, and the model it starts from is kept as it is"
            )
        return value

    @property
    def offsets(self) -> tuple[int, ...]:
        """The block offset of each noisy stream, spread evenly over the block."""
        return tuple(k * self.block_size // self.block_offsets for k in range(self.block_offsets))

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, over all workers and micro-steps."""
        return self.batch_size * self.grad_accum * self.num_workers

    def autocast_dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype the forward runs in under autocast, or None for plain fp32."""
        if self.precision == "auto":  # emulated bf16 (an AVX2-only CPU) is many times slower than fp32
            native = device_type == "cuda" or (device_type == "cpu" and torch.cpu._is_avx512_bf16_supported())
            return torch.bfloat16 if native else None
        return torch.bfloat16 if self.precision == "bf16" else None

    def split_of(self, source: str) -> str:
        """The split `source` trains on: a bundled source's `train` (never its held-out), else
        `dataset_split`."""
        return "train" if source in data.BUNDLED_SOURCES else self.dataset_split

    def total_steps(self, num_examples: int) -> int:
        return self.steps or max(1, math.ceil(self.epochs * num_examples / self.global_batch))


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """A `TrainConfig` from a YAML file (or none) and `key=value` overrides, validated."""
    values = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    if not isinstance(values, dict):
        raise ConfigError("config", f"{path}: expected a mapping of config keys")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("overrides", f"{item!r} is not key=value")
        *parents, leaf = key.strip().split(".")  # `lora.r=8` sets one key of a nested mapping
        target = values
        for part in parents:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[leaf] = yaml.safe_load(value)
    return TrainConfig(**values)
