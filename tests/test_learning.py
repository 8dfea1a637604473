"""The objective teaches multi-token prediction: a tiny model trained with the MARS loss accepts several
tokens per forward at tau < 1 on held-out prompts, and still decodes exactly like greedy AR at tau = 1."""

from __future__ import annotations

import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.objective import IGNORE, Example, ScoredLM, collate_mars, mars_loss

SEP = 3
WORDS = 40  # token ids 4..43 are "words"


def copy_task(count: int, seed: int) -> list[Example]:
    """Prompt: 8 random words then SEP; response: the same 8 words then EOS. Deterministic, learnable."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        words = (torch.randint(0, WORDS, (8,), generator=g) + 4).tolist()
        prompt = words + [SEP]
        response = words + [EOS_ID]
        examples.append(Example(prompt + response, [IGNORE] * len(prompt) + response))
    return examples


def test_mars_loss_teaches_several_tokens_per_forward():
    torch.manual_seed(0)
    model = build_tiny("llama", sharpness=1.0, dtype=torch.float32, num_hidden_layers=2, hidden_size=64)
    model.train()
    train = copy_task(4000, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(300):
        batch = collate_mars(train[(step * 16) % 4000 : (step * 16) % 4000 + 16], 4, MASK_ID, PAD_ID, EOS_ID)
        loss = mars_loss(ScoredLM(model)(**batch.model_inputs()), batch)
        optimizer.zero_grad()
        loss.total.backward()
        optimizer.step()
    model.eval()

    held_out = [e.input_ids[:9] for e in copy_task(24, seed=1)]
    fast = decode_cached(
        model,
        held_out,
        MASK_ID,
        DecodeConfig(tau=0.9, block_size=4, max_new_tokens=12, stop_token_ids=(EOS_ID,)),
    )
    tokens = sum(len(r.tokens) for r in fast)
    forwards = sum(r.forward_passes for r in fast)
    print(f"tokens per forward at tau=0.9: {tokens / forwards:.2f}")
    assert tokens / forwards > 1.3, (tokens / forwards, loss.noisy.item())
    correct = sum(r.tokens == p[:8] + [EOS_ID] for r, p in zip(fast, held_out, strict=True))
    print(f"correct: {correct}/24")
    assert correct >= 20  # still copies correctly while skipping forwards

    exact = decode_cached(
        model, held_out, MASK_ID, DecodeConfig(tau=1.0, max_new_tokens=12, stop_token_ids=(EOS_ID,))
    )
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor(held_out),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
    for row, result in zip(greedy[:, 9:].tolist(), exact, strict=True):
        assert result.tokens == (row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)

    # verified: exactly the greedy tokens, still several per forward
    config = DecodeConfig(tau=0.9, block_size=4, max_new_tokens=12, stop_token_ids=(EOS_ID,), verify=True)
    verified = decode_cached(model, held_out, MASK_ID, config)
    assert [r.tokens for r in verified] == [r.tokens for r in exact]
    tokens = sum(len(r.tokens) for r in verified)
    forwards = sum(r.forward_passes for r in verified)
    print(f"tokens per forward, verified at tau=0.9: {tokens / forwards:.2f}")
    assert tokens / forwards > 1.3
