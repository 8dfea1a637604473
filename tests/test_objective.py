"""The training objective: mask, layout, loss. Checked against hand-written references and brute force."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny

from mars_ray.core.objective import (
    IGNORE,
    Example,
    ar_loss,
    collate_ar,
    collate_mars,
    mars_attention_mask,
    mars_loss,
)

# Fig. 2 of the paper for L=8, B=4, in our [noisy | clean] layout. Rows are queries, columns keys.
REFERENCE_L8_B4 = """
1000000000000000
1100000000000000
1110000000000000
1111000000000000
0000100011110000
0000110011110000
0000111011110000
0000111111110000
0000000010000000
0000000011000000
0000000011100000
0000000011110000
0000000011111000
0000000011111100
0000000011111110
0000000011111111
"""


def test_mask_equals_hand_written_reference():
    expected = torch.tensor([[c == "1" for c in row] for row in REFERENCE_L8_B4.split()])
    assert torch.equal(mars_attention_mask(8, 4), expected)


def example(prompt_len: int, response_len: int, seed: int) -> Example:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MASK_ID, (prompt_len + response_len,), generator=g).tolist()
    return Example(ids, [IGNORE] * prompt_len + ids[prompt_len:])


def test_collate_layout():
    batch = collate_mars(
        [example(3, 6, 0), example(5, 1, 1)], block_size=4, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID
    )
    length = batch.labels.shape[1]
    assert length % 4 == 0 and batch.input_ids.shape == (2, 2 * length)
    noisy, clean = batch.input_ids[:, :length], batch.input_ids[:, length:]
    supervised = batch.labels != IGNORE
    assert torch.equal(noisy == MASK_ID, supervised)  # 100% of supervised tokens masked, nothing else
    assert torch.equal(noisy[~supervised], clean[~supervised])  # prompt and padding keep their real ids
    assert torch.equal(batch.position_ids[:, :length], batch.position_ids[:, length:])
    assert torch.equal(batch.position_ids[0, :length], torch.arange(length))
    # each example is extended with supervised EOS to a block multiple (9 -> 12, 6 -> 8), then right padded
    assert batch.labels[0, 9:12].tolist() == [EOS_ID] * 3 and clean[0, 9:12].tolist() == [EOS_ID] * 3
    assert batch.labels[1, 6:8].tolist() == [EOS_ID] * 2
    assert batch.labels[1, 8:].tolist() == [IGNORE] * 4 and clean[1, 8:].tolist() == [PAD_ID] * 4


def test_collate_rejects_block_size_one():
    with pytest.raises(ValueError, match="block_size"):
        collate_mars([example(2, 2, 0)], block_size=1, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID)


def visible(length: int, block: int, p: int) -> set[tuple[str, int]]:
    """What the noisy output at position p may depend on: clean tokens of earlier blocks, masks before it."""
    start = (p // block) * block
    return {("clean", k) for k in range(start)} | {("noisy", k) for k in range(start, p + 1)}


def test_noisy_visibility_by_brute_force():
    """Perturb every input position; a noisy output changes if and only if that position is visible to it."""
    length, block = 12, 4
    model = build_tiny("llama")
    batch = collate_mars([example(3, 9, 2)], block_size=block, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID)
    assert batch.labels.shape[1] == length

    def noisy_logits(ids):
        with torch.no_grad():
            out = model(
                input_ids=ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
            ).logits
        return out[0, :length]

    base = noisy_logits(batch.input_ids)
    for stream, offset in (("noisy", 0), ("clean", length)):
        for k in range(length):
            ids = batch.input_ids.clone()
            ids[0, offset + k] = (ids[0, offset + k] + 7) % (MASK_ID - 3) + 3
            changed = (noisy_logits(ids) - base).abs().amax(dim=-1) > 1e-9
            for p in range(length):
                assert bool(changed[p]) == ((stream, k) in visible(length, block, p)), (stream, k, p)


def test_clean_stream_is_a_plain_causal_lm(tiny_model):
    batch = collate_mars(
        [example(3, 9, 3), example(4, 3, 4)], block_size=4, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID
    )
    length = batch.labels.shape[1]
    with torch.no_grad():
        joint = tiny_model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
        ).logits
        plain = tiny_model(input_ids=batch.input_ids[:, length:]).logits
    torch.testing.assert_close(joint[:, length:], plain, rtol=0, atol=1e-10)


def log_softmax_at(row: list[float], index: int) -> float:
    top = max(row)
    return row[index] - top - math.log(sum(math.exp(v - top) for v in row))


def test_loss_equals_hand_computation():
    torch.manual_seed(0)
    length, vocab = 4, 5
    labels = torch.tensor([[IGNORE, 3, 1, IGNORE], [IGNORE, IGNORE, 4, 2]])
    logits = torch.randn(2, 2 * length, vocab, dtype=torch.float64)
    ar_weight = 0.5

    per_seq = []
    noisy_parts, clean_parts = [], []
    for b in range(2):
        noisy, clean, count = 0.0, 0.0, 0
        for i in range(1, length):
            y = int(labels[b, i])
            if y == IGNORE:
                continue
            noisy -= log_softmax_at(logits[b, i - 1].tolist(), y)  # noisy stream, shifted within itself
            clean -= log_softmax_at(logits[b, length + i - 1].tolist(), y)  # clean stream
            count += 1
        per_seq.append((noisy + ar_weight * clean) / count)
        noisy_parts.append(noisy / count)
        clean_parts.append(clean / count)

    loss = mars_loss(logits, labels, ar_weight)
    assert loss.total.item() == pytest.approx(sum(per_seq) / 2, rel=1e-12)
    assert loss.noisy.item() == pytest.approx(sum(noisy_parts) / 2, rel=1e-12)
    assert loss.clean.item() == pytest.approx(sum(clean_parts) / 2, rel=1e-12)


def test_ar_loss_matches_transformers(tiny_llama):
    batch = collate_ar([example(3, 5, 5), example(2, 2, 6)], pad_id=PAD_ID)
    with torch.no_grad():
        out = tiny_llama(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
    assert ar_loss(out.logits, batch.labels).item() == pytest.approx(
        out.loss.item(), rel=1e-6
    )  # HF upcasts to fp32


@pytest.mark.slow
def test_flex_block_mask_equals_dense():
    """The flex-attention path computes the same logits (forward only: flex has no CPU backward)."""
    dense = build_tiny("llama", dtype=torch.float32)
    flex = build_tiny("llama", dtype=torch.float32, attn_implementation="flex_attention")
    flex.load_state_dict(dense.state_dict())
    examples = [example(3, 6, 7), example(5, 9, 8)]
    a = collate_mars(examples, 4, MASK_ID, PAD_ID, EOS_ID)
    b = collate_mars(examples, 4, MASK_ID, PAD_ID, EOS_ID, attention="flex")
    with torch.no_grad():
        want = dense(
            input_ids=a.input_ids, position_ids=a.position_ids, attention_mask=a.attention_mask
        ).logits
        got = flex(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.attention_mask).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
