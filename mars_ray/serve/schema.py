"""The OpenAI wire format: request bodies (validated, 400 on a bad field) and response objects.

Only what the engine honours is accepted with meaning; other OpenAI fields are ignored. `n` choices are
rows of the same batch (the prompt is prefilled per row); `echo` puts the prompt before the completion.
`logprobs` / `top_logprobs` (chat) and `logprobs: k` (completions) come back in OpenAI's shapes (see
`DecodeConfig` for what a MARS token's log-probability is). MARS adds `tau`, `block_size` and `verify` (the
`openai` client sends them through `extra_body`); `usage` adds `forward_passes`, the `tau` and the `mode`
the request ran at.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mars_ray.serve.config import BlockSizeOrNone, TauOrNone
from mars_ray.serve.types import Chunk, Logprob, SamplingParams


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template takes it: text parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, description="choices: rows of the same batch, each decoded as if alone")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=16, description="more stop tokens")
    ignore_eos: bool = Field(False, description="the model's stop tokens do not end the reply")
    min_tokens: int = Field(0, ge=0, description="no stop token before this many tokens")
    include_stop_str_in_output: bool = Field(False, description="the text ends after a stop string")
    tau: TauOrNone = Field(None, description="MARS confidence threshold; 1 = exact greedy AR")
    block_size: BlockSizeOrNone = Field(None, description="MARS window: tokens proposed per forward")
    verify: bool | None = Field(
        None, description="MARS verified decoding: exactly greedy at any tau (tau picks the proposals)"
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def sampling(self, max_tokens: int | None, logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            logprobs=logprobs,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            tau=self.tau,
            block_size=self.block_size,
            verify=self.verify,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=tuple(stop),
        )

    def choice_params(self) -> list[SamplingParams]:
        """What each of the `n` choices asks for: the same, but a seeded sampler gets seed + i for choice
        i (distinct samples, each reproducible)."""
        params = self.params()
        if params.seed is None or params.temperature <= 0:
            return [params] * self.n
        return [dataclasses.replace(params, seed=(params.seed + i) % (1 << 63)) for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="each output token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="and this many likeliest alternatives")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, logprobs)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(
        None, ge=0, le=5, description="each output token's log-probability and this many alternatives"
    )
    echo: bool = Field(False, description="the reply starts with the prompt (and its log-probabilities)")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            return prompt[0]
        return prompt

    def params(self) -> SamplingParams:
        return dataclasses.replace(self.sampling(self.max_tokens, self.logprobs), echo=self.echo)


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if messages is not None and not messages:
            raise ValueError("messages must not be empty")
        return messages

    def text_or_messages(self) -> str | list[dict]:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages")
        return self.prompt if self.messages is None else [m.as_template_input() for m in self.messages]


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[int]


FIELD_NAMES = frozenset(
    name
    for model in (
        ContentPart,
        ChatMessage,
        StreamOptions,
        ChatCompletionRequest,
        CompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
    )
    for name in model.model_fields
)


def error_param(loc: tuple) -> str | None:
    """The request field a validation error is about, as a dotted path (`messages.0.content`): list
    indices and field names kept, the union branch names pydantic adds (`str`, `list[int]`) dropped."""
    parts = [str(part) for part in loc if isinstance(part, int) or part in FIELD_NAMES]
    return ".".join(parts) or None


# Where an engine's name of a field (`DecodeConfig`'s) is not the request's: renamed here, once, for the
# `param` of the 400.
REQUEST_NAMES = {"max_new_tokens": "max_tokens"}


def request_field(field: str) -> str:
    """The request's name of a field that an engine's `ConfigError` names."""
    return REQUEST_NAMES.get(field, field)


def error_body(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(lasts: list[Chunk]) -> dict:
    """One request's usage over its choices: the prompt counted once, completions and forwards summed."""
    completion = sum(c.completion_tokens for c in lasts)
    return {
        "prompt_tokens": lasts[0].prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": lasts[0].prompt_tokens + completion,
        "forward_passes": sum(c.forward_passes for c in lasts),
        "tau": lasts[0].tau,
        "mode": lasts[0].mode,
    }


class ResponseBuilder:
    """The response objects of one request, chat or text completion, whole or streamed."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.text_offsets: dict[
            int, int
        ] = {}  # completions' logprobs, per choice: text before the next token
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, object_type: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def whole(self, lasts: list[Chunk]) -> dict:
        """The response of a request that did not stream: one choice per merged chunk, in order."""
        choices = []
        for index, last in enumerate(lasts):
            logprobs = self._logprobs(last.logprobs, index)
            if self.chat:
                message = {"role": "assistant", "content": last.text}
                choices.append({"index": index, "message": message, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": last.text, "logprobs": logprobs})
            choices[-1]["finish_reason"] = last.finish_reason
        object_type = "chat.completion" if self.chat else "text_completion"
        return self._envelope(object_type, choices, usage=usage(lasts))

    def piece(self, chunk: Chunk, first: bool, index: int = 0) -> dict:
        logprobs = self._logprobs(chunk.logprobs, index)
        if self.chat:
            delta = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
            if chunk.finish_reason and not chunk.text:
                delta = {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": chunk.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": logprobs,
            "finish_reason": chunk.finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def _logprobs(self, logprobs: list[Logprob] | None, index: int) -> dict | None:
        """OpenAI's shapes: chat `{content: [{token, logprob, bytes, top_logprobs}]}`; completions
        `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets from this piece's start)."""
        if logprobs is None:
            return None
        if self.chat:

            def entry(token: str, logprob: float) -> dict:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            content = [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
            return {"content": content}
        offsets, offset = [], self.text_offsets.get(index, 0)
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        self.text_offsets[index] = offset
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp.logprob is None else dict(lp.top) for lp in logprobs],
            "text_offset": offsets,
        }

    def usage_piece(self, lasts: list[Chunk]) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, only usage."""
        object_type = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_type, [], usage=usage(lasts))
