"""One sequence being decoded (`DecodeState`), what it yields (`DecodeResult`) and the acceptance rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.errors import ConfigError
from mars_ray.core.sampling import text_log_probs


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability at the slot that produced it, and the likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids, including the stop token that ended them
    forward_passes: int  # every forward this sequence took part in (prefill and extend passes included)
    accepted: list[int]  # tokens accepted at each forward that produced tokens
    finish_reason: str  # "stop" or "length"
    drafted: list[int] = field(default_factory=list)  # verified decoding: proposals checked per forward
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when the config asks

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(self.forward_passes, 1)


def accept_length(confidence: Sequence[float], tau: float, limit: int) -> int:
    """How many leading slots to accept: slot 0 always, then while confidence >= tau, at most `limit`.

    tau >= 1 is one token: an fp32 (let alone bf16) probability can round to exactly 1.0.
    """
    if tau >= 1.0:
        return 1
    n = 1
    while n < min(limit, len(confidence)) and confidence[n] >= tau:
        n += 1
    return n


@dataclass
class DecodeState:
    """One sequence being decoded: its prompt, config, output so far and counters.

    `drafts` (verified decoding) are proposals carried into the next forward as real tokens, to be checked
    there; `drafted[i]` is how many the forward that produced `accepted[i]` checked.
    """

    prompt: list[int]
    config: DecodeConfig
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    forward_passes: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt", "must hold at least one token")
        if self.config.temperature > 0:
            self.generator = torch.Generator()
            if self.config.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.config.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def room(self) -> int:
        """Tokens it may still produce."""
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def window(self) -> int:
        """Slots its next forward reads: its config's window, capped by the tokens it may still produce
        after its drafts. A mask past them could only propose a token past the budget, and would take a
        position past the context (at its end, past the model's `max_position_embeddings`)."""
        return min(self.config.window, self.room - len(self.drafts))  # >= 1: drafts < room, always

    def reconfigure(self, config: DecodeConfig) -> None:
        """Decode with `config` from the next forward on. A row that no longer verifies drops its drafts:
        they are not cached yet, and a lossy forward would feed (and cache) them without outputting them."""
        self.config = config
        if not config.verify:
            self.drafts = []

    def take(self, proposed: Sequence[int], confidence: Sequence[float]) -> list[int]:
        """Accept the prefix of the proposed window that tau allows; return the committed tokens."""
        cfg = self.config
        limit = min(len(proposed), cfg.max_accept or len(proposed), self.room)
        return self.commit(proposed[: accept_length(confidence, cfg.tau, limit)], drafted=0)

    def commit(self, new: Sequence[int], drafted: int) -> list[int]:
        """Append tokens up to the budget and the first stop token; return what was appended."""
        new = list(new[: self.room])
        for i, token in enumerate(new):
            if token in self.config.stop_token_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.tokens += new
        self.accepted.append(len(new))
        self.drafted.append(drafted)
        if not self.finished and not self.room:
            self.finish_reason = "length"
        return new

    def record_logprobs(self, new: Sequence[int], logits: torch.Tensor, mask_id: int | None) -> None:
        """Log-probabilities of the tokens just committed, `logits` [len(new), V] the slots they came from
        (normalised without the mask token, see `text_log_probs`)."""
        k = self.config.logprobs
        if k is None or not new:
            return
        log_probs = text_log_probs(logits[: len(new)], mask_id)
        index = torch.tensor(list(new), device=log_probs.device)[:, None]
        chosen = log_probs.gather(-1, index)[:, 0].tolist()
        values, ids = (t.tolist() for t in log_probs.topk(k, dim=-1))
        for token, logprob, top_ids, top_values in zip(new, chosen, ids, values, strict=True):
            self.logprobs.append(TokenLogprob(token, logprob, tuple(zip(top_ids, top_values, strict=True))))

    def result(self) -> DecodeResult:
        return DecodeResult(
            list(self.tokens),
            self.forward_passes,
            list(self.accepted),
            self.finish_reason or "",
            list(self.drafted),
            list(self.logprobs),
        )
