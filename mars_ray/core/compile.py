"""`torch.compile` for the decoders' cached steps (opt-in: the serving engine's `compile`, `mars-ray bench
forward --compile`).

Once a model is compiled here, `RaggedCache` runs every step into a cache that holds keys to attend through
one `torch.compile(dynamic=True)` of the model's forward; a prompt into an empty cache, and the side cache's
prefill chunks, stay eager (compute-bound already). A compiled step always gets a mask and picks its logits
by an index tensor, its cached keys are row-major with heads and head_dim static, and sizes are never
unified by value (no duck shapes), so what dynamo tells apart is only whether the batch and the window are
one or more: four graphs, which the engine compiles while it warms up (each compile is slow on a CPU:
BENCHMARKS.md has the times). Same tokens as eager in fp32 on the tests' models; in bf16 the fused
kernels round differently, so batched rows may part from eager ones (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

COMPILED_STEP = "mars_compiled_step"  # the model attribute that holds the compiled forward
RECOMPILE_LIMIT = 32  # past it, dynamo runs a new kind of step eagerly


def compile_steps(model: PreTrainedModel) -> None:
    """From now on every cached decode step of `model` runs compiled (compiled lazily, per kind of step)."""
    compiled = torch.compile(model.forward, dynamic=True)

    def step(*args, **kwargs):
        # torch's config is per thread: set it in the thread that runs the step (the engine's decode thread).
        with (
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
            torch.fx.experimental._config.patch(use_duck_shape=False),  # equal sizes are no guard
        ):
            return compiled(*args, **kwargs)

    setattr(model, COMPILED_STEP, step)


def step_forward(model: PreTrainedModel):
    """What runs a cached step of `model`: its compiled forward after `compile_steps`, else the model."""
    return getattr(model, COMPILED_STEP, None) or model
