"""FSDP (`strategy: fsdp`): the model, its gradients and AdamW's states sharded over the workers with
PyTorch's FSDP2 (`fully_shard`), and checkpoints that are sharded too.

Each decoder layer is its own FSDP unit (its parameters are gathered just before it runs and freed after);
the root unit holds the rest (embeddings, final norm, the tied head). A sharded checkpoint is written by every
rank into its own folder, which Ray Train merges into one:

    shards/.metadata, shards/__<rank>_0.distcp   torch.distributed.checkpoint: model and optimizer
    trainer_state.pt                            the schedule and step (rank 0)
    config.json, tokenizer files                rank 0; at the last step also the full weights, gathered
    checkpoint.json, checkpoint.rank<r>.json    one manifest per rank (rank 0's is written last)

torch.distributed.checkpoint reshards on load, so a run resumes on any number of workers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from mars_ray.core.objective import ScoredLM
from mars_ray.train.steps import TRAINER_STATE, write_manifest

SHARDS = "shards"


def shard(model: ScoredLM, device: torch.device, world_size: int, compute: torch.dtype | None) -> ScoredLM:
    """Shard `model` in place over every worker: one FSDP unit per decoder layer, then the root.

    `compute` (bf16 on a GPU) is the dtype parameters are gathered and computed in; gradients are still
    reduced in fp32 and the sharded master weights stay fp32. None: as stored.
    """
    model.to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    layer_classes = set(model.lm._no_split_modules or ())
    for module in model.lm.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_norm(norm: torch.Tensor) -> float:
    """`clip_grad_norm_`'s result over sharded gradients is a DTensor: the norm of all of them."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def save_sharded(
    folder: Path,
    model: ScoredLM,
    optimizer: torch.optim.Optimizer,
    scheduler,
    step: int,
    tokenizer,
    rank: int,
    world_size: int,
    full_weights: bool,
    extra: dict | None = None,
) -> None:
    """Every rank calls this (it holds collectives) with a folder of its own; see the module docstring."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / SHARDS)
    lm: PreTrainedModel = model.lm
    if full_weights:  # gathered onto rank 0's CPU memory, one tensor at a time
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            lm.save_pretrained(folder, state_dict={k.removeprefix("lm."): v for k, v in full.items()})
    if rank == 0:
        lm.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        state = {"scheduler": scheduler.state_dict(), "step": step, **(extra or {})}
        torch.save(state, folder / TRAINER_STATE)
    write_manifest(folder, step, rank, world_size)


def load_sharded(saved: Path, model: ScoredLM, optimizer: torch.optim.Optimizer) -> None:
    """Put the checkpoint's model and optimizer shards into this (sharded) model and its optimizer, whatever
    the number of workers that wrote them."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=saved / SHARDS)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
