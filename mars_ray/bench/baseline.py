"""The AR baseline: transformers `generate`, greedy with its KV cache.

Every speed ratio (`mars-ray bench decode`, the load test's `--hf-peer`) and every greedy-equality check
(`mars-ray eval`) is taken against this one call, so all of them compare against the same thing: the same
left padding, the same stop tokens, the same cut after the first stop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def hf_greedy_tokens(
    model, prompts: list[list[int]], max_new_tokens: int, stops: Sequence[int], pad_id: int, **extra
) -> list[list[int]]:
    """transformers `generate`, greedy with its KV cache, over the prompts left-padded into one batch (`extra`
    goes to `generate`, e.g. `prompt_lookup_num_tokens`). Returns each row's generated tokens up to and
    including its first stop token."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=model.device)
    attention = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=attention,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stops),
        pad_token_id=pad_id,
        **extra,
    )
    return [_until_stop(row, stops) for row in out[:, longest:].tolist()]


def _until_stop(row: list[int], stops: Sequence[int]) -> list[int]:
    """A row of the batch as a run of its own would end it: up to and including its first stop token (HF
    fills the rest of a row that finished early with padding)."""
    for i, token in enumerate(row):
        if token in stops:
            return row[: i + 1]
    return row
