"""The ragged KV cache every cached decoder runs on: rows of different lengths in one rectangular cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from mars_ray.core.compile import step_forward
from mars_ray.core.errors import ConfigError


def _check_cacheable(config) -> None:
    """Refuse a model whose attention this cache cannot express: every layer must attend to every valid
    key through the 4D mask it is given (no sliding windows or hybrid layers, an implementation that
    honours a 4D mask)."""
    layers = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layers) or (
        not layers and getattr(config, "sliding_window", None)
    ):
        raise ConfigError(
            "model", f"{config.model_type}: sliding-window or hybrid attention layers are not supported"
        )
    if config._attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(
            "attn_implementation",
            f"{config._attn_implementation!r} ignores a 4D attention mask: use sdpa or eager",
        )


class RaggedCache:
    """One rectangular KV cache for rows of different lengths; row r's real keys are where `valid[r]`.

    Holes (left padding, slack from rows that advanced less than others) are never attended and positions
    count real tokens only, so every row computes what it would alone. Rows join empty and leave at once.
    """

    def __init__(self, model: PreTrainedModel, compiled: bool = True) -> None:
        """`compiled`: cached steps run `step_forward(model)` (compiled after `compile_steps`)."""
        _check_cacheable(model.config)
        self.model = model
        self.step = step_forward(model) if compiled else model
        self.device = model.device
        self.kv = DynamicCache(config=model.config)
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # [rows, T]
        self.next_position = torch.zeros(0, dtype=torch.long, device=self.device)  # [rows]
        self.eager = model.config._attn_implementation == "eager"

    def _layers(self):
        return [layer for layer in self.kv.layers if layer.is_initialized and layer.keys.dim() == 4]

    def forward(
        self, input_ids: torch.Tensor, real: torch.Tensor, keep: int, logits_to_keep: int
    ) -> torch.Tensor:
        """Run `input_ids` [rows, S] after the cache; cache the first `keep` columns; return the last logits.

        `real` marks the columns that exist (False = hole). Real columns see every valid cached key and the
        real columns before them; a hole sees only itself, so no softmax row is empty.
        """
        positions = (self.next_position[:, None] + real.cumsum(dim=1) - 1).clamp(min=0)
        layers = self._layers()
        # Compiled: a step into keys to attend (a prompt into an empty or all-hole cache is compute-bound).
        run = self.step if layers and self.valid.shape[1] >= 2 and bool(self.valid.any()) else self.model
        mask = self._mask(real, always=run is not self.model)
        if run is not self.model:  # a first forward caches views; one layout means one compiled graph
            for layer in layers:
                layer.keys, layer.values = _static_heads(layer.keys), _static_heads(layer.values)
            width = input_ids.shape[1]
            logits_to_keep = torch.arange(width - logits_to_keep, width, device=self.device)
        out = run(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=self.kv,  # `cache` from transformers 5.24; vLLM pins 5.19
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        if keep < input_ids.shape[1]:
            self.kv.crop(keep - input_ids.shape[1])
        kept = real[:, :keep]
        self.valid = torch.cat([self.valid, kept], dim=1)
        self.next_position = self.next_position + kept.sum(dim=1)
        return out.logits

    def _mask(self, real: torch.Tensor, always: bool = False) -> torch.Tensor | None:
        """The 4D mask for a forward of `real`'s columns, or None where there is no hole anywhere (unless
        `always`: a compiled step always takes a mask, so that a mask or none is not two graphs).

        Without holes the mask is plain causal; left to the model, it is built the way HF `generate` builds
        it (at batch 1: none, and SDPA's own causal kernel), so a hole-free forward takes the same kernels
        as `generate` and tau = 1 equals it bit for bit in bf16 as well, and runs faster.
        """
        if not always and bool(real.all()) and bool(self.valid.all()):
            return None
        rows, width = real.shape
        cached = self.valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        own = causal[None] & real[:, None, :]
        own |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        mask = torch.cat([self.valid[:, None, :].expand(rows, width, cached), own], dim=2)[:, None]
        if self.eager:
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        return mask

    def forget_last(self, counts: Sequence[int]) -> None:
        """Turn each row's last `counts[r]` cached keys into holes (rejected proposals): never attended
        again, and the row's next position is where the first of them was."""
        if not any(counts):
            return
        counts_t = torch.tensor(list(counts), device=self.device)
        from_end = self.valid.flip(1).to(torch.long).cumsum(dim=1).flip(1)  # valid keys at or after
        self.valid &= ~(from_end <= counts_t[:, None])
        self.next_position = self.next_position - counts_t
        self.compact()

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (all holes)."""
        self.valid = torch.cat([self.valid, self.valid.new_zeros((count, self.valid.shape[1]))])
        self.next_position = torch.cat([self.next_position, self.next_position.new_zeros(count)])
        for layer in self._layers():
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((count, *layer.keys.shape[1:]))])
            layer.values = torch.cat([layer.values, layer.values.new_zeros((count, *layer.values.shape[1:]))])

    def take_rows(self, rows: Sequence[int], other: RaggedCache) -> None:
        """Rows `rows` (empty until now) take the keys and values of `other`'s rows, in order; the time
        axis grows on the left (holes) when `other` is longer."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        if not other._layers() or not other.valid.shape[1]:  # nothing cached there
            self.next_position[index] = other.next_position
            return
        grow = other.valid.shape[1] - self.valid.shape[1]
        if grow > 0:
            self.valid = torch.cat([self.valid.new_zeros((self.valid.shape[0], grow)), self.valid], dim=1)
            for layer in self._layers():
                holes = layer.keys.new_zeros((*layer.keys.shape[:2], grow, layer.keys.shape[3]))
                layer.keys = torch.cat([holes, layer.keys], dim=2)
                layer.values = torch.cat([holes.clone(), layer.values], dim=2)
        width = other.valid.shape[1]
        self.valid[index, -width:] = other.valid
        self.next_position[index] = other.next_position
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys[index, :, -width:] = theirs.keys
            mine.values[index, :, -width:] = theirs.values

    def split_rows(self, indices: Sequence[int]) -> RaggedCache:
        """A new cache holding these rows (in this order), which this one gives up."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        moved = RaggedCache(self.model)
        moved.valid, moved.next_position = self.valid[index], self.next_position[index]
        for mine, theirs in zip(self.kv.layers, moved.kv.layers, strict=True):
            if mine.is_initialized and mine.keys.dim() == 4:
                theirs.lazy_initialization(mine.keys, mine.values)
                theirs.keys, theirs.values = mine.keys[index], mine.values[index]
        gone = set(indices)
        self.keep_rows([r for r in range(self.valid.shape[0]) if r not in gone])
        return moved

    def keep_rows(self, indices: Sequence[int]) -> None:
        """Keep only these rows (in this order); the others' keys and values are freed."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        self.valid = self.valid[index]
        self.next_position = self.next_position[index]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.compact()

    def compact(self, min_holes: int = 32) -> None:
        """Drop hole columns once they are a quarter of the cache: each row's keys move right, in order."""
        total = self.valid.shape[1]
        width = int(self.valid.sum(dim=1).max()) if self.valid.shape[0] else 0
        if total - width < max(min_holes, total // 4):
            return
        # A stable sort puts every row's real keys last, in their original order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, total - width :]
        self.valid = self.valid.gather(1, order)
        for layer in self._layers():
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


def _static_heads(t: torch.Tensor) -> torch.Tensor:
    """Cached keys or values [rows, heads, time, head_dim] as a compiled step wants them: row-major (even
    along size-1 dims; a first forward caches views), heads and head_dim marked static (so they are never
    taken for a batch or a width that happens to be the same size)."""
    expected, stride = [], 1
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    if t.stride() != tuple(reversed(expected)):
        t = t.clone(memory_format=torch.contiguous_format)
    torch._dynamo.mark_static(t, 1)
    torch._dynamo.mark_static(t, 3)
    return t


def right_align(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows packed into one [n, longest] tensor with holes on the left; also which columns are real."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    real = torch.zeros(ids.shape, dtype=torch.bool)
    for row, tokens in enumerate(rows):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(list(tokens))
            real[row, width - len(tokens) :] = True
    return ids, real
