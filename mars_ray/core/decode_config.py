"""How one sequence is decoded: `DecodeConfig`, the one home of the tau and window ranges and the mode."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_ray.core.errors import ConfigError

TRAINED_BLOCK_SIZE = "mars_block_size"  # the model config key where training records its B
SLOT_TEMPERATURES = "mars_slot_temperatures"  # where calibration records a temperature per window slot
DEFAULT_BLOCK_SIZE = 4  # the paper's B, for a model that does not record its own
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows

Mode = Literal["ar", "mars", "verify"]


@dataclass(frozen=True)
class DecodeConfig:
    """How one sequence is decoded. `block_size` is the window W of slots per forward (the training B).

    `tau` lies in (0, 1]: a slot is accepted while its confidence is >= tau, and tau = 1 accepts exactly one
    token, which is greedy autoregressive decoding of the same weights (a larger tau would mean nothing
    more). Every tau a user gives, anywhere, is checked by `check_tau`; every window by `check_block_size`.

    `slot_temperatures[j]` divides slot j's logits before its confidence is read (greedy tokens do not
    change): calibration fits them so that a confidence of c means the token agrees with greedy decoding
    about c of the time. Empty: raw probabilities. Build one for a model with `for_model`.

    `verify`: lossless. The masks' proposals are not output but carried, as real tokens, into the next
    forward, which checks them against its own greedy predictions: the output is exactly greedy decoding
    at any tau, and tau only decides which proposals are worth carrying (tau = 1 carries none: plain AR).
    Greedy only: the speculative-sampling rule for temperature > 0 is not built, so it is refused.

    `logprobs` (k): every committed token records its log-probability and the k likeliest alternatives,
    read from the fp32 logits of the slot that produced it, before any temperature. A token from slot 0
    and a verified token are the model's own next-token (AR) log-probabilities; a token accepted from a
    mask slot carries that mask's prediction, the probability tau was compared with (uncalibrated).
    """

    tau: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE
    max_new_tokens: int = 256
    max_accept: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    slot_temperatures: tuple[float, ...] = ()
    verify: bool = False
    vocab_limit: int | None = None  # ids at or past it (padded embedding rows) are never proposed
    logprobs: int | None = None  # record each token's log-probability and this many alternatives
    min_tokens: int = 0  # stop tokens are never proposed before this many tokens (as min_new_tokens)

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        block_size: int | None = None,
        allow_wider: bool = False,
        calibrated: bool = True,
        **fields,
    ) -> DecodeConfig:
        """The config every caller builds for `model`: stops where `generate` would (EOS ids of the
        tokenizer and the generation config), the window defaults to the B the checkpoint was trained
        with, and the calibrated temperatures it carries are applied (unless `calibrated=False`).

        A window wider than the trained B is refused unless `allow_wider`: its extra slots were never
        trained and their confidences mean nothing.
        """
        trained = getattr(model.config, TRAINED_BLOCK_SIZE, None)
        window = block_size or trained or DEFAULT_BLOCK_SIZE
        if trained and window > trained and not allow_wider:
            raise ConfigError(
                "block_size",
                f"{window} is wider than the B = {trained} this checkpoint was trained with"
                " (allow a wider window explicitly to try it)",
            )
        temperatures = getattr(model.config, SLOT_TEMPERATURES, None) if calibrated else None
        return cls(
            block_size=window,
            stop_token_ids=stop_token_ids(model, tokenizer),
            slot_temperatures=tuple(temperatures or ()),
            vocab_limit=len(tokenizer),
            **fields,
        )

    @staticmethod
    def check_tau(tau: float, field: str = "tau") -> float:
        """`tau` if it lies in (0, 1]; a `ConfigError` naming `field` otherwise (NaN and inf included)."""
        numeric = isinstance(tau, int | float) and not isinstance(tau, bool)
        if not (numeric and 0 < tau <= 1):
            raise ConfigError(field, f"must be in (0, 1], got {tau!r}")
        return tau

    @staticmethod
    def check_block_size(block_size: int, field: str = "block_size", most: int | None = None) -> int:
        """`block_size` if it is a whole window of at least 1 slot (and at most `most`); a `ConfigError`
        naming `field` otherwise."""
        whole = isinstance(block_size, int) and not isinstance(block_size, bool)
        if not (whole and 1 <= block_size <= (most or block_size)):
            bound = "" if most is None else f" and <= {most}"
            raise ConfigError(field, f"must be a whole number of slots, >= 1{bound}, got {block_size!r}")
        return block_size

    def __post_init__(self) -> None:
        self.check_tau(self.tau)
        self.check_block_size(self.block_size)
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "max_accept": self.max_accept is None or self.max_accept >= 1,
            "temperature": self.temperature >= 0 and math.isfinite(self.temperature),
            "top_p": 0 < self.top_p <= 1,
            "slot_temperatures": all(t > 0 and math.isfinite(t) for t in self.slot_temperatures),
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "min_tokens": 0 <= self.min_tokens <= self.max_new_tokens,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(name, f"invalid value {getattr(self, name)!r}")
        if self.verify and self.temperature > 0:
            raise ConfigError(
                "verify", "verified decoding is greedy only: it cannot be asked with temperature > 0"
            )

    @property
    def window(self) -> int:
        """Slots this sequence may accept per forward: 1 at tau = 1 (no masks needed at all)."""
        if self.tau >= 1.0:
            return 1
        return min(self.block_size, self.max_accept or self.block_size)

    @property
    def mode(self) -> Mode:
        """What usage reports: "ar" at one slot per forward (whether or not it verifies), else "verify" or
        "mars" (lossy)."""
        return self.mode_of(self.window, self.verify)

    @staticmethod
    def mode_of(window: int, verify: bool) -> Mode:
        """The mode label of a sequence reading `window` slots per forward (for those that hold no config)."""
        if window == 1:
            return "ar"
        return "verify" if verify else "mars"


def request_point(
    own: tuple[float | None, bool | None, int | None], greedy: bool, point: tuple[float, bool, int]
) -> tuple[float, bool, int]:
    """The tau, mode and window a request decodes with: its `own` choices (None: unset), else the operating
    `point` (tau, verify, window) of the engine serving it. The point's verified mode is lossless, and its
    tau only picks the proposals worth checking: a request that mode cannot verify (sampled, since
    verification is greedy only, or one that turns `verify` off) decodes exactly there, at tau 1, never
    lossy at the point's tau."""
    own_tau, own_verify, own_window = own
    tau, verify, window = point
    window = window if own_window is None else own_window
    request_verify = own_verify if own_verify is not None else verify and greedy
    if own_tau is not None:
        return own_tau, request_verify, window
    return (1.0 if verify and not request_verify else tau), request_verify, window


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the generation config: where `generate` would stop."""
    ids = {tokenizer.eos_token_id}
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos])
    return tuple(sorted(i for i in ids if i is not None))
