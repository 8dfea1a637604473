"""What a request may ask of one served model, checked before any forward: one home for both engines.

A request's fields become the `DecodeConfig` it decodes with (the native decoder runs it; vLLM gets it as
`SamplingParams` and the MARS proposer's fields), or a `ConfigError` naming the field at fault as the engine
knows it (the ingress answers it with a 400 under the request's name of that field). The replica's operating
point (tau, verify, window) fills what a request leaves unset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mars_ray.core.decode_config import TRAINED_BLOCK_SIZE, DecodeConfig, request_point
from mars_ray.core.errors import ConfigError
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.types import SamplingParams

MAX_UNTRAINED_BLOCK_SIZE = 16  # the widest window a model that records no trained B may be asked for


def max_context_of(config: ModelConfig, model_config) -> int:
    """The context a request may fill: the model's own limit, or a smaller one the config sets. A larger
    one is refused: positions past `max_position_embeddings` are not what the model was trained on (or,
    for learned position tables, an index error in the middle of a batch)."""
    limit = int(model_config.max_position_embeddings)
    if config.max_context is not None and config.max_context > limit:
        raise ConfigError(
            "max_context", f"{config.max_context} exceeds this model's max_position_embeddings of {limit}"
        )
    return config.max_context or limit


@dataclasses.dataclass(frozen=True)
class RequestRules:
    """The limits of one model as served: its vocabulary and context, the widest window, the replica's
    default completion budget, and the decode config every request starts from (stops, calibration)."""

    vocab_size: int
    max_context: int
    max_block_size: int
    max_tokens: int
    decode: DecodeConfig

    @classmethod
    def of(cls, config: ModelConfig, model_config, decode: DecodeConfig, vocab_size: int) -> RequestRules:
        """The rules of a served model: `config` the replica's, `model_config` the checkpoint's."""
        trained = getattr(model_config, TRAINED_BLOCK_SIZE, None)
        max_block_size = config.max_block_size or trained or MAX_UNTRAINED_BLOCK_SIZE
        DecodeConfig.check_block_size(decode.block_size, "block_size", max_block_size)
        max_context = max_context_of(config, model_config)
        return cls(vocab_size, max_context, max_block_size, config.max_tokens, decode)

    def check_block_size(self, block_size: int) -> None:
        """A window this model may be asked for: the replica's, or a request's."""
        DecodeConfig.check_block_size(block_size, "block_size", self.max_block_size)

    def check_token_ids(self, tokens: Sequence[int], field: str) -> None:
        """Ids of tokens the model has (a 400 naming `field` otherwise): any other id would index past
        its embedding (on CUDA, a device-side assert that breaks every later forward)."""
        if not all(0 <= token < self.vocab_size for token in tokens):
            raise ConfigError(field, f"token ids must be in [0, {self.vocab_size})")

    def check_prompt(self, prompt: Sequence[int], field: str) -> int:
        """A prompt any forward may take: not empty, known ids, within the context. Returns the room left
        for the completion. Checked before anything reads the prompt (a request, echo)."""
        if not prompt:
            raise ConfigError(field, "the prompt is empty")
        self.check_token_ids(prompt, field)
        room = self.max_context - len(prompt)
        if room < 1:
            raise ConfigError(
                field, f"the prompt has {len(prompt)} tokens; this model's context is {self.max_context}"
            )
        return room

    def decode_config(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        prompt_field: str,
        tau: float,
        verify: bool,
        block_size: int,
    ) -> DecodeConfig:
        """The request's decode config at the replica's operating point (`tau`, `verify`, `block_size`)."""
        room = self.check_prompt(prompt, prompt_field)
        max_tokens = params.max_tokens if params.max_tokens is not None else min(self.max_tokens, room)
        if max_tokens > room:
            raise ConfigError(
                "max_tokens",
                f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together more than "
                f"this model's context of {self.max_context}",
            )
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        stops = () if params.ignore_eos else self.decode.stop_token_ids
        tau, verify, block_size = point_for(params, tau, verify, block_size)
        self.check_block_size(block_size)
        return dataclasses.replace(
            self.decode,
            tau=tau,
            block_size=block_size,
            verify=verify,
            max_new_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            logprobs=params.logprobs,
            stop_token_ids=tuple(dict.fromkeys(stops + params.stop_token_ids)),
            min_tokens=min(params.min_tokens, max_tokens),
        )


def point_for(params: SamplingParams, tau: float, verify: bool, block_size: int) -> tuple[float, bool, int]:
    """The tau, mode and window a request decodes with at the replica's operating point (`request_point`)."""
    own = (params.tau, params.verify, params.block_size)
    return request_point(own, params.temperature == 0, (tau, verify, block_size))
