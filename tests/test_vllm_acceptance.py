"""What one vLLM forward gives MARS (`mars_ray.vllm.acceptance.read_forward`), read from a batch of rows as
vLLM lays them out: pure torch, no vLLM needed. Each request is checked against its own rows alone."""

import torch

from mars_ray.vllm.acceptance import Vocabulary, keep_confident, read_forward
from mars_ray.vllm.settings import DraftSettings

MASK = 7
VOCABULARY = Vocabulary(mask_id=MASK, limit=30, slot_temperatures=(1.0, 2.0, 0.5))
VERIFIED = DraftSettings(tau=0.5, verify=True, window=4, greedy=True)
RELAXED = DraftSettings(tau=0.5, verify=False, window=4, greedy=True)
RAW = DraftSettings(tau=0.5, verify=True, window=4, greedy=True, calibrated=False)
AR = DraftSettings(tau=1.0, verify=True, window=1, greedy=True)
MASK_SLOT_TEMPERATURES = (2.0, 0.5, 1.0)  # slots 1-3: the vocabulary's slots 1 and 2, then none (1.0)


def _slot_confidence(row: torch.Tensor, temperature: float) -> tuple[int, float]:
    scores = row.float().clone()
    scores[MASK] = float("-inf")
    scores[VOCABULARY.limit :] = float("-inf")
    token = int(scores.argmax())
    return token, float(torch.softmax(scores / temperature, dim=-1)[token])


def test_each_request_reads_its_own_mask_rows_at_its_slot_temperatures():
    """Four requests in one forward: two carried proposals and three masks (calibrated), an AR row, three
    masks with raw confidences, and a relaxed request whose carried proposal becomes the target's choice.
    Rows past `limit` (padding of the vocabulary) and the mask token are never proposed."""
    torch.manual_seed(0)
    drafts = [[11, 12, MASK, MASK, MASK], [], [MASK, MASK, MASK], [13, MASK, MASK, MASK]]
    settings = [VERIFIED, AR, RAW, RELAXED]
    rows = sum(len(fed) + 1 for fed in drafts)
    logits = torch.randn(rows, 32)
    logits[:, MASK] += 100.0  # the mask would win every row
    logits[:, VOCABULARY.limit :] += 50.0  # so would the padding
    original = logits.clone()

    found = read_forward(logits, drafts, settings, VOCABULARY)

    assert torch.all(logits[:, MASK] == float("-inf"))
    first, ar, raw, relaxed = found
    assert ar is None
    # Request 0: rows 0-5; row 2 predicts slot 0 (after the carried two), rows 3-5 the masks' slots 1-3.
    assert first.carried == 2
    expected = [_slot_confidence(original[3 + j], t) for j, t in enumerate(MASK_SLOT_TEMPERATURES)]
    assert first.tokens == [token for token, _ in expected]
    assert all(abs(a - c) < 1e-6 for a, (_, c) in zip(first.confidence, expected, strict=True))
    # Request 2 starts at row 7 (6 rows, then the AR row): its slot rows are 8-10, read at temperature 1.
    assert raw.carried == 0
    expected = [_slot_confidence(original[8 + j], 1.0) for j in range(3)]
    assert raw.tokens == [token for token, _ in expected]
    assert all(abs(a - c) < 1e-6 for a, (_, c) in zip(raw.confidence, expected, strict=True))
    # Request 3 starts at row 11: its carried 13 is now the target's choice in its row, nothing else moved.
    assert relaxed.carried == 1
    assert int(logits[11].argmax()) == 13
    expected = [_slot_confidence(original[13 + j], t) for j, t in enumerate(MASK_SLOT_TEMPERATURES)]
    assert relaxed.tokens == [token for token, _ in expected]
    untouched = [r for r in range(rows) if r != 11]
    kept = original[untouched].clone()
    kept[:, MASK] = float("-inf")
    assert torch.equal(logits[untouched], kept)


def test_a_forward_without_masks_reads_nothing_and_the_window_rule_keeps_confident_leads():
    logits = torch.randn(3, 32)
    assert read_forward(logits, [[], []], [AR, AR], VOCABULARY) == [None, None]
    drafts = [[MASK, MASK, MASK]]
    logits = torch.full((4, 32), -10.0)
    for row, token in zip((1, 2, 3), (20, 21, 22), strict=True):
        logits[row, token] = 10.0  # confident slots 1 and 2 ...
    logits[3, 23] = 10.0  # ... slot 3 split between two tokens
    read = read_forward(logits, drafts, [RAW], VOCABULARY)[0]
    assert read.tokens[:2] == [20, 21]
    assert keep_confident(read, 0.9, 3) == [20, 21]
    assert keep_confident(read, 0.9, 1) == [20]
    assert keep_confident(read, 0.4, 3) == read.tokens
