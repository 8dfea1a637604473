"""The mask token: the only thing MARS adds to a causal LM, and it is a token, not a parameter block."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

MASK_TOKEN = "<|mask|>"


def prepare_for_mars(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """Give `tokenizer` a mask token and `model` an embedding row for it; return the mask id.

    Idempotent. The embeddings are resized only when the id does not fit: Qwen2.5 has spare padded rows,
    SmolLM2 does not. A new row starts at the mean of the old ones, deterministically, so two loads of the
    same base model agree. `tokenizer.save_pretrained` then records the mask token, so a reload finds it.
    A missing pad token falls back to EOS (right padding in training, holes in decoding: never attended).
    """
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    mask_id = int(tokenizer.mask_token_id)
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_id >= rows:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        with torch.no_grad():
            for embedding in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
                embedding.weight[rows:] = embedding.weight[:rows].mean(dim=0)
    model.config.mask_token_id = mask_id
    return mask_id
