"""Gated MARS adapters: the user's model, kept exactly, plus mask slots that draft.

A low-rank delta on the chosen linear layers, and a trained embedding for the mask token, apply only at the
positions whose input token is the mask token; every real token is computed by the frozen base weights, so
tau = 1 is the base model and verified decoding (drafts from the mask slots, checked at real positions of
the next forward) writes exactly the base model's greedy text.

One mechanism serves every caller that feeds `input_ids` (our decoders, HF `generate`, training): a forward
pre-hook on the model's decoder stack records which flattened positions hold the mask token; a forward hook
on the input embedding swaps in the mask row there, and one on each target linear layer adds its delta to
those rows only (`index_add`: the other rows are the base layer's output, bit for bit, and the adapter costs
nothing where there are no masks).

Training runs each layer's own delta. Decoding (`stack`, which `load` calls unless the adapter trains) runs
the deltas of the projections that read one input (`SHARED_INPUT`: q, k and v; gate and up) as one: their
A side by side, their B block-diagonal with the scaling folded in; and each group's A is folded into the
weight of its first layer, whose product then gives A(x) as its last columns: at a few mask rows each
operation's cost is mostly its own overhead, so the gather and small product that A took of its own cost
more than the extra columns (SmolLM2, bf16, a window of 4: 1.75x a plain forward layer by layer, 1.55x
stacked, less folded: BENCHMARKS.md). The extra columns leave the layer's own ones bit for bit (tests).

A gated folder (a training checkpoint, or a run's `final/`) holds the model's `config.json` with the marker
`mars_gated` in it (the base it adapts and the adapter's shape; beside it, as in any MARS checkpoint, the
mask token id, `mars_block_size` and what calibration writes), `gated_adapter.safetensors` and the
tokenizer with its mask token. It holds no weights of the base, which is never written: plain
`transformers` loading the base gets the user's model, and loading the gated folder itself fails (no
weights) rather than give a model without its gate.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from mars_ray.core.objective import MarsBatch

MARKER = "mars_gated"  # the config.json key that makes a folder gated
MARS_KEYS = "mars_"  # config keys a gated folder carries over to its loaded base (block size, temperatures)
WEIGHTS = "gated_adapter.safetensors"
GATE = "mars_gate"  # the model attribute that holds the gate (and, in its state dict, the mask row)
DELTA = "mars_gated_lora"  # the attribute of each target linear layer that holds its low-rank delta
STACKED = "mars_gated_stacked"  # for decoding: (its group's `StackedDelta`, its columns' start and stop)
FOLDED = "mars_gated_folded"  # for decoding: how many last columns of the layer's product are its A(x)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers of one parent, one input
DENSE_SHARE = 4  # folded deltas run on every row of a forward whose masks are at least 1 in this many rows


@dataclass(frozen=True)
class GatedSpec:
    """What a gated folder records under `mars_gated`: its base (a folder or Hub id), the adapter's shape."""

    base: str
    r: int
    alpha: float
    target_modules: list[str]
    dropout: float = 0.0


class LowRankDelta(nn.Module):
    """`B(A(dropout(x))) * alpha / r`, B zero at first (peft's LoRA initialisation: the delta starts at 0)."""

    def __init__(self, shape: tuple[int, int], spec: GatedSpec, like: torch.Tensor) -> None:
        """`shape`: the adapted layer's (in, out) features; the weights take `like`'s device and dtype."""
        super().__init__()
        (features, out), r, kind = shape, spec.r, {"device": like.device, "dtype": like.dtype}
        self.A = nn.Linear(features, r, bias=False, **kind)
        self.B = nn.Linear(r, out, bias=False, **kind)
        nn.init.kaiming_uniform_(self.A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.B.weight)
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.scaling = spec.alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.B(self.A(self.dropout(x))) * self.scaling


class StackedDelta(nn.Module):
    """The deltas of layers that read one input, for decoding: one A (theirs side by side) and one B (theirs
    block-diagonal, scaled), so two products give every part's delta, each over its own output columns; a
    part that is None (not adapted) gets zero columns of its `width`. The weights are copies, not trained;
    A and B are `nn.Linear`s, so the engine's packing (`prepack.py`) packs them with the model's own."""

    def __init__(self, parts: list[LowRankDelta | None], widths: list[int]) -> None:
        super().__init__()
        adapted = [part for part in parts if part is not None]
        like = adapted[0].A.weight
        ranks = [part.A.weight.shape[0] if part is not None else 0 for part in parts]
        b = like.new_zeros(sum(widths), sum(ranks))
        row = column = 0
        for part, rank, width in zip(parts, ranks, widths, strict=True):
            if part is not None:
                b[row : row + width, column : column + rank] = part.B.weight.detach() * part.scaling
            row, column = row + width, column + rank
        self.A = _frozen_linear(torch.cat([part.A.weight.detach() for part in adapted]))
        self.B = _frozen_linear(b)
        self.folded = False  # A moved into a layer's weight (`fold_into`)

    @torch.no_grad()
    def fold_into(self, layer: nn.Linear) -> None:
        """Append A's rows to `layer`'s weight (a plain `nn.Linear`, not trained): its product then ends in
        this group's A(x), which the gate splits off (`FOLDED`); A itself is dropped."""
        rank = self.A.out_features
        layer.weight = nn.Parameter(torch.cat([layer.weight, self.A.weight]), requires_grad=False)
        if layer.bias is not None:  # A has none
            bias = torch.cat([layer.bias, layer.bias.new_zeros(rank)])
            layer.bias = nn.Parameter(bias, requires_grad=False)
        layer.out_features += rank
        setattr(layer, FOLDED, rank)
        del self.A
        self.folded = True


def _frozen_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class Gate(nn.Module):
    """The mask token's trained embedding row, and which positions of the current forward are masks."""

    def __init__(self, spec: GatedSpec, mask_id: int, mask_row: torch.Tensor) -> None:
        super().__init__()
        self.spec, self.mask_id = spec, mask_id
        self.mask_row = nn.Parameter(mask_row.detach().clone())
        self.rows = torch.zeros(0, dtype=torch.long)  # flattened [batch * length] positions of mask tokens
        self.tokens = 0  # batch * length of the current forward
        # where masks are at least 1 in DENSE_SHARE rows (a decode step), folded deltas run on every row, and
        # `real` ([batch * length, 1]) marks the rows whose A(x) is zeroed; None otherwise
        self.real: torch.Tensor | None = None
        self.stacks = nn.ModuleList()  # for decoding, every `StackedDelta` (so the model's `.to` moves them)
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(group) -> (its input, delta)

    def record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder stack: every forward states its input ids anew."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("a gated MARS model needs input_ids (the gate reads which inputs are masks)")
        flat = input_ids.reshape(-1)
        is_mask = flat == self.mask_id
        self.rows = is_mask.nonzero().squeeze(1)
        self.tokens = flat.numel()
        dense = len(self.rows) * DENSE_SHARE >= self.tokens
        self.real = ~is_mask[:, None] if dense else None
        self._stacked.clear()

    def embed(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook of the input embedding: the mask row at mask positions."""
        if not len(self.rows):
            return output
        row = self.mask_row.to(output.dtype).expand(len(self.rows), -1)
        return output.reshape(self.tokens, -1).index_copy(0, self.rows, row).view_as(output)

    def use(self, stacked: StackedDelta, layers: list[nn.Module], widths: list[int]) -> None:
        """Give each of `layers` its `widths` columns of `stacked`'s delta, in order."""
        if (wide := stacked.B.out_features) != sum(widths):
            raise ValueError(f"a stacked delta {wide} wide given to layers {sum(widths)} wide")
        self.stacks.append(stacked)
        start = 0
        for layer, width in zip(layers, widths, strict=True):
            setattr(layer, STACKED, (stacked, start, start + width))
            start += width

    def add_delta(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook of a target linear layer: its delta added at mask positions only (where its group's
        A is folded into it, A(x) split off its product first)."""
        folded = None
        if rank := getattr(module, FOLDED, 0):
            output, folded = output[..., :-rank], output[..., -rank:]
        if not len(self.rows):
            return output
        x = args[0]
        if x.shape[:-1].numel() != self.tokens:
            raise ValueError(f"gated adapter on a layer not fed one row per token: {tuple(x.shape)}")
        delta, every_row = self._delta(module, x, folded)
        flat, delta = output.reshape(self.tokens, -1), delta.to(output.dtype)
        if every_row:  # zero at real rows, which adding it leaves bit for bit
            return (flat + delta).view_as(output)
        return flat.index_add(0, self.rows, delta).view_as(output)

    def _delta(
        self, module: nn.Module, x: torch.Tensor, folded: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool]:
        """The layer's delta, and whether it has every row (zero at real ones) or the mask rows only: its
        own, or its columns of its group's, computed by the first layer of the group that this forward feeds
        `x` (the others are fed the same tensor; where A is folded, the first is the layer that holds it: q
        before k and v, gate before up)."""
        stacked = getattr(module, STACKED, None)
        if stacked is None:
            return getattr(module, DELTA)(x.reshape(self.tokens, -1)[self.rows]), False
        group, start, stop = stacked
        # A(x) came with a folded layer's product for every row: zeroing the real ones costs one operation
        # where gathering the masks' and scattering their delta back cost two, which pays until real rows,
        # whose B product is wasted, outnumber the masks several times (a prompt's forward)
        every_row = group.folded and self.real is not None
        fed, delta = self._stacked.get(id(group), (None, None))
        if fed is not x:
            if not group.folded:
                delta = group.B(group.A(x.reshape(self.tokens, -1)[self.rows]))
            elif folded is None:
                raise ValueError("a gated layer ran before the layer its group's A is folded into")
            else:
                low = folded.reshape(self.tokens, -1)
                delta = group.B(low.masked_fill(self.real, 0) if every_row else low[self.rows])
            self._stacked[id(group)] = (x, delta)
        return delta[:, start:stop], every_row


def attach(model: PreTrainedModel, spec: GatedSpec, trainable: bool = False) -> Gate:
    """Give `model` (its config names the mask token) a fresh gated adapter: its delta zero, its mask row the
    base's own, so still exactly the base. Every base weight is frozen; the adapter trains if `trainable`."""
    if getattr(model, GATE, None) is not None:
        raise ValueError("this model already has a gated adapter")
    targets = set(spec.target_modules)
    named = model.named_modules()
    linears = [m for name, m in named if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    if not linears:
        raise ValueError(f"no linear layer of this model is named {', '.join(sorted(targets))}")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    mask_id = int(model.config.mask_token_id)
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        mask_row = embedding(torch.tensor([mask_id], device=embedding.weight.device))[0]
    gate = Gate(spec, mask_id, mask_row)
    setattr(model, GATE, gate)
    model.base_model.register_forward_pre_hook(gate.record, with_kwargs=True)
    embedding.register_forward_hook(gate.embed)
    for linear in linears:
        setattr(linear, DELTA, LowRankDelta((linear.in_features, linear.out_features), spec, linear.weight))
        linear.register_forward_hook(gate.add_delta)
    for tensor in adapter_state(model, keep_vars=True).values():
        tensor.requires_grad_(trainable)
    return gate


def stack(model: nn.Module) -> None:
    """For decoding: the deltas of each parent's layers that read one input (`SHARED_INPUT`) as one
    `StackedDelta`, every other delta as one of its own, each one's A folded into its first layer. Call it
    after the adapter's weights are final: the stacks are copies (training runs the layers' own deltas,
    which it leaves in place), and a folded layer is for decoding only."""
    for parent in model.modules():
        adapted = {name: child for name, child in parent.named_children() if hasattr(child, DELTA)}
        shared = [[name for name in group if name in adapted] for group in SHARED_INPUT]
        alone = [[name] for name in adapted if not any(name in group for group in SHARED_INPUT)]
        for group in [names for names in shared if names] + alone:
            layers = [adapted[name] for name in group]
            widths = [layer.out_features for layer in layers]
            stacked = StackedDelta([getattr(layer, DELTA) for layer in layers], widths)
            getattr(model, GATE).use(stacked, layers, widths)
            stacked.fold_into(layers[0])


def is_gated(model: nn.Module) -> bool:
    return isinstance(getattr(model, GATE, None), Gate)


def adapter_state(model: PreTrainedModel, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The gated adapter's tensors (the mask row and every delta; not the stacks decoding runs, copies of
    the deltas), named as in `model.state_dict()`."""
    return {
        name: tensor
        for name, tensor in model.state_dict(keep_vars=keep_vars).items()
        if (name.startswith(f"{GATE}.") and not name.startswith(f"{GATE}.stacks.")) or f".{DELTA}." in name
    }


def save(model: PreTrainedModel, folder: Path) -> None:
    """Write the model's config with the marker, and the adapter's tensors, into `folder`."""
    config = copy.deepcopy(model.config)
    setattr(config, MARKER, asdict(getattr(model, GATE).spec))
    config.save_pretrained(folder)
    save_file({k: v.contiguous().cpu() for k, v in adapter_state(model).items()}, folder / WEIGHTS)


def read_spec(folder: str | Path) -> GatedSpec | None:
    """The spec of a gated folder; None for anything else (a plain model folder, a Hub id)."""
    path = Path(folder).expanduser() / "config.json"
    marker = json.loads(path.read_text()).get(MARKER) if path.is_file() else None
    return GatedSpec(**marker) if marker else None


def load(model: PreTrainedModel, folder: str | Path, trainable: bool = False) -> Gate:
    """Attach the gated adapter saved in `folder` to `model`, its base, with the folder's MARS config keys
    (`mars_block_size`, calibrated temperatures, the marker); stacked for decoding unless it trains."""
    folder = Path(folder).expanduser()
    spec = read_spec(folder)
    if spec is None:
        raise FileNotFoundError(f"{folder}: not a gated folder (no {MARKER} in its config.json)")
    stored = json.loads((folder / "config.json").read_text())
    for key, value in stored.items():
        if key.startswith(MARS_KEYS):
            setattr(model.config, key, value)
    gate = attach(model, spec, trainable)
    saved = load_file(str(folder / WEIGHTS))
    expected = set(adapter_state(model))
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved)), sorted(set(saved) - expected)
        raise ValueError(f"{folder}: its adapter does not fit the model (missing {missing}, extra {extra})")
    model.load_state_dict(saved, strict=False)
    if not trainable:
        stack(model)
    return gate


@contextmanager
def after_clean_stream(lm: PreTrainedModel, batch: MarsBatch) -> Iterator[MarsBatch]:
    """The gated MARS step's two forwards. The clean stream holds no mask token, so the frozen base computes
    it: it runs once under no_grad (no graph; its AR loss is a constant, dropped), and its keys and values
    become the cache that every forward of `lm` inside the block attends to. Yields the noisy half of
    `batch` (its own mask: noisy to clean, then noisy to noisy), to score as `mars_loss` scores a batch."""
    width, mask = batch.noisy_width, batch.attention_mask
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError("gated training builds its clean-stream cache from a dense 4D mask")
    with torch.no_grad():
        cache = lm.base_model(
            input_ids=batch.input_ids[:, width:],
            position_ids=batch.position_ids[:, width:],
            attention_mask=mask[:, :, width:, width:],
            use_cache=True,
        ).past_key_values
    noisy = MarsBatch(
        input_ids=batch.input_ids[:, :width],
        position_ids=batch.position_ids[:, :width],
        attention_mask=torch.cat([mask[:, :, :width, width:], mask[:, :, :width, :width]], dim=-1),
        targets=batch.targets[:, :width],
        supervised=batch.supervised,
        noisy_width=width,
        noisy_streams=batch.noisy_streams,
    )

    def on_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "past_key_values": cache, "use_cache": True}

    handle = lm.base_model.register_forward_pre_hook(on_cache, with_kwargs=True)
    try:
        yield noisy
    finally:
        handle.remove()
