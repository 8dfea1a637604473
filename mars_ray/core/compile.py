"""`torch.compile` for the decoders' cached steps (opt-in; `mars-ray bench forward --compile` measures it).

Once a model is compiled here, `RaggedCache` runs every step after its first forward (any forward into a
cache that already holds keys) through one `torch.compile(dynamic=True)` of the model's forward; the first
forward into an empty cache (a prompt: compute-bound) stays eager. On this project's 2-core CPU a compiled
SmolLM2-135M step is about 1.2x faster than eager at a fixed kind of step (BENCHMARKS.md), but the serving
engine does not use it: a ragged batch changes what dynamo guards on (batch and window sizes 1 or more,
batch sizes it specialises, a mask or none, tensors made inside or outside inference mode), so a short mixed
decode compiled eleven graphs, each 20 to 60 s on that CPU, several of them mid-run. A static-shape cache
(one padded batch and length, as gpt-fast does) is what serving compiled would take.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

COMPILED_STEP = "mars_compiled_step"  # the model attribute that holds the compiled forward
RECOMPILE_LIMIT = 32  # past it, dynamo runs a new kind of step eagerly


def compile_steps(model: PreTrainedModel) -> None:
    """From now on every cached decode step of `model` runs compiled (compiled lazily, per kind of step)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    setattr(model, COMPILED_STEP, torch.compile(model.forward, dynamic=True))


def step_forward(model: PreTrainedModel):
    """What runs a cached step of `model`: its compiled forward after `compile_steps`, else the model."""
    return getattr(model, COMPILED_STEP, None) or model
