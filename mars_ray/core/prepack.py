"""Linear weights packed once for oneDNN: what a served bf16 model with eager steps runs on a CPU (the
engine's `prepack_weights`; inductor cannot lower these packed layers, so compiled steps keep plain ones).

On a CPU a bf16 `nn.Linear` hands oneDNN a plain row-major weight at every call, which oneDNN reorders
into its blocked layout before it multiplies; packing each weight once, as inductor's freezing does for a
compiled graph, saves that reorder at every call, so the projections and the decode step they make up run
faster (`mars-ray bench forward --prepack`; the figures are in BENCHMARKS.md), with the stock logits bit for
bit. Pack in the thread that runs the forwards: in a thread that was not the first to run torch's parallel
work the packed products lose their gain. The packed layers are for decoding only: they hold no trainable
parameter, and a model with them is not saved. The output embedding gets its own packed copy; the input
embedding keeps the tied weight.

A layer is packed in place: it keeps its identity, its hooks and what is attached to it, so a gated
adapter's deltas (`gated.py`: forward hooks on the adapted layers, and `nn.Linear`s of their own, packed
too) run on a packed model as on a stock one.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 16  # rows oneDNN picks its blocking for; any batch runs, this one best


class PackedLinear(nn.Linear):
    """`nn.Linear`'s product with its weight already in oneDNN's blocked layout (`packed`; no `weight`)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack(linear: nn.Linear) -> None:
    """Turn `linear` into a `PackedLinear`, in place."""
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
    del linear.weight  # a tied weight stays with the module it is tied to (the input embedding)
    linear.register_buffer("packed", packed)
    if linear.bias is not None:
        linear.bias.requires_grad_(False)
    linear.__class__ = PackedLinear


def can_prepack(model: nn.Module) -> bool:
    """bf16 weights on a CPU whose oneDNN runs bf16 natively (AVX512-BF16 or AMX)."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@torch.no_grad()
def prepack_linears(model: nn.Module) -> int:
    """Pack every bf16 `nn.Linear` of `model` (`pack`); return how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16]
    for linear in linears:
        pack(linear)
    return len(linears)
