"""A gated MARS folder served by vLLM: vLLM loads the base's weights untouched, and the folder's adapter is
attached to vLLM's model by the same `Gate` every native decoder uses (`mars_ray.core.gated`): the mask row
at mask-token inputs, each target layer's low-rank delta added at those rows only. Real tokens are the
base's own computation, bit for bit, so verified decoding writes vLLM's greedy text of the base.

vLLM fuses the projections a gated folder adapts separately (q, k, v into `qkv_proj`; gate and up into
`gate_up_proj`): the fused layer's delta is its parts' deltas as one `StackedDelta`, as native decoding
stacks them, a part not adapted zero.
The hooks read the batch's input ids, so the model runs eagerly (`enforce_eager`): a compiled graph
would not see which rows are masks.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from mars_ray import models
from mars_ray.core import gated
from mars_ray.core.errors import ConfigError

ADAPTER = "mars_gated_adapter"  # the hf_config key (an engine override) naming the adapter's file
FUSED = {  # vLLM's layer name -> the names a gated folder adapts, in the fused layer's output order
    "qkv_proj": gated.SHARED_INPUT[0],
    "gate_up_proj": gated.SHARED_INPUT[1],
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}


def engine_args(folder: str | Path) -> dict:
    """What vLLM needs for a gated folder: the base as its model, the folder's tokenizer, the folder's MARS
    config keys and adapter file as config overrides (the proposer reads them), eager execution."""
    folder = Path(folder)
    spec = gated.read_spec(folder)
    if spec is None:
        raise ConfigError("model", f"{folder}: not a gated folder")
    stored = json.loads((folder / "config.json").read_text())
    overrides = {k: v for k, v in stored.items() if k.startswith(gated.MARS_KEYS) or k == "mask_token_id"}
    overrides[ADAPTER] = str(folder / gated.WEIGHTS)
    return {
        "model": models.resolve(spec.base),
        "tokenizer": str(folder),
        "hf_overrides": overrides,
        "enforce_eager": True,
    }


def attach(model: nn.Module, hf_config) -> gated.Gate:
    """Attach the gated adapter `hf_config` names (`ADAPTER`, `gated.MARKER`) to vLLM's `model`."""
    spec = gated.GatedSpec(**getattr(hf_config, gated.MARKER))
    saved = load_file(getattr(hf_config, ADAPTER))
    decoder = model.model
    embedding = decoder.embed_tokens
    mask_id = int(hf_config.mask_token_id)
    if mask_id >= embedding.weight.shape[0]:
        raise ConfigError("model", f"the base has no embedding row for the mask token ({mask_id})")
    like = embedding.weight
    gate = gated.Gate(spec, mask_id, saved.pop(f"{gated.GATE}.mask_row").to(like.device, like.dtype))
    model.mars_gate = gate  # kept with the model, as the native loader keeps it
    # on the outer model: vLLM's compile decorator calls the decoder stack's forward past its hooks
    model.register_forward_pre_hook(gate.record, with_kwargs=True)
    embedding.register_forward_hook(gate.embed)
    for name, layer in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in FUSED:
            continue
        widths = list(getattr(layer, "output_sizes", None) or [layer.output_size])
        parts = [_delta(saved, f"{prefix}.{part}", spec, layer.weight) for part in FUSED[leaf]]
        if not any(parts):
            continue
        gate.use(gated.StackedDelta(parts, widths), [layer], [sum(widths)])
        layer.register_forward_hook(functools.partial(_with_delta, gate))
    if saved:
        raise ConfigError("model", f"the gated adapter does not fit vLLM's model: unused {sorted(saved)[:4]}")
    return gate


def _delta(saved: dict, name: str, spec: gated.GatedSpec, like: torch.Tensor) -> gated.LowRankDelta | None:
    """The delta the folder holds for the layer HF calls `name`, taken out of `saved`; None if none."""
    key = f"{name}.{gated.DELTA}"
    if f"{key}.A.weight" not in saved:
        return None
    a, b = saved.pop(f"{key}.A.weight"), saved.pop(f"{key}.B.weight")
    delta = gated.LowRankDelta((a.shape[1], b.shape[0]), spec, like)
    delta.load_state_dict({"A.weight": a, "B.weight": b})
    return delta


def _with_delta(gate: gated.Gate, module: nn.Module, args: tuple, output):
    """vLLM's linear layers return (output, bias): the gate adds the delta to the output."""
    if isinstance(output, tuple):
        return (gate.add_delta(module, args, output[0]), *output[1:])
    return gate.add_delta(module, args, output)
