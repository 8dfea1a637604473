"""The per-worker training loop: plain torch and DDP; Ray Train only gives it a rank, a checkpoint, `report`.

Every worker holds the whole tokenized dataset and derives the same global batch for each step from
(seed, step); it trains on its equal share (`worker_micro_batches`, DistributedSampler style). Losses are
divided by the normaliser of the joined global batch (supervised tokens for AR SFT, as HF does; sequences
for MARS) and multiplied by the world size, so DDP's gradient averaging gives exactly the gradient of the
joined batch's loss, with any number of workers and micro-steps.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import transformers
from ray.train.v2._internal.execution import context as ray_train_context
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from mars_ray import models
from mars_ray.core.objective import (
    IGNORE,
    Example,
    ScoredLM,
    ar_loss,
    collate_ar,
    collate_mars,
    mars_loss,
)
from mars_ray.train.config import Stage, TrainConfig

TRAINER_STATE = "trainer_state.pt"  # optimizer, scheduler and step: the part of a checkpoint HF does not load


@dataclass(frozen=True)
class Objective:
    """How one stage scores a micro-batch: `ar-sft` is next-token CE, `mars` the [noisy | clean] loss."""

    stage: Stage
    block_size: int
    ar_weight: float
    mask_id: int
    pad_id: int
    eos_id: int

    def normaliser(self, examples: Sequence[Example]) -> int:
        """The denominator of the joined batch's loss: supervised next tokens (AR) or sequences (MARS)."""
        if self.stage == "ar-sft":
            return sum(sum(label != IGNORE for label in e.labels[1:]) for e in examples)
        return len(examples)

    def loss_sums(
        self, model: torch.nn.Module, examples: Sequence[Example], device
    ) -> dict[str, torch.Tensor]:
        """The core losses of `examples` times their own normaliser: sums that add up across workers.

        `model` is a `ScoredLM` (or DDP around one). `total` carries the gradient; `noisy` and `clean`
        (MARS only) are its detached parts.
        """
        if self.stage == "ar-sft":
            batch = collate_ar(examples, self.pad_id).to(device)
            return {"total": ar_loss(model(**batch.model_inputs()), batch) * self.normaliser(examples)}
        batch = collate_mars(examples, self.block_size, self.mask_id, self.pad_id, self.eos_id).to(device)
        loss = mars_loss(model(**batch.model_inputs()), batch, self.ar_weight)
        return {
            "total": loss.total * len(examples),
            "noisy": loss.noisy * len(examples),
            "clean": loss.clean * len(examples),
        }


class BatchSampler:
    """The example indices of each optimizer step, the same on every worker: consecutive slices of a stream
    of seeded per-epoch shuffles. With `group_by_length` (HF's Trainer option, which the paper used) each
    run of `MEGABATCH` batches is sorted by length before it is cut into batches, so a batch pads little;
    the batches are then shuffled, so consecutive steps do not walk from long chats to short ones."""

    MEGABATCH = 50

    def __init__(self, lengths: Sequence[int], global_batch: int, seed: int, group_by_length: bool) -> None:
        self.lengths, self.global_batch, self.seed = list(lengths), global_batch, seed
        self.group_by_length = group_by_length
        self.epochs: dict[int, list[int]] = {}

    def epoch(self, epoch: int) -> list[int]:
        if epoch not in self.epochs:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
            if self.group_by_length:
                size, mega = self.global_batch, self.MEGABATCH * self.global_batch
                by_length = [
                    i
                    for m in range(0, len(order), mega)
                    for i in sorted(order[m : m + mega], key=self.length)
                ]
                batches = [by_length[b : b + size] for b in range(0, len(by_length), size)]
                order = [
                    i for b in torch.randperm(len(batches), generator=generator).tolist() for i in batches[b]
                ]
            self.epochs = {e: o for e, o in self.epochs.items() if e == epoch - 1}  # a batch spans two
            self.epochs[epoch] = order
        return self.epochs[epoch]

    def length(self, index: int) -> int:
        return self.lengths[index]

    def __call__(self, step: int) -> list[int]:
        """Indices of step `step` (from 0)."""
        size = len(self.lengths)
        start = step * self.global_batch
        return [
            self.epoch(position // size)[position % size]
            for position in range(start, start + self.global_batch)
        ]


def worker_micro_batches(
    indices: Sequence[int], rank: int, world_size: int, grad_accum: int
) -> list[list[int]]:
    """This worker's equal share of each micro-step of a global batch (`indices[rank::world_size]`)."""
    size = len(indices) // grad_accum
    return [list(indices[m * size : (m + 1) * size][rank::world_size]) for m in range(grad_accum)]


def accumulate_gradients(
    model: torch.nn.Module,
    objective: Objective,
    micro_batches: Sequence[Sequence[Example]],
    normaliser: int,
    world_size: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
) -> dict[str, float]:
    """Forward and backward over this worker's micro-batches of one step; DDP syncs on the last one.

    `autocast` runs the forward in that dtype (mixed precision: weights, gradients and AdamW stay fp32).
    Returns this worker's share of the joined batch's losses: summed over workers they are its losses.
    """
    autocast = torch.autocast(device.type, dtype=autocast) if autocast else nullcontext()
    shares: dict[str, float] = {}
    for i, examples in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last or not isinstance(model, DistributedDataParallel) else model.no_sync():
            with autocast:
                sums = objective.loss_sums(model, examples, device)
            (sums["total"] * world_size / normaliser).backward()
        for name, value in sums.items():
            shares[name] = shares.get(name, 0.0) + value.item() / normaliser
    return shares


def sum_over_workers(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Add up every worker's values (on `device`: NCCL reduces CUDA tensors only)."""
    if not dist.is_initialized():
        return values
    summed = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return dict(zip(values, summed.tolist(), strict=True))


def save_checkpoint(folder: Path, model: PreTrainedModel, tokenizer, optimizer, scheduler, step: int) -> None:
    """A `save_pretrained` folder (safetensors, tokenizer with its mask token) plus the trainer state."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
    torch.save(state, folder / TRAINER_STATE)


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
    with checkpoint.as_directory() if checkpoint else nullcontext(loop_config["source"]) as source:
        model, tokenizer = models.load(str(source), dtype=torch.float32)
        state = torch.load(Path(source) / TRAINER_STATE, map_location="cpu") if checkpoint else None
    if stage == "mars":
        model.config.mars_block_size = config.block_size  # decoders default their window to it
    model.train()
    unwrapped = model
    model = ray.train.torch.prepare_model(ScoredLM(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, round(config.warmup_ratio * total_steps), total_steps
    )
    start = 0
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
        if rank == 0:
            print(f"[{stage}] resuming from the checkpoint of step {start}")
    objective = Objective(
        stage,
        config.block_size,
        config.ar_weight,
        tokenizer.mask_token_id,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
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
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
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
            "grad_norm": grad_norm.item(),
            "tokens_per_s": sum(len(e.input_ids) for e in batch) / seconds,
            "step_time_s": seconds,
            "resumed_from": start,  # the checkpoint step this worker group started from (0: none)
        }
        if step % config.checkpoint_every and step != total_steps:
            ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                save_checkpoint(Path(folder), unwrapped, tokenizer, optimizer, scheduler, step)
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=saved, checkpoint_dir_name=f"checkpoint_{step:06d}")
