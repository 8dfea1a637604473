"""The MARS training objective: a `[noisy | clean]` batch, its attention mask, and the two-part loss.

Layout follows the reference code (the paper writes `[clean; noisy]`; with an explicit mask and explicit
position ids the order is immaterial). The clean stream is the chat, positions 0..L-1. The noisy stream is
the same chat with every supervised token (label != -100) replaced by the mask id: 100% of the response,
no random ratio; each noisy token carries the position of the clean token it stands for. Block of
position p is p // B.

    clean -> clean : k <= q                           (plain causal LM)
    noisy -> noisy : blk(k) == blk(q) and k <= q      (causal inside a block, unlike BD3LM)
    noisy -> clean : blk(k) <  blk(q)                 (strictly earlier blocks only)
    clean -> noisy : never

Every position's logits score the next token of its own stream (label p + 1 at position p): the
reference code's right shift, applied per stream. A noisy block none of whose positions is scored (the
prompt's blocks, most of a chat) has no loss, and no other noisy block attends to it, so by default the
noisy stream holds only the scored blocks: the same loss and gradients for less compute. The paper's full
layout (`compact=False`, noisy stream of length L) is kept as the reference the compact one is tested on.

Block offsets (an extension; the paper has one): a noisy stream may be given its block boundaries shifted
by s, so that block of p is (p + s) // B under that stream, and several such streams, each with its own s,
may share one clean stream. The rules above hold within each noisy stream (blocks read under its own s);
noisy streams never see each other. With offsets 0..B-1 every response token is predicted from every slot
of the window in one forward, where the paper's layout teaches each token one slot per pass over the data:
decoding starts its window wherever the committed text ends, so every alignment is one it meets. The noisy
loss is averaged over the streams, so one stream at offset 0 is exactly the paper's objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized chat: `labels` is `input_ids` with the prompt set to -100 (unshifted).

    `complete`: the reply really ended where the example ends; False when it was cut (at a distillation's
    token budget, or at `max_length`), so nothing may teach the model to stop there.
    """

    input_ids: list[int]
    labels: list[int]
    complete: bool = True


@dataclass
class ScoredBatch:
    """Model inputs for one step; `targets[r, c]` is the token column c's logits are scored against
    (the next token of its stream; IGNORE: not scored)."""

    input_ids: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor | object  # 2D padding mask, 4D bool mask or a flex-attention BlockMask
    targets: torch.Tensor  # [b, T]

    @property
    def scored(self) -> torch.Tensor:
        """[b, T] bool: the columns whose logits the loss reads."""
        return self.targets != IGNORE

    def model_inputs(self) -> dict:
        """What `ScoredLM` takes."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "scored": self.scored,
        }


@dataclass
class ArBatch(ScoredBatch):
    """One plain next-token (AR SFT) step, right padded: T = L, positions 0..L-1, a [b, L] padding mask."""

    def to(self, device: torch.device | str) -> ArBatch:
        tensors = (self.input_ids, self.position_ids, self.attention_mask, self.targets)
        return ArBatch(*(t.to(device) for t in tensors))


@dataclass
class MarsBatch(ScoredBatch):
    """One MARS step: T = N + L, `noisy_width` (N) noisy columns, then the clean stream of length L.
    `supervised[r]` is the number of supervised tokens of row r, the loss's per-sequence normaliser."""

    supervised: torch.Tensor  # [b]
    noisy_width: int
    noisy_streams: int = 1  # block offsets: the noisy loss is averaged over them

    def to(self, device: torch.device | str) -> MarsBatch:
        return MarsBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device),
            self.targets.to(device),
            self.supervised.to(device),
            self.noisy_width,
            self.noisy_streams,
        )


@dataclass
class MarsLoss:
    """`total` is what is optimised; `noisy` and `clean` are its parts, for logging."""

    total: torch.Tensor
    noisy: torch.Tensor
    clean: torch.Tensor


def extend_to_block(example: Example, block_size: int, eos_id: int) -> Example:
    """Append supervised EOS tokens until the length is a multiple of the block size (stage 2 only).

    Only a complete reply is extended: after a cut one, EOS would teach the model to stop where its text
    was cut, so its last block stays partial (the batch's padding fills it, scoring nothing).
    """
    if not example.complete:
        return example
    extra = -len(example.input_ids) % block_size
    return Example(example.input_ids + [eos_id] * extra, example.labels + [eos_id] * extra)


def _never_empty(examples: Sequence[Example], pad_id: int) -> Sequence[Example]:
    """`examples`, or for none one padding token that scores nothing: a streamed micro-batch whose rows were
    all skipped still runs a forward and backward (zero gradients), so every DDP or FSDP worker joins the
    same collectives at every micro-step."""
    return examples or [Example([pad_id], [IGNORE], complete=False)]


def _visible(q_pos, k_pos, q_noisy, k_noisy, block_size: int, q_offset=0, k_offset=0):
    """The mask rules above, elementwise (True = may attend); works on broadcast tensors and in flex.

    `q_offset` / `k_offset`: the block offset of the query's / key's noisy stream (blocks are read under
    the query's); noisy streams of different offsets never see each other.
    """
    q_block = (q_pos + q_offset) // block_size
    k_block = (k_pos + q_offset) // block_size
    same_stream = q_offset == k_offset
    noisy_noisy = q_noisy & k_noisy & same_stream & (q_block == k_block) & (k_pos <= q_pos)
    noisy_clean = q_noisy & ~k_noisy & (k_block < q_block)
    clean_clean = ~q_noisy & ~k_noisy & (k_pos <= q_pos)
    return noisy_noisy | noisy_clean | clean_clean


def mars_attention_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The paper's full [2L, 2L] boolean mask over `[noisy (L) | clean (L)]`."""
    pos = torch.arange(length, device=device).repeat(2)
    noisy = torch.arange(2 * length, device=device) < length
    return _visible(pos[:, None], pos[None, :], noisy[:, None], noisy[None, :], block_size)


def collate_mars(
    examples: Sequence[Example],
    block_size: int,
    mask_id: int,
    pad_id: int,
    eos_id: int,
    attention: Literal["dense", "flex"] = "dense",
    device: torch.device | str = "cpu",
    compact: bool = True,
    offsets: Sequence[int] = (0,),
) -> MarsBatch:
    """Extend each complete example to a block multiple, right-pad to the batch, and build `[noisy | clean]`
    (no examples: one padding row that scores nothing).

    `compact` keeps only the noisy blocks that hold a scored position (right-padded per row; a padding
    column is given a block past the end, so no real query sees it); `compact=False` is the full layout.
    `offsets`: one noisy stream per block offset, in order (`(0,)`: the paper's single stream).
    `attention="flex"` builds a BlockMask on `device` (it has no CPU backward); "dense" a bool mask.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if not offsets or len(set(offsets)) != len(offsets) or not all(0 <= o < block_size for o in offsets):
        raise ValueError(f"offsets must be distinct values in [0, block_size), got {list(offsets)}")
    extended = [extend_to_block(e, block_size, eos_id) for e in _never_empty(examples, pad_id)]
    rows, length = len(extended), max(len(e.input_ids) for e in extended)
    clean = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE, dtype=torch.long)
    for i, e in enumerate(extended):
        clean[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    next_label = torch.cat([labels[:, 1:], torch.full((rows, 1), IGNORE)], dim=1)  # what position p scores
    noisy_ids = torch.where(labels != IGNORE, torch.full_like(clean, mask_id), clean)

    positions = torch.arange(length)
    scored = next_label != IGNORE
    # Per noisy stream, the positions it keeps; streams side by side, then each row's kept columns first,
    # in order (a stable sort), then padding columns.
    keep, offset = [], []
    for o in offsets:
        if compact:
            blocks = -(-(length + o) // block_size)  # position p is in block (p + o) // B
            padded = F.pad(scored, (o, blocks * block_size - length - o))
            scored_block = padded.view(rows, blocks, block_size).any(dim=2)
            keep.append(scored_block[:, (positions + o) // block_size])
        else:
            keep.append(torch.ones((rows, length), dtype=torch.bool))
        offset.append(torch.full((length,), o))
    keep, offset = torch.cat(keep, dim=1), torch.cat(offset)  # [b, S*L], [S*L]
    width = int(keep.sum(dim=1).max())
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]
    kept = keep.gather(1, order)
    source = order % length  # the clean position each noisy column stands for
    sentinel = length + block_size  # a block past every real one
    noisy_pos = torch.where(kept, source, torch.full_like(source, sentinel))
    noisy_offset = torch.where(kept, offset[order], 0)
    noisy_targets = torch.where(kept, next_label.gather(1, source), torch.full_like(source, IGNORE))
    noisy_input = torch.where(kept, noisy_ids.gather(1, source), torch.full_like(source, pad_id))

    mask_pos = torch.cat([noisy_pos, positions.expand(rows, -1)], dim=1)  # [b, N + L]
    mask_offset = torch.cat([noisy_offset, torch.zeros((rows, length), dtype=torch.long)], dim=1)
    is_noisy = torch.arange(width + length) < width
    if attention == "flex":
        mask = _flex_mask(mask_pos.to(device), mask_offset.to(device), width, block_size, device)
    else:
        mask = _visible(
            mask_pos[:, :, None],
            mask_pos[:, None, :],
            is_noisy[:, None],
            is_noisy[None, :],
            block_size,
            mask_offset[:, :, None],
            mask_offset[:, None, :],
        )[:, None]
    return MarsBatch(
        input_ids=torch.cat([noisy_input, clean], dim=1),
        position_ids=torch.where(mask_pos == sentinel, 0, mask_pos),
        attention_mask=mask,
        targets=torch.cat([noisy_targets, next_label], dim=1),
        supervised=scored.sum(dim=1).float(),
        noisy_width=width,
        noisy_streams=len(offsets),
    )


def _flex_mask(
    mask_pos: torch.Tensor, mask_offset: torch.Tensor, width: int, block_size: int, device: torch.device | str
):
    """The same mask as a flex-attention BlockMask: no dense tensor, sparse blocks skipped (GPU path)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(
            mask_pos[b, q_idx],
            mask_pos[b, kv_idx],
            q_idx < width,
            kv_idx < width,
            block_size,
            mask_offset[b, q_idx],
            mask_offset[b, kv_idx],
        )

    n = mask_pos.shape[1]
    return create_block_mask(mask_mod, B=mask_pos.shape[0], H=None, Q_LEN=n, KV_LEN=n, device=device)


def collate_ar(examples: Sequence[Example], pad_id: int) -> ArBatch:
    """Right-pad examples for plain next-token training (none: one padding row that scores nothing)."""
    examples = _never_empty(examples, pad_id)
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        targets[i, : len(e.labels) - 1] = torch.tensor(e.labels[1:])
        attention[i, : len(e.input_ids)] = 1
    positions = torch.arange(length).expand(len(examples), -1)
    return ArBatch(ids, positions, attention, targets)


class ScoredLM(nn.Module):
    """A causal LM that projects to the vocabulary only at the positions a loss scores.

    The vocabulary projection is a large part of a small model's step (SmolLM2: 28M of 135M parameters,
    at every position); a MARS batch scores only its response tokens. Wrap the model in this (then in
    DDP), call it with `**batch.model_inputs()` of a `MarsBatch` or an `ArBatch`, get logits
    [scored positions, V] in row-major order.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        config = lm.config
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            raise ValueError(f"{config.model_type}: logit softcapping or scaling is not supported")

    def forward(self, input_ids, position_ids, attention_mask, scored) -> torch.Tensor:
        """Tensors of a `MarsBatch` or `ArBatch` (`batch.model_inputs()`), so that DDP sees them."""
        hidden = self.lm.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask
        ).last_hidden_state
        return self.lm.get_output_embeddings()(hidden[scored])


def mars_loss(logits: torch.Tensor, batch: MarsBatch, ar_weight: float = 1.0) -> MarsLoss:
    """Noisy CE (averaged over the batch's noisy streams) + `ar_weight` x clean CE, averaged per sequence,
    then over the batch.

    `logits` [K, V] are the scored columns' (`batch.scored`, row-major), as `ScoredLM` returns them.
    """
    scored = batch.scored
    rows, columns = scored.nonzero().unbind(dim=1)
    noisy = columns < batch.noisy_width
    at_least_fp32 = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.to(at_least_fp32), batch.targets[scored], reduction="none")
    weight = 1.0 / (batch.supervised.to(ce.dtype).clamp(min=1.0)[rows] * len(batch.supervised))
    noisy_loss = (ce * weight * noisy).sum() / batch.noisy_streams
    clean_loss = (ce * weight * ~noisy).sum()
    return MarsLoss(noisy_loss + ar_weight * clean_loss, noisy_loss.detach(), clean_loss.detach())


def ar_loss(logits: torch.Tensor, batch: ArBatch) -> torch.Tensor:
    """Next-token CE averaged over the batch's supervised tokens, as HF's causal-LM loss (stage 1).

    `logits` [K, V] are the scored positions', as `ScoredLM` returns them.
    """
    at_least_fp32 = torch.promote_types(logits.dtype, torch.float32)
    targets = batch.targets[batch.scored]
    return F.cross_entropy(logits.to(at_least_fp32), targets, reduction="sum") / max(len(targets), 1)
