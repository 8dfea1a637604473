"""The reference decoders the production decoder (`decoder.py`) is checked and benchmarked against; nothing
served or trained runs them.

- `decode_reference`: no cache, recomputes everything; the ground truth (the paper's `MARSSampler`).
- `decode_block_cached`: the paper's block-level cache for left-padded batches (Table 5).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeResult, DecodeState
from mars_ray.core.errors import ConfigError
from mars_ray.core.kv_cache import RaggedCache, right_align
from mars_ray.core.sampling import propose


@torch.inference_mode()
def decode_reference(
    model: PreTrainedModel, prompt: Sequence[int], mask_id: int, config: DecodeConfig
) -> DecodeResult:
    """The ground truth: each step recomputes `[prompt + output, MASK x (W - 1)]` (W: `DecodeState.window`)
    with plain causal attention."""
    seq = DecodeState(list(prompt), config)
    while not seq.finished:
        context, width = seq.prompt + seq.tokens, seq.window
        ids = torch.tensor([context + [mask_id] * (width - 1)], device=model.device)
        logits = model(input_ids=ids).logits[:, len(context) - 1 :]
        seq.forward_passes += 1
        tokens, confidence, read = propose(logits, [seq], mask_id=mask_id)
        new = seq.take(tokens[0], confidence[0])
        seq.record_logprobs(new, read[0], mask_id)
    return seq.result()


@torch.inference_mode()
def decode_block_cached(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    mask_id: int,
    config: DecodeConfig | Sequence[DecodeConfig],
    cache_block: int = 32,
    pad_id: int = 0,
    fuse_extend: bool = False,
) -> list[DecodeResult]:
    """The paper's block-level KV cache (`MARSBlockCachedSampler`) over a left-padded batch.

    Prefill once. Then per block of `cache_block` slots: forward the block (accepted tokens + masks)
    against the block-start cache without keeping it, accept per row from its fill point to the block end,
    repeat until every row's block is full (full rows idle), then an extend pass appends the block to the
    cache and yields the next block's slot-0 logits. Rows are synchronised at block ends so the batch
    cache stays rectangular. `fuse_extend` folds each extend into the next block's first forward
    (`[block | masks]`, keeping only the block): same tokens, one forward fewer per block.
    A row that finishes leaves the batch at once. `config.block_size` is not used here: the window is
    the rest of the block, capped by `max_accept` and, as the sliding decoder's, by the tokens the row may
    still produce (`_fed`). Log-probabilities are recorded as the sliding decoder records them.
    """
    configs = [config] * len(prompts) if isinstance(config, DecodeConfig) else list(config)
    if any(c.verify for c in configs):
        raise ConfigError("verify", "the block-cached decoder does not verify; use the sliding decoder")
    seqs = [DecodeState(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    live = list(seqs)
    cache = RaggedCache(model)
    cache.add_rows(len(live))
    device = cache.device

    ids, real = right_align([seq.prompt for seq in live], pad_id)
    last = cache.forward(ids.to(device), real.to(device), ids.shape[1], 1)[:, -1]  # slot-0 logits of block 1
    for seq in live:
        seq.forward_passes += 1

    all_real = torch.ones((len(live), cache_block), dtype=torch.bool, device=device)
    block = torch.full((len(live), cache_block), mask_id, dtype=torch.long, device=device)
    filled = [0] * len(live)
    pending_extend = False
    while live:
        if pending_extend and fuse_extend:
            # Extend and first inner forward at once: `[full block | masks]`, cache only the block.
            masks = torch.full_like(block, mask_id)
            both = torch.cat([block, masks], dim=1)
            fed = torch.cat([all_real, _fed(live, [0] * len(live), cache_block).to(device)], dim=1)
            logits = cache.forward(both, fed, cache_block, cache_block + 1)
            last, logits = logits[:, 0], logits[:, 1:]
            block, filled, pending_extend = masks, [0] * len(live), False
        else:
            logits = cache.forward(block, _fed(live, filled, cache_block).to(device), 0, cache_block)
        for seq in live:
            seq.forward_passes += 1
        slots = torch.cat([last[:, None], logits[:, :-1]], dim=1)
        tokens, confidence, read = propose(slots, live, filled, mask_id)
        for row, seq in enumerate(live):
            start = filled[row]
            if start == cache_block:
                continue  # this row's block is full: it idles until the others fill theirs
            new = seq.take(tokens[row][start:], confidence[row][start:])
            seq.record_logprobs(new, read[row, start:], mask_id)
            block[row, start : start + len(new)] = torch.tensor(new, device=device)
            filled[row] += len(new)

        keep = [row for row, seq in enumerate(live) if not seq.finished]
        if len(keep) < len(live):
            live, filled = [live[r] for r in keep], [filled[r] for r in keep]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            block, last, all_real = block[index], last[index], all_real[index]
            cache.keep_rows(keep)
        if live and min(filled) == cache_block:
            if fuse_extend:
                pending_extend = True
                continue
            last = cache.forward(block, all_real, cache_block, 1)[:, -1]
            for seq in live:
                seq.forward_passes += 1
            block = torch.full_like(block, mask_id)
            filled = [0] * len(live)
    return [s.result() for s in seqs]


def _fed(live: Sequence[DecodeState], filled: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width]: the block columns a forward feeds. A row's accepted tokens and the masks of the slots
    it may still fill; the masks past the tokens it may still produce (its `room`) are holes, so that none
    takes a position past its budget and the context (as `DecodeState.window` caps the sliding decoder)."""
    columns = torch.arange(width)[None, :]
    ends = torch.tensor([start + seq.room - 1 for start, seq in zip(filled, live, strict=True)])
    return columns < ends[:, None]
