"""The training objective: mask, layout, loss. Checked against hand-written references and brute force."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny

from mars_ray.core.objective import (
    IGNORE,
    Example,
    MarsBatch,
    ScoredLM,
    ar_loss,
    collate_ar,
    collate_mars,
    extend_to_block,
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


def collate(examples, compact=True, **kwargs):
    return collate_mars(examples, 4, MASK_ID, PAD_ID, EOS_ID, compact=compact, **kwargs)


def test_full_layout():
    batch = collate([example(3, 6, 0), example(5, 1, 1)], compact=False)
    length = batch.noisy_width
    assert length % 4 == 0 and batch.input_ids.shape == (2, 2 * length)
    noisy, clean = batch.input_ids[:, :length], batch.input_ids[:, length:]
    # each example is extended with supervised EOS to a block multiple (9 -> 12, 6 -> 8), then right padded
    assert clean[0, 9:12].tolist() == [EOS_ID] * 3 and clean[1, 8:].tolist() == [PAD_ID] * 4
    supervised = torch.tensor([[False] * 3 + [True] * 9, [False] * 5 + [True] * 3 + [False] * 4])
    assert torch.equal(noisy == MASK_ID, supervised)  # 100% of supervised tokens masked, nothing else
    assert torch.equal(noisy[~supervised], clean[~supervised])  # prompt and padding keep their real ids
    assert torch.equal(batch.position_ids[:, :length], batch.position_ids[:, length:])
    assert torch.equal(batch.position_ids[0, :length], torch.arange(length))
    # position p of either stream is scored against token p + 1 when that token is supervised
    next_supervised = torch.cat([supervised[:, 1:], torch.zeros(2, 1, dtype=torch.bool)], dim=1)
    assert torch.equal(batch.scored, torch.cat([next_supervised, next_supervised], dim=1))
    assert torch.equal(batch.targets[:, length:][next_supervised], clean[:, 1:][supervised[:, 1:]])
    assert batch.supervised.tolist() == [9, 3]
    assert torch.equal(batch.attention_mask[0, 0], mars_attention_mask(length, 4))


def test_compact_layout_keeps_only_scored_blocks():
    """Prompt 9 + response 6 (-> 16 with EOS): blocks 0 and 1 hold no scored position; block 2 holds
    position 8, the last prompt token, whose logits score the first response token; blocks 2-3 stay, in
    order, and a row with fewer is padded."""
    full = collate([example(9, 6, 0), example(2, 2, 1)], compact=False)
    batch = collate([example(9, 6, 0), example(2, 2, 1)])
    assert batch.noisy_width == 8 and full.noisy_width == 16
    assert batch.position_ids[0, :8].tolist() == list(range(8, 16))
    assert torch.equal(batch.input_ids[0, :8], full.input_ids[0, 8:16])
    assert batch.position_ids[1, :4].tolist() == [0, 1, 2, 3]  # its one block, then 4 padding columns
    assert batch.scored[1, 4:8].sum() == 0 and batch.input_ids[1, 4:8].tolist() == [PAD_ID] * 4
    assert torch.equal(batch.input_ids[:, 8:], full.input_ids[:, 16:])  # the same clean stream
    assert torch.equal(batch.supervised, full.supervised)
    assert batch.scored.sum() == full.scored.sum()


def test_collate_rejects_block_size_one():
    with pytest.raises(ValueError, match="block_size"):
        collate_mars([example(2, 2, 0)], block_size=1, mask_id=MASK_ID, pad_id=PAD_ID, eos_id=EOS_ID)


def visible(length: int, block: int, p: int, offset: int = 0) -> set[tuple[str, int]]:
    """What the noisy output at position p may depend on: clean tokens of earlier blocks, masks before it.
    With a block offset o, block boundaries sit at positions b * B - o."""
    start = max(((p + offset) // block) * block - offset, 0)
    return {("clean", k) for k in range(start)} | {("noisy", k) for k in range(start, p + 1)}


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_noisy_visibility_by_brute_force(offset):
    """Perturb every input position; a noisy output changes if and only if that position is visible to it."""
    length, block = 12, 4
    model = build_tiny("llama")
    batch = collate([example(3, 9, 2)], compact=False, offsets=(offset,))
    assert batch.noisy_width == length

    def noisy_logits(ids):
        with torch.no_grad():
            out = model(
                input_ids=ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
            ).logits
        return out[0, :length]

    base = noisy_logits(batch.input_ids)
    for stream, column in (("noisy", 0), ("clean", length)):
        for k in range(length):
            ids = batch.input_ids.clone()
            ids[0, column + k] = (ids[0, column + k] + 7) % (MASK_ID - 3) + 3
            changed = (noisy_logits(ids) - base).abs().amax(dim=-1) > 1e-9
            for p in range(length):
                assert bool(changed[p]) == ((stream, k) in visible(length, block, p, offset)), (stream, k, p)


@pytest.mark.parametrize("compact", [True, False])
def test_clean_stream_is_a_plain_causal_lm(tiny_model, compact):
    batch = collate([example(3, 9, 3), example(8, 3, 4)], compact=compact)
    width = batch.noisy_width
    with torch.no_grad():
        joint = tiny_model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
        ).logits
        plain = tiny_model(input_ids=batch.input_ids[:, width:]).logits
    torch.testing.assert_close(joint[:, width:], plain, rtol=0, atol=1e-10)


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

    next_labels = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
    unused = torch.zeros(2, 2 * length, dtype=torch.long)
    batch = MarsBatch(unused, unused, None, next_labels.repeat(1, 2), torch.tensor([2.0, 2.0]), length)
    loss = mars_loss(logits[batch.scored], batch, ar_weight)
    assert loss.total.item() == pytest.approx(sum(per_seq) / 2, rel=1e-12)
    assert loss.noisy.item() == pytest.approx(sum(noisy_parts) / 2, rel=1e-12)
    assert loss.clean.item() == pytest.approx(sum(clean_parts) / 2, rel=1e-12)


def reference_mars_loss(model, examples: list[Example], ar_weight: float) -> torch.Tensor:
    """The objective as the paper's code computes it: the full [noisy (L) | clean (L)] sequence, logits at
    every position, each stream right-shifted on its own, CE per sequence over its supervised labels."""
    extended = [extend_to_block(e, 4, EOS_ID) for e in examples]
    length = max(len(e.input_ids) for e in extended)
    clean = torch.full((len(extended), length), PAD_ID)
    labels = torch.full((len(extended), length), IGNORE)
    for i, e in enumerate(extended):
        clean[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    noisy = torch.where(labels != IGNORE, MASK_ID, clean)
    mask = mars_attention_mask(length, 4)[None, None].expand(len(extended), 1, -1, -1)
    logits = model(
        input_ids=torch.cat([noisy, clean], dim=1),
        position_ids=torch.arange(length).repeat(2)[None].expand(len(extended), -1),
        attention_mask=mask,
    ).logits
    total = 0.0
    for half, weight in ((logits[:, :length], 1.0), (logits[:, length:], ar_weight)):
        ce = torch.nn.functional.cross_entropy(
            half[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE, reduction="none"
        )
        total = total + weight * ce.sum(dim=1) / (labels[:, 1:] != IGNORE).sum(dim=1)
    return total.mean()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compact_step_equals_the_full_objective(family):
    """Dropped noisy blocks and logits only where scored: the same loss and gradients, fewer columns."""
    examples = [example(9, 6, 10), example(2, 7, 11), example(13, 1, 12), example(5, 5, 13)]
    model = build_tiny(family, sharpness=1.0)
    want = reference_mars_loss(model, examples, ar_weight=0.7)
    want.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    batch = collate(examples)
    got = mars_loss(ScoredLM(model)(**batch.model_inputs()), batch, ar_weight=0.7)
    got.total.backward()
    assert got.total.item() == pytest.approx(want.item(), rel=1e-12)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, want_grads[name], rtol=1e-10, atol=1e-13)
    assert batch.input_ids.shape[1] < collate(examples, compact=False).input_ids.shape[1]


def test_block_offsets_average_the_single_stream_objectives():
    """Noisy streams at offsets 0..B-1 beside one clean stream: the loss and gradients are those of the
    single-stream objectives averaged (noisy part; the clean part is shared), so no stream sees another."""
    examples = [example(9, 6, 20), example(2, 7, 21), example(5, 5, 22)]
    model = build_tiny("llama", sharpness=1.0)
    offsets = (0, 1, 2, 3)
    want_total, want_noisy = 0.0, 0.0
    for o in offsets:
        batch = collate(examples, offsets=(o,))
        loss = mars_loss(ScoredLM(model)(**batch.model_inputs()), batch, ar_weight=0.7)
        want_total = want_total + loss.total / len(offsets)  # the clean part is the same in each
        want_noisy += loss.noisy.item() / len(offsets)
    want_total.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    batch = collate(examples, offsets=offsets)
    got = mars_loss(ScoredLM(model)(**batch.model_inputs()), batch, ar_weight=0.7)
    got.total.backward()
    assert batch.noisy_streams == 4
    assert batch.scored[:, : batch.noisy_width].sum() == 4 * batch.supervised.sum()
    assert got.noisy.item() == pytest.approx(want_noisy, rel=1e-12)
    assert got.total.item() == pytest.approx(want_total.item(), rel=1e-12)  # a leak moves it by ~1e-2
    for name, parameter in model.named_parameters():
        # SDPA's CPU backward differs by ~1e-8 between sequence widths (first layer only), even in fp64
        torch.testing.assert_close(parameter.grad, want_grads[name], rtol=1e-6, atol=1e-7)


def test_collate_rejects_bad_offsets():
    for offsets in [(), (0, 0), (4,), (-1,)]:
        with pytest.raises(ValueError, match="offsets"):
            collate([example(2, 2, 0)], offsets=offsets)


def test_ar_loss_matches_transformers(tiny_llama):
    examples = [example(3, 5, 5), example(2, 2, 6)]
    batch = collate_ar(examples, pad_id=PAD_ID)
    labels = torch.full(batch.input_ids.shape, IGNORE)
    for i, e in enumerate(examples):
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    with torch.no_grad():
        want = tiny_llama(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
        got = ar_loss(ScoredLM(tiny_llama)(**batch.model_inputs()), batch)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)  # HF upcasts to fp32


@pytest.mark.slow
def test_flex_block_mask_equals_dense():
    """The flex-attention path computes the same logits (forward only: flex has no CPU backward)."""
    dense = build_tiny("llama", dtype=torch.float32)
    flex = build_tiny("llama", dtype=torch.float32, attn_implementation="flex_attention")
    flex.load_state_dict(dense.state_dict())
    examples = [example(3, 6, 7), example(9, 9, 8)]
    a = collate(examples)
    b = collate(examples, attention="flex")
    with torch.no_grad():
        want = ScoredLM(dense)(**a.model_inputs())
        got = ScoredLM(flex)(**b.model_inputs())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_eos_is_supervised_only_after_a_complete_reply():
    """A reply cut short (a distilled row marked `complete: false`, or one cut at `max_length`) is not
    extended with supervised EOS: that would teach the model to stop where the text was cut."""
    whole = example(3, 6, 0)  # 9 tokens: 3 supervised EOS fill its last block of 4
    cut = Example(whole.input_ids, whole.labels, complete=False)
    assert extend_to_block(whole, 4, EOS_ID).labels[-4:] == [whole.labels[-1]] + [EOS_ID] * 3
    assert extend_to_block(cut, 4, EOS_ID) == cut
    batch = collate([whole, cut])
    assert batch.supervised.tolist() == [6 + 3, 6]  # the cut row scores its own 6 reply tokens only
    clean = batch.targets[:, batch.noisy_width :]
    assert clean[1][clean[1] != IGNORE].tolist() == whole.input_ids[3:]
    noisy = batch.targets[:, : batch.noisy_width]
    assert sorted(noisy[1][noisy[1] != IGNORE].tolist()) == sorted(whole.input_ids[3:])


@pytest.mark.parametrize("stage", ["mars", "ar-sft"])
def test_an_empty_micro_batch_is_one_row_that_scores_nothing(stage):
    """A streamed micro-batch whose rows were all skipped collates to one padding row with no target: its
    forward and backward run (so a DDP worker joins the all-reduce) and give every parameter a zero
    gradient."""
    model = build_tiny("llama", dtype=torch.float32)
    batch = collate([]) if stage == "mars" else collate_ar([], pad_id=PAD_ID)
    assert batch.input_ids.tolist() == [[PAD_ID]] and not batch.scored.any()
    logits = ScoredLM(model)(**batch.model_inputs())
    loss = mars_loss(logits, batch).total if stage == "mars" else ar_loss(logits, batch)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
