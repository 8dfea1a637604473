"""The mask token: added when missing, embedded only when it does not fit, saved with the checkpoint."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mars_ray.core.tokens import MASK_TOKEN, prepare_for_mars


def small_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"])
    bpe.train_from_iterator(
        ["hello world", "the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")


def small_model(vocab: int, tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def test_mask_added_resized_and_saved(tmp_path):
    tokenizer = small_tokenizer()
    model = small_model(len(tokenizer), tied=False)
    old_rows = model.get_input_embeddings().weight.shape[0]
    mask_id = prepare_for_mars(model, tokenizer)
    assert tokenizer.mask_token == MASK_TOKEN and mask_id == old_rows  # no spare row: resized by exactly one
    assert model.get_input_embeddings().weight.shape[0] == mask_id + 1
    assert model.get_output_embeddings().weight.shape[0] == mask_id + 1
    assert tokenizer.pad_token == tokenizer.eos_token
    # the new rows start at the mean of the old ones: two preparations of one base model agree
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[mask_id], emb[:mask_id].mean(dim=0))
    assert prepare_for_mars(model, tokenizer) == mask_id  # idempotent
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.mask_token_id == mask_id
    assert LlamaForCausalLM.from_pretrained(tmp_path).get_input_embeddings().weight.shape[0] > mask_id


def test_spare_rows_are_used_without_resizing():
    tokenizer = small_tokenizer()
    model = small_model(len(tokenizer) + 64, tied=True)  # like Qwen2.5's padded embedding matrix
    before = model.get_input_embeddings().weight.clone()
    mask_id = prepare_for_mars(model, tokenizer)
    assert mask_id < before.shape[0]
    assert torch.equal(model.get_input_embeddings().weight, before)
