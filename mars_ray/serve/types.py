"""What a request asks of a replica's engine and what comes back, the same for either engine: the fields
(`SamplingParams`) and the streamed pieces (`Chunk`, with `Logprob`s). A request the engine cannot serve as
asked raises `mars_ray.core.errors.ConfigError` naming the field at fault (HTTP 400)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. `tau` / `block_size` / `verify` None: follow the replica's operating point."""

    max_tokens: int | None = None
    tau: float | None = None
    block_size: int | None = None
    verify: bool | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # each token's log-probability and this many alternatives
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the reply (as the model's EOS does)
    ignore_eos: bool = False  # the model's own stop tokens do not end it (max_tokens does)
    min_tokens: int = 0  # no stop token before this many tokens
    include_stop_str_in_output: bool = False  # a stop string ends the text after itself
    echo: bool = False  # completions: the reply starts with the prompt (and its log-probabilities)


@dataclass(frozen=True)
class Logprob:
    """A generated token's text and log-probability, and the likeliest alternatives (see `DecodeConfig`)."""

    token: str
    logprob: float | None  # None: echo's first prompt token, which nothing predicts
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class Chunk:
    """One streamed piece of a request: new text, and the request's counters so far."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    forward_passes: int
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    token_ids: list[int] = dataclasses.field(default_factory=list)  # decoded since the last chunk
    tau: float = 1.0  # the operating point the request decoded at, as of this chunk
    mode: str = "ar"  # "ar" (one token per forward), "mars" (lossy, tau < 1) or "verify" (lossless)
    logprobs: list[Logprob] | None = None  # of this chunk's completion tokens (and echo's prompt), if asked

    def then(self, later: Chunk) -> Chunk:
        """This chunk followed by a later one, as one chunk."""
        logprobs = None if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return dataclasses.replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
        )
