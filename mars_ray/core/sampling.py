"""Reading a forward's logits: per slot the proposed token and its confidence, and log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the state module reads log-probabilities from here
    from mars_ray.core.decode_state import DecodeState


def text_log_probs(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """fp32 log-probabilities over the vocabulary less the mask token, which is not text: a plain model that
    MARS gave a mask row reports the log-probabilities it reported before, not a softmax that row dilutes."""
    logits = logits.float()
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_id] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def propose(
    logits: torch.Tensor,
    seqs: Sequence[DecodeState],
    first_slot: Sequence[int] | None = None,
    mask_id: int | None = None,
    slots: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Per slot, the greedy (or Gumbel-max sampled) token and its fp32 probability. logits: [n, W, V].

    A row's window starts at column `first_slot[row]` (default 0) and is `slots[row]` columns wide (default:
    to the end); its `slot_temperatures` scale its slots' logits before the probability is read. A mask slot
    (after the first) never proposes the mask token or an id at or past the row's `vocab_limit` (padded
    embedding rows): neither is text. The first slot is the model's own greedy choice, exactly as
    `generate`'s; a sampling row never draws the mask in any slot (`text_log_probs` leaves it out too). It
    draws for its own window's slots only: its random stream, and so a seeded row's tokens, never depend on
    how wide its neighbours' windows made the batch.
    """
    first_slot = first_slot or [0] * len(seqs)
    slots = slots or [logits.shape[1] - start for start in first_slot]
    logits = _never_in_mask_slots(logits.float(), seqs, first_slot, mask_id)
    logits = _no_stop_before_min_tokens(logits, seqs, first_slot)
    tokens = logits.argmax(dim=-1)
    scale = _slot_scales(seqs, logits.shape[1], first_slot)
    scaled = logits if scale is None else logits / scale.to(logits.device)[:, :, None]
    confidence = torch.softmax(scaled, dim=-1).gather(-1, tokens[:, :, None])[:, :, 0]
    for i, seq in enumerate(seqs):
        cfg = seq.config
        if cfg.temperature <= 0:
            continue
        own = slice(first_slot[i], first_slot[i] + slots[i])
        scores = logits[i, own].cpu() / cfg.temperature
        if mask_id is not None and mask_id < scores.shape[-1]:
            scores[:, mask_id] = float("-inf")  # not text, in no slot: the model's own text distribution
        row = torch.softmax(scores, dim=-1)
        if cfg.top_p < 1.0:
            row = _top_p(row, cfg.top_p)
        gumbel = -torch.log(-torch.log(torch.rand(row.shape, generator=seq.generator).clamp_min(1e-20)))
        choice = (row.log() + gumbel).argmax(dim=-1)
        tokens[i, own] = choice.to(tokens.device)
        confidence[i, own] = row.gather(-1, choice[:, None])[:, 0].to(confidence.device)
    return tokens.tolist(), confidence.tolist(), logits


def _never_in_mask_slots(
    logits: torch.Tensor, seqs: Sequence[DecodeState], first_slot: Sequence[int], mask_id: int | None
) -> torch.Tensor:
    """`logits` with the ids a mask slot must not propose at -inf, in the mask slots only."""
    rows, width, vocab = logits.shape
    banned = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    if mask_id is not None and mask_id < vocab:
        banned[:, mask_id] = True
    for row, seq in enumerate(seqs):
        if seq.config.vocab_limit is not None:
            banned[row, seq.config.vocab_limit :] = True
    if not banned.any():
        return logits
    columns = torch.arange(width, device=logits.device)[None, :]
    after = columns > torch.tensor(list(first_slot), device=logits.device)[:, None]
    return logits.masked_fill(after[:, :, None] & banned[:, None, :], float("-inf"))


def _no_stop_before_min_tokens(
    logits: torch.Tensor, seqs: Sequence[DecodeState], first_slot: Sequence[int]
) -> torch.Tensor:
    """`logits` with a row's stop tokens at -inf in the columns that predict a token before its
    `min_tokens`-th (HF's `min_new_tokens`). Column c predicts output position c - start, where start is
    the row's first slot, less its drafts (a verified row's drafts are predicted from the columns before)."""
    rows = [
        r
        for r, seq in enumerate(seqs)
        if len(seq.tokens) < seq.config.min_tokens and seq.config.stop_token_ids
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        seq = seqs[row]
        start = first_slot[row] - len(seq.drafts)
        end = min(logits.shape[1], start + seq.config.min_tokens - len(seq.tokens))
        stops = torch.tensor(seq.config.stop_token_ids, device=logits.device)
        logits[row, max(start, 0) : end, stops] = float("-inf")
    return logits


def _slot_scales(seqs: Sequence[DecodeState], width: int, first_slot: Sequence[int]) -> torch.Tensor | None:
    """[n, W] temperatures per row and column (1 outside a row's list), or None when every row is raw."""
    if not any(seq.config.slot_temperatures for seq in seqs):
        return None
    scale = torch.ones(len(seqs), width)
    for row, (seq, start) in enumerate(zip(seqs, first_slot, strict=True)):
        temperatures = seq.config.slot_temperatures[: width - start]
        scale[row, start : start + len(temperatures)] = torch.tensor(temperatures)
    return scale


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches `top_p`, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
