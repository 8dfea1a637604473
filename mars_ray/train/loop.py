"""The per-worker training loop on Ray Train: a rank, a checkpoint and `report` around `steps.py`.

Data: in memory, every worker holds the whole tokenized dataset and derives the same global batch for each
step from (seed, step), then trains on its equal share (`worker_micro_batches`, DistributedSampler style);
streamed (`stream.py`), each worker reads its own Ray Data shard. The model is whole on every worker (DDP)
or sharded (`sharding.py`, FSDP), and with LoRA (`lora.py`) only its adapters train.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import transformers
from transformers import get_cosine_schedule_with_warmup

from mars_ray import models
from mars_ray.checkpoint_meta import CheckpointMeta
from mars_ray.core.objective import Example, ScoredLM
from mars_ray.train import lora, sharding, stream
from mars_ray.train.config import Stage, TrainConfig
from mars_ray.train.steps import (
    TRAINER_STATE,
    BatchSampler,
    IncompleteCheckpoint,
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
    _quiet_ray_file_loggers()
    transformers.utils.logging.disable_progress_bar()  # a bar per load and save
    config: TrainConfig = loop_config["config"]
    stage: Stage = loop_config["stage"]
    total_steps: int = loop_config["total_steps"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(config.cpus_per_worker)
    torch.manual_seed(config.seed)

    with newest_whole_checkpoint(ray.train.get_checkpoint()) as (saved, refused):
        if rank == 0:
            for name, error in refused.items():
                print(f"[{stage}] {name} refused ({error}): trying the checkpoint before it")
        trained, tokenizer, lm = _load_model(config, loop_config["source"], saved)
        if stage == "mars":
            # decoders default their window to the B it trained with
            CheckpointMeta(block_size=config.block_size).apply(lm.config)
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
        state = _resume(config, saved, model, optimizer, scheduler) if saved else {}
    start = state.get("step", 0)
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

    if config.streaming:
        batches = StepBatchesFromStream(config, rank, objective, device, start, state.get("data_counts"))
    else:
        batches = StepBatchesInMemory(config, rank, world_size, objective, ray.get(loop_config["examples"]))
    for step in range(start + 1, total_steps + 1):
        began = time.perf_counter()
        micro_batches, normaliser, tokens = batches(step)
        losses = accumulate_gradients(
            model,
            objective,
            micro_batches,
            normaliser,
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
            "epoch": step * config.global_batch / loop_config["rows"],
            "loss": losses.pop("total"),
            **{f"{name}_loss": value for name, value in losses.items()},
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / seconds,
            "step_time_s": seconds,
            "peak_memory_mb": max_over_workers(peak_memory_mb(device), device),  # the largest worker's
            "resumed_from": start,  # the checkpoint step this worker group started from (0: none)
        }
        if step % config.checkpoint_every and step != total_steps:
            ray.train.report(metrics)
            continue
        extra = {}
        if config.streaming:  # what every worker has read so far, added up
            extra["data_counts"] = batches.counts_over_workers()
            metrics["data_report"] = stream.data_reports(extra["data_counts"], config.datasets)
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
                    extra=extra,
                )
                saved = ray.train.Checkpoint.from_directory(folder)
            elif rank == 0:
                save_checkpoint(Path(folder), trained, tokenizer, optimizer, scheduler, step, extra)
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=saved, checkpoint_dir_name=checkpoint_name(step, refused))


def _quiet_ray_file_loggers() -> None:
    """Quiet workers: the driver prints a line per step. Ray 2.60 logs each report at INFO on a logger named
    after its source file (`getLogger(__file__)`), outside the `ray.train` logger that `LoggingConfig`
    sets: every logger named by a file of the installed Ray is set to WARNING here, in the worker."""
    ray_files = os.path.dirname(ray.__file__) + os.sep
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(ray_files):
            logging.getLogger(name).setLevel(logging.WARNING)


CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)(?:\.(\d+))?")  # `checkpoint_name`'s


def checkpoint_name(step: int, taken: Collection[str]) -> str:
    """The folder name of step `step`'s checkpoint: `checkpoint_000100`, or `checkpoint_000100.1` (.2, ...)
    where a refused checkpoint holds that name. Ray Train still lists the refused one, and deletes its
    folder when it prunes it: a step redone after a fallback must not be saved into that folder."""
    name, redo = f"checkpoint_{step:06d}", 0
    while name in taken:
        redo += 1
        name = f"checkpoint_{step:06d}.{redo}"
    return name


def _order(path: str) -> tuple[int, int] | None:
    """(step, redo) of a checkpoint folder, or None for any other folder."""
    match = CHECKPOINT_NAME.fullmatch(os.path.basename(path))
    return match and (int(match[1]), int(match[2] or 0))


def _older_checkpoints(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """The checkpoint folders kept beside `latest` (in its storage), older than it, newest first."""
    fs, latest_order = latest.filesystem, _order(latest.path)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(os.path.dirname(latest.path)))
    older = [
        (_order(info.path), info.path)
        for info in infos
        if info.type == pyarrow.fs.FileType.Directory and _order(info.path)
    ]
    return [
        ray.train.Checkpoint(path, filesystem=fs)
        for order, path in sorted(older, reverse=True)
        if latest_order is None or order < latest_order
    ]


@contextmanager
def newest_whole_checkpoint(
    latest: ray.train.Checkpoint | None,
) -> Iterator[tuple[Path | None, dict[str, IncompleteCheckpoint]]]:
    """The local folder of the newest checkpoint that verifies (None: no checkpoint, start afresh), and the
    newer ones refused on the way, by folder name.

    Ray Train hands over the latest checkpoint it registered; `verify_checkpoint` proves it whole. One
    damaged since (a file cut short or altered on storage) is refused, and the group resumes from the newest
    older one kept beside it, rather than failing at every restart until `max_failures` is spent. When none
    verifies, the latest one's refusal is raised.
    """
    if latest is None:
        yield None, {}
        return
    refused: dict[str, IncompleteCheckpoint] = {}
    for candidate in itertools.chain([latest], _older_checkpoints(latest)):
        with candidate.as_directory() as folder:
            try:
                verify_checkpoint(Path(folder))
            except IncompleteCheckpoint as error:
                refused[os.path.basename(candidate.path)] = error
                continue
            yield Path(folder), refused
            return
    raise next(iter(refused.values()))


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


def _resume(config: TrainConfig, saved: Path, model, optimizer, scheduler) -> dict:
    """Optimizer, schedule (and, sharded, the model) from the checkpoint `saved`; its trainer state (the
    step it was taken at, and what else the run saved)."""
    state = torch.load(saved / TRAINER_STATE, map_location="cpu")
    if config.strategy == "fsdp":
        sharding.load_sharded(saved, model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


class StepBatchesInMemory:
    """Every worker holds every example and cuts the same global batch from (seed, step); it trains on
    its share."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int, objective, examples: list[Example]):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.objective, self.examples = objective, examples
        self.sampler = BatchSampler(
            [len(e.input_ids) for e in examples], config.global_batch, config.seed, config.group_by_length
        )

    def __call__(self, step: int) -> tuple[list[list[Example]], int, int]:
        """This worker's micro-batches of step `step`, the joined batch's normaliser and token count."""
        indices = self.sampler(step - 1)
        batch = [self.examples[i] for i in indices]
        shares = worker_micro_batches(indices, self.rank, self.world_size, self.config.grad_accum)
        micro_batches = [[self.examples[i] for i in share] for share in shares]
        return micro_batches, self.objective.normaliser(batch), sum(len(e.input_ids) for e in batch)


class StepBatchesFromStream:
    """Each worker reads its own stream (`stream.StreamedBatches`); the normaliser and token count of the
    joined batch are added up over the workers. A resumed worker first skips the rows its finished steps
    took; rank 0 carries the counts saved with the checkpoint."""

    def __init__(self, config: TrainConfig, rank: int, objective, device, start: int, counts: dict | None):
        self.config, self.objective, self.device = config, objective, device
        shard = ray.train.get_dataset_shard("train")
        self.stream = stream.StreamedBatches(
            shard, config.batch_size, config.group_by_length, config.seed + rank
        )
        for _ in range(start * config.grad_accum):
            self.stream.next(count=False)
        if counts and rank == 0:
            self.stream.report = {source: Counter(c) for source, c in counts.items()}

    def __call__(self, step: int) -> tuple[list[list[Example]], int, int]:
        micro_batches = [self.stream.next() for _ in range(self.config.grad_accum)]
        local = [e for micro in micro_batches for e in micro]
        joined = sum_over_workers(
            {"normaliser": self.objective.normaliser(local), "tokens": sum(len(e.input_ids) for e in local)},
            self.device,
        )
        return micro_batches, max(int(joined["normaliser"]), 1), int(joined["tokens"])

    def counts_over_workers(self) -> dict[str, Counter]:
        """Every worker's counts of the rows read so far, added up (a collective: every rank calls it)."""
        reports = [self.stream.report]
        if dist.is_initialized():
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, self.stream.report)
        return stream.add_counts(reports)
