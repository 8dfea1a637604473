"""The per-worker training loop on Ray Train: a rank, a checkpoint and `report` around `steps.py`.

Every worker holds the whole tokenized dataset and derives the same global batch for each step from
(seed, step); it trains on its equal share (`worker_micro_batches`, DistributedSampler style).
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import ray.train
import ray.train.torch
import torch
import transformers
from ray.train.v2._internal.execution import context as ray_train_context
from transformers import get_cosine_schedule_with_warmup

from mars_ray import models
from mars_ray.core.objective import Example, ScoredLM
from mars_ray.train import lora, sharding
from mars_ray.train.config import Stage, TrainConfig
from mars_ray.train.steps import (
    TRAINER_STATE,
    BatchSampler,
    Objective,
    accumulate_gradients,
    max_over_workers,
    peak_memory_mb,
    save_checkpoint,
    sum_over_workers,
    verify_checkpoint,
    worker_micro_batches,
)


def train_worker(loop_config: dict) -> None:
    """Ray Train entry point, run by every worker: one stage, resumed from the latest checkpoint if any."""
    # Quiet workers (the driver prints a line per step): Ray 2.60 logs each report at INFO on a logger
    # named after its file, out of LoggingConfig's reach; transformers draws a bar per load and save.
    logging.getLogger(ray_train_context.__file__).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    config: TrainConfig = loop_config["config"]
    stage: Stage = loop_config["stage"]
    total_steps: int = loop_config["total_steps"]
    examples: list[Example] = ray.get(loop_config["examples"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(config.cpus_per_worker)
    torch.manual_seed(config.seed)

    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else nullcontext() as saved:
        saved = saved and Path(saved)
        if saved:
            verify_checkpoint(saved)  # Ray registers a checkpoint once copied; this proves it whole
        trained, tokenizer, lm = _load_model(config, loop_config["source"], saved)
        if stage == "mars":
            lm.config.mars_block_size = config.block_size  # decoders default their window to it
        trained.train()
        if config.strategy == "fsdp":
            bf16_params = device.type == "cuda" and config.autocast_dtype("cuda") == torch.bfloat16
            model = sharding.shard(ScoredLM(lm), device, world_size, torch.bfloat16 if bf16_params else None)
        else:
            model = ray.train.torch.prepare_model(ScoredLM(lm))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        scheduler = get_cosine_schedule_with_warmup(
            optimizer, round(config.warmup_ratio * total_steps), total_steps
        )
        start = _resume(config, saved, model, optimizer, scheduler) if saved else 0
    if start and rank == 0:
        print(f"[{stage}] resuming from the checkpoint of step {start}")
    objective = Objective(
        stage,
        config.block_size,
        config.ar_weight,
        tokenizer.mask_token_id,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        config.offsets,
    )

    sampler = BatchSampler(
        [len(e.input_ids) for e in examples], config.global_batch, config.seed, config.group_by_length
    )
    for step in range(start + 1, total_steps + 1):
        began = time.perf_counter()
        indices = sampler(step - 1)
        batch = [examples[i] for i in indices]
        micro_batches = [
            [examples[i] for i in share]
            for share in worker_micro_batches(indices, rank, world_size, config.grad_accum)
        ]
        losses = accumulate_gradients(
            model,
            objective,
            micro_batches,
            objective.normaliser(batch),
            world_size,
            device,
            config.autocast_dtype(device.type),
        )
        grad_norm = sharding.full_norm(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses = sum_over_workers(losses, device)
        seconds = time.perf_counter() - began
        metrics = {
            "step": step,
            "epoch": step * config.global_batch / len(examples),
            "loss": losses.pop("total"),
            **{f"{name}_loss": value for name, value in losses.items()},
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": sum(len(e.input_ids) for e in batch) / seconds,
            "step_time_s": seconds,
            "peak_memory_mb": max_over_workers(peak_memory_mb(device), device),  # the largest worker's
            "resumed_from": start,  # the checkpoint step this worker group started from (0: none)
        }
        if step % config.checkpoint_every and step != total_steps:
            ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if config.strategy == "fsdp":  # every rank writes its shards; Ray Train merges the folders
                sharding.save_sharded(
                    Path(folder),
                    model,
                    optimizer,
                    scheduler,
                    step,
                    tokenizer,
                    rank,
                    world_size,
                    full_weights=step == total_steps,
                )
                saved = ray.train.Checkpoint.from_directory(folder)
            elif rank == 0:
                save_checkpoint(Path(folder), trained, tokenizer, optimizer, scheduler, step)
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=saved, checkpoint_dir_name=f"checkpoint_{step:06d}")


def _load_model(config: TrainConfig, source: str, saved: Path | None):
    """What a worker trains: (the model it saves, its tokenizer, the causal LM the loss calls).

    Without LoRA all three come from the checkpoint `saved`, or from `source` when there is none; with
    LoRA the base always comes from `source` and the adapters from `saved` (or fresh). The LM the loss
    calls is then the base with the adapters injected, and what is saved is the adapters.
    """
    if config.lora is None:
        full = saved if saved and config.strategy == "ddp" else source  # FSDP: the shards come later
        model, tokenizer = models.load(str(full), dtype=torch.float32)
        return model, tokenizer, model
    model, tokenizer = models.load(source, dtype=torch.float32)
    adapted = lora.with_adapters(model, config.lora, saved)
    return adapted, tokenizer, adapted.get_base_model()


def _resume(config: TrainConfig, saved: Path, model, optimizer, scheduler) -> int:
    """Optimizer, schedule (and, sharded, the model) from the checkpoint `saved`; the step it was taken at."""
    state = torch.load(saved / TRAINER_STATE, map_location="cpu")
    if config.strategy == "fsdp":
        sharding.load_sharded(saved, model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]
