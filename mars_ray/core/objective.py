"""The MARS training objective: a `[noisy | clean]` batch, its attention mask, and the two-part loss.

Layout follows the reference code (the paper writes `[clean; noisy]`; with an explicit mask and explicit
position ids the order is immaterial). Both streams have length L and positions 0..L-1. The noisy stream is
the clean one with every supervised token (label != -100) replaced by the mask id: 100% of the response,
no random ratio. Block of position p is p // B.

    clean -> clean : k <= q                           (plain causal LM)
    noisy -> noisy : blk(k) == blk(q) and k <= q      (causal inside a block, unlike BD3LM)
    noisy -> clean : blk(k) <  blk(q)                 (strictly earlier blocks only)
    clean -> noisy : never
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized chat: `labels` is `input_ids` with the prompt set to -100 (unshifted)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class MarsBatch:
    """Model inputs for one MARS step; `labels` index the clean stream, shape [b, L]."""

    input_ids: torch.Tensor  # [b, 2L]: noisy | clean
    position_ids: torch.Tensor  # [b, 2L]: 0..L-1 twice
    attention_mask: torch.Tensor | object  # [b, 1, 2L, 2L] bool, or a flex-attention BlockMask
    labels: torch.Tensor  # [b, L]

    def to(self, device: torch.device | str) -> MarsBatch:
        mask = self.attention_mask
        return MarsBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            mask.to(device),
            self.labels.to(device),
        )


@dataclass
class ArBatch:
    """Model inputs for one plain next-token (AR SFT) step, right padded."""

    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L] 1 for real tokens
    labels: torch.Tensor  # [b, L], unshifted

    def to(self, device: torch.device | str) -> ArBatch:
        return ArBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


@dataclass
class MarsLoss:
    """`total` is what is optimised; `noisy` and `clean` are its parts, for logging."""

    total: torch.Tensor
    noisy: torch.Tensor
    clean: torch.Tensor


def extend_to_block(example: Example, block_size: int, eos_id: int) -> Example:
    """Append supervised EOS tokens until the length is a multiple of the block size (stage 2 only)."""
    extra = -len(example.input_ids) % block_size
    return Example(example.input_ids + [eos_id] * extra, example.labels + [eos_id] * extra)


def mars_attention_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The [2L, 2L] boolean mask (True = may attend) over `[noisy (L) | clean (L)]`."""
    pos = torch.arange(length, device=device)
    q, k = pos[:, None], pos[None, :]
    causal = k <= q
    same_block = (q // block_size) == (k // block_size)
    earlier_block = (k // block_size) < (q // block_size)
    top = torch.cat([same_block & causal, earlier_block], dim=1)  # noisy queries
    bottom = torch.cat([torch.zeros_like(causal), causal], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def mars_block_mask(length: int, block_size: int, device: torch.device | str):
    """The same mask as a flex-attention BlockMask: no [2L, 2L] tensor, sparse blocks skipped (GPU path)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        q_noisy, k_noisy = q_idx < length, kv_idx < length
        q, k = q_idx % length, kv_idx % length
        qb, kb = q // block_size, k // block_size
        noisy_noisy = q_noisy & k_noisy & (qb == kb) & (k <= q)
        noisy_clean = q_noisy & ~k_noisy & (kb < qb)
        clean_clean = ~q_noisy & ~k_noisy & (k <= q)
        return noisy_noisy | noisy_clean | clean_clean

    n = 2 * length
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)


def collate_mars(
    examples: Sequence[Example],
    block_size: int,
    mask_id: int,
    pad_id: int,
    eos_id: int,
    attention: Literal["dense", "flex"] = "dense",
    device: torch.device | str = "cpu",
) -> MarsBatch:
    """Extend each example to a block multiple, right-pad to the batch, and build `[noisy | clean]`.

    `attention="flex"` builds a BlockMask on `device` (it has no CPU backward); "dense" a broadcast bool mask.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    extended = [extend_to_block(e, block_size, eos_id) for e in examples]
    length = max(len(e.input_ids) for e in extended)
    clean = torch.full((len(extended), length), pad_id, dtype=torch.long)
    labels = torch.full((len(extended), length), IGNORE, dtype=torch.long)
    for i, e in enumerate(extended):
        clean[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    noisy = torch.where(labels != IGNORE, torch.full_like(clean, mask_id), clean)
    positions = torch.arange(length).repeat(2).expand(len(extended), -1)
    if attention == "flex":
        mask = mars_block_mask(length, block_size, device)
    else:
        mask = mars_attention_mask(length, block_size)[None, None].expand(len(extended), 1, -1, -1)
    return MarsBatch(torch.cat([noisy, clean], dim=1), positions, mask, labels)


def collate_ar(examples: Sequence[Example], pad_id: int) -> ArBatch:
    """Right-pad examples for plain next-token training."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        attention[i, : len(e.input_ids)] = 1
    return ArBatch(ids, attention, labels)


def _shifted_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE [b, L-1] of label i scored from position i-1; zero where ignored."""
    vocab = logits.shape[-1]
    at_least_fp32 = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).to(at_least_fp32),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view(labels.shape[0], -1)


def mars_loss(logits: torch.Tensor, labels: torch.Tensor, ar_weight: float = 1.0) -> MarsLoss:
    """Noisy CE + `ar_weight` x clean CE, averaged per sequence, then over the batch.

    Each stream is right-shifted on its own (label i from position i-1 of the same stream). The reference
    code shifts the joined 2L sequence, which only differs at clean position 0, whose label is always -100.
    """
    length = labels.shape[1]
    supervised = (labels[:, 1:] != IGNORE).float()
    per_seq = supervised.sum(dim=1).clamp(min=1.0)
    noisy = (_shifted_token_ce(logits[:, :length], labels).sum(dim=1) / per_seq).mean()
    clean = (_shifted_token_ce(logits[:, length:], labels).sum(dim=1) / per_seq).mean()
    return MarsLoss(noisy + ar_weight * clean, noisy.detach(), clean.detach())


def ar_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain shifted CE averaged over supervised tokens of the batch, as HF's causal-LM loss (stage 1)."""
    ce = _shifted_token_ce(logits, labels)
    return ce.sum() / (labels[:, 1:] != IGNORE).sum().clamp(min=1)
