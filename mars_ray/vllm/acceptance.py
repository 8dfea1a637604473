"""What one vLLM forward gives MARS, read before vLLM samples from it.

A drafting request feeds `[last token | carried proposals | MASK x (W-1)]`. vLLM's rejection sampler checks
the carried proposals against the target's own choices and emits the target's token at the first mismatch,
at the latest at the first mask: that is verified MARS, exact greedy text. What vLLM does not do, done here
on the logits before it samples:
- the mask token is never a choice (its logit is -inf in every row), so it is neither output nor accepted;
- the mask rows' predictions (argmax, and fp32 confidence at the slot's calibrated temperature) are read:
  they are the next forward's proposals, valid if every carried proposal of this forward holds;
- relaxed requests (lossy, greedy) have their carried proposals accepted as the target's choice: each was
  kept because its confidence reached tau, the paper's acceptance rule, one forward later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mars_ray.core.decode_state import accept_length
from mars_ray.vllm.settings import DraftSettings


@dataclass(frozen=True)
class Proposals:
    """A request's mask-row predictions from one forward, and how many carried proposals it fed."""

    tokens: list[int]
    confidence: list[float]
    carried: int


@dataclass(frozen=True)
class Vocabulary:
    """The ids a mask slot may propose: below `limit` (padded rows are not text), never `mask_id`."""

    mask_id: int
    limit: int
    slot_temperatures: tuple[float, ...] = ()


def read_forward(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    settings: Sequence[DraftSettings],
    vocabulary: Vocabulary,
) -> list[Proposals | None]:
    """Read one forward's logits [sum(len(d) + 1), V] for the batch's requests (in order), in place as the
    module says; return each request's proposals, or None where it fed no mask."""
    logits[:, vocabulary.mask_id] = float("-inf")
    found: list[Proposals | None] = []
    row = 0
    for fed, setting in zip(drafts, settings, strict=True):
        carried = next((i for i, token in enumerate(fed) if token == vocabulary.mask_id), len(fed))
        if setting.relaxed and carried:
            rows = torch.arange(row, row + carried, device=logits.device)
            proposed = torch.tensor(list(fed[:carried]), device=logits.device)
            top = logits[rows].amax(dim=-1)
            logits[rows, proposed] = top + 1.0
        masks = len(fed) - carried
        if masks:
            # Row `row + carried` predicts the token after the last carried one (slot 0); the rows after
            # it sit at the masks and predict slots 1..masks.
            start = row + carried + 1
            temperatures = vocabulary.slot_temperatures if setting.calibrated else ()
            found.append(_proposals(logits[start : start + masks], carried, vocabulary.limit, temperatures))
        else:
            found.append(None)
        row += len(fed) + 1
    return found


def _proposals(
    mask_logits: torch.Tensor, carried: int, limit: int, slot_temperatures: tuple[float, ...]
) -> Proposals:
    """Mask slot j's token (argmax below `limit`) and its fp32 confidence at slot j's temperature."""
    scores = mask_logits.float().clone()  # fp32 logits come back as the same tensor: keep vLLM's intact
    scores[:, limit:] = float("-inf")
    tokens = scores.argmax(dim=-1)
    temperatures = slot_temperatures[1 : 1 + len(scores)]
    if temperatures:
        scale = torch.ones(len(scores), device=scores.device)
        scale[: len(temperatures)] = torch.tensor(temperatures, device=scores.device)
        scores = scores / scale[:, None]
    confidence = torch.softmax(scores, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return Proposals(tokens.tolist(), confidence.tolist(), carried)


def keep_confident(proposals: Proposals, tau: float, room: int) -> list[int]:
    """The leading proposals whose confidence reaches tau, at most `room`: the native engine's window rule,
    whose slot 0 (here the token vLLM just emitted) is always taken."""
    return proposals.tokens[: accept_length([1.0, *proposals.confidence], tau, room + 1) - 1]
