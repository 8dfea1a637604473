"""One optimizer step of either stage, with no Ray in it: how a micro-batch is scored, which examples
each step takes, and how a worker's share of the gradient is accumulated. `loop.py` runs these on Ray
Train workers; `scripts/recipe_sweep.py` runs them in one process (a lent GPU has no Ray).

Losses are divided by the normaliser of the joined global batch (supervised tokens for AR SFT, as HF
does; sequences for MARS) and multiplied by the world size, so DDP's gradient averaging gives exactly the
gradient of the joined batch's loss, with any number of workers and micro-steps.
"""

from __future__ import annotations

import hashlib
import json
import resource
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from mars_ray import folders
from mars_ray.core import gated
from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import IGNORE, Example, ar_loss, collate_ar, collate_mars, mars_loss
from mars_ray.train import batching
from mars_ray.train.config import Stage

TRAINER_STATE = "trainer_state.pt"  # optimizer, scheduler and step: the part of a checkpoint HF does not load
MANIFEST = "checkpoint.json"  # written last: the step, and the size and SHA-256 of every other file


class IncompleteCheckpoint(ConfigError):
    """A checkpoint folder a crash left behind (or one altered since), as the `checkpoint` to resume from:
    `path` names the file at fault."""

    def __init__(self, folder: Path, path: str, problem: str) -> None:
        super().__init__("checkpoint", f"{folder} is incomplete: {path} {problem}")
        self.folder, self.path, self.problem = folder, path, problem

    def __reduce__(self):
        return type(self), (self.folder, self.path, self.problem)  # it crosses Ray from a worker, whole


@dataclass(frozen=True)
class Objective:
    """How one stage scores a micro-batch: `ar-sft` is next-token CE, `mars` the [noisy | clean] loss."""

    stage: Stage
    block_size: int
    ar_weight: float
    mask_id: int
    pad_id: int
    eos_id: int
    offsets: tuple[int, ...] = (0,)  # MARS: one noisy stream per block offset

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
        (MARS only) are its detached parts. A gated model's clean stream is its frozen base: it runs without
        a graph and its loss (a constant) is left out.
        """
        if self.stage == "ar-sft":
            batch = collate_ar(examples, self.pad_id).to(device)
            return {"total": ar_loss(model(**batch.model_inputs()), batch) * self.normaliser(examples)}
        batch = collate_mars(
            examples, self.block_size, self.mask_id, self.pad_id, self.eos_id, offsets=self.offsets
        ).to(device)
        lm = getattr(model, "module", model).lm
        if gated.is_gated(lm):
            with gated.after_clean_stream(lm, batch) as noisy:
                loss = mars_loss(model(**noisy.model_inputs()), noisy)
        else:
            loss = mars_loss(model(**batch.model_inputs()), batch, self.ar_weight)
        return {
            "total": loss.total * len(examples),
            "noisy": loss.noisy * len(examples),
            "clean": loss.clean * len(examples),
        }


class BatchSampler:
    """The example indices of each optimizer step, the same on every worker: consecutive slices of a stream
    of seeded per-epoch shuffles, cut by `group_by_length` (HF's Trainer option, which the paper used) when
    it is set."""

    def __init__(self, lengths: Sequence[int], global_batch: int, seed: int, group_by_length: bool) -> None:
        self.lengths, self.global_batch, self.seed = list(lengths), global_batch, seed
        self.group_by_length = group_by_length
        self.epochs: dict[int, list[int]] = {}

    def epoch(self, epoch: int) -> list[int]:
        if epoch not in self.epochs:
            generator = torch.Generator().manual_seed(batching.epoch_seed(self.seed, epoch))

            def shuffled(count: int) -> list[int]:
                return torch.randperm(count, generator=generator).tolist()

            order = shuffled(len(self.lengths))
            if self.group_by_length:
                batches = batching.group_by_length(order, self.global_batch, self.length, shuffled)
                order = [i for batch in batches for i in batch]
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
        with _gradient_sync(model, last):
            with autocast:
                sums = objective.loss_sums(model, examples, device)
            (sums["total"] * world_size / normaliser).backward()
        for name, value in sums.items():
            shares[name] = shares.get(name, 0.0) + value.item() / normaliser
    return shares


@contextmanager
def _gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Gradients add up locally until the last micro-step: DDP skips its all-reduce (`no_sync`), FSDP its
    reduce-scatter."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    if enabled or not isinstance(model, DistributedDataParallel):
        yield
        return
    with model.no_sync():
        yield


def sum_over_workers(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Add up every worker's values (on `device`: NCCL reduces CUDA tensors only)."""
    if not dist.is_initialized():
        return values
    summed = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return dict(zip(values, summed.tolist(), strict=True))


def peak_memory_mb(device: torch.device) -> float:
    """This worker's peak memory so far: the process's peak RSS on a CPU, the allocator's peak on a GPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def max_over_workers(value: float, device: torch.device) -> float:
    """The largest of every worker's `value`."""
    if not dist.is_initialized():
        return value
    largest = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def save_checkpoint(
    folder: Path,
    model: PreTrainedModel,
    tokenizer,
    optimizer,
    scheduler,
    step: int,
    extra: dict | None = None,
) -> None:
    """A `save_pretrained` folder (safetensors, tokenizer with its mask token), the trainer state (with
    `extra` in it), and last the manifest that makes it a checkpoint: a crash at any point before it, or
    while Ray Train copies the folder to storage in any order, leaves a folder that `verify_checkpoint`
    refuses."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}
    state.update(extra or {})
    torch.save(state, folder / TRAINER_STATE)
    write_manifest(folder, step)


def manifest_name(rank: int) -> str:
    """Rank 0's manifest is `checkpoint.json`; in a sharded checkpoint every other rank writes its own."""
    return MANIFEST if rank == 0 else f"checkpoint.rank{rank}.json"


def is_manifest(name: str) -> bool:
    """A manifest of any rank (what a user's copy of a checkpoint leaves out)."""
    return name == MANIFEST or (name.startswith("checkpoint.rank") and name.endswith(".json"))


def write_manifest(folder: Path, step: int, rank: int = 0, world_size: int = 1) -> None:
    """List every file under `folder` (its size and SHA-256), atomically, as this rank's manifest. Rank 0's
    also says how many ranks wrote parts of the checkpoint: each of their manifests must be there too."""
    files = {
        str(path.relative_to(folder)): _fingerprint(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not is_manifest(path.name)
    }
    manifest = {"step": step, "files": files} | ({"world_size": world_size} if rank == 0 else {})
    folders.write_file(folder / manifest_name(rank), json.dumps(manifest, indent=1))  # whole or absent


def verify_checkpoint(folder: Path) -> int:
    """The step of a whole checkpoint; `IncompleteCheckpoint` when a manifest or a file is missing, short or
    altered (in a sharded checkpoint: any rank's)."""
    folder = Path(folder)
    manifests = [_read_manifest(folder, 0)]
    manifests += [_read_manifest(folder, rank) for rank in range(1, manifests[0].get("world_size", 1))]
    for rank, manifest in enumerate(manifests):
        if manifest["step"] != manifests[0]["step"]:
            raise IncompleteCheckpoint(folder, manifest_name(rank), f"is of step {manifest['step']}")
        for name, expected in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                raise IncompleteCheckpoint(folder, name, "is missing")
            if _fingerprint(path) != expected:
                raise IncompleteCheckpoint(folder, name, "differs from the manifest (cut short or altered)")
    return manifests[0]["step"]


def _read_manifest(folder: Path, rank: int) -> dict:
    name = manifest_name(rank)
    try:
        return json.loads((folder / name).read_text())
    except FileNotFoundError:
        raise IncompleteCheckpoint(folder, name, "is missing (the save did not finish)") from None


def _fingerprint(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
