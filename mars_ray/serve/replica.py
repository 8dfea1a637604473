"""One replica of one served model (`EngineDeployment`): the engine behind its protocol (`ServingEngine`,
either engine, chosen by the app builder), the tau controller that moves its operating point, the status it
posts, and the calls the ingress makes: a chat or a completion streamed or merged, tokenize, detokenize.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator

import jinja2
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import PreTrainedTokenizerBase

from mars_ray.core.errors import ConfigError
from mars_ray.data import chat_ids, chat_prompt_ids
from mars_ray.serve.config import ModelConfig, TauObjective
from mars_ray.serve.controller import OperatingPoint, TauController
from mars_ray.serve.metrics import ServeMetrics
from mars_ray.serve.protocol import ServingEngine
from mars_ray.serve.stats import EngineStats
from mars_ray.serve.types import Chunk, SamplingParams

logger = logging.getLogger(__name__)


@serve.deployment
class EngineDeployment:
    """One replica of one model: loads and warms up in its constructor, so ready means ready.

    Its user_config holds the tau controller's knobs (`TauObjective`): `reconfigure` applies them in
    place, so `serve deploy` with changed knobs reaches the running process. Each tick the controller
    moves the engine's operating tau, the replica posts its status, and `record_autoscaling_stats`
    hands the controller's state to the replica policy (`policy.tau_first_policy`).
    """

    async def __init__(
        self, config: ModelConfig, board: DeploymentHandle, engine: type[ServingEngine]
    ) -> None:
        self.config, self.board = config, board
        self.controller: TauController | None = None
        self.replica = serve.get_replica_context().replica_id.unique_id
        metrics = ServeMetrics(config.served_name)
        self.engine: ServingEngine = await asyncio.to_thread(engine.load, config, metrics)
        await self.engine.warm_up()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def reconfigure(self, user_config: dict) -> None:
        objective = TauObjective.model_validate(user_config)
        if self.controller is None:
            self.controller = TauController(objective, time.monotonic())
        else:
            self.controller.reconfigure(objective)
        self._operate(self.controller.point)

    def _operate(self, point: OperatingPoint) -> None:
        self.engine.tau, self.engine.verify = point.tau, point.verify

    async def _tick_forever(self) -> None:
        while True:
            interval = self.controller.objective.interval_s if self.controller else 1.0
            await asyncio.sleep(interval)
            try:
                stats = self.engine.stats()
                self.engine.refresh_gauges()
                if self.controller:
                    self._operate(self.controller.update(stats, time.monotonic()))
                await self.board.post.remote(self.replica, self._status(stats))
            except Exception:  # a missed tick must not stop the next one
                logger.exception("controller tick failed")

    def _status(self, stats: EngineStats) -> dict:
        status = {"model": self.config.served_name, "pid": os.getpid(), "stats": dataclasses.asdict(stats)}
        if self.controller:
            status["controller"] = dataclasses.asdict(self.controller.state)
            status["objective"] = self.controller.objective.model_dump()
        return status

    async def record_autoscaling_stats(self) -> dict[str, float]:
        if self.controller is None:
            return {}
        state = self.controller.state
        flags = ("verify", "over_objective", "low_load", "at_floor", "at_ceiling")
        return {"tau": state.tau, "goodput": state.goodput, **{f: float(getattr(state, f)) for f in flags}}

    async def chat(self, messages: list[dict], params: SamplingParams) -> AsyncIterator[Chunk]:
        prompt = _templated(self.engine.tokenizer, messages, add_generation_prompt=True)
        async for chunk in self.engine.generate(prompt, params, "messages"):
            yield chunk

    async def complete(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        ids = self.engine.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        async with contextlib.aclosing(self.engine.generate(ids, params, "prompt")) as chunks:
            # The request's first chunk: it is checked (a 400 naming the field) and queued, before echo
            # decodes the prompt or runs a forward over it.
            first = await anext(chunks)
            if params.echo:  # the prompt, first, in the request's first chunk
                text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = await self.engine.prompt_logprobs(ids, params.logprobs)
                first = Chunk(text, len(ids), 0, 0, token_ids=list(ids), logprobs=logprobs).then(first)
            yield first
            async for chunk in chunks:
                yield chunk

    async def chat_whole(self, messages: list[dict], params: SamplingParams) -> Chunk:
        """A request that does not stream: its chunks merged here, so one message crosses to the ingress
        (a client that leaves cancels this call, which cancels the request and frees its row)."""
        return await _merged(self.chat(messages, params))

    async def complete_whole(self, prompt: str | list[int], params: SamplingParams) -> Chunk:
        return await _merged(self.complete(prompt, params))

    async def tokenize(self, source: str | list[dict], add_generation_prompt: bool) -> list[int]:
        """A prompt's token ids, or a chat's through the model's template (vLLM's /tokenize)."""
        tokenizer = self.engine.tokenizer
        if isinstance(source, str):
            return tokenizer(source)["input_ids"]
        return _templated(tokenizer, source, add_generation_prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        self.engine.check_token_ids(tokens, "tokens")
        return self.engine.tokenizer.decode(tokens)

    async def max_model_len(self) -> int:
        return self.engine.max_context

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def ready(self) -> bool:
        return True


def _templated(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool
) -> list[int]:
    """A chat's token ids through the model's template; messages the template refuses are a 400."""
    try:
        return (chat_prompt_ids if add_generation_prompt else chat_ids)(tokenizer, messages)
    except jinja2.TemplateError as error:
        raise ConfigError("messages", f"the chat template rejected the messages: {error}") from None


async def _merged(chunks: AsyncIterator[Chunk]) -> Chunk:
    merged = None
    async for chunk in chunks:
        merged = chunk if merged is None else merged.then(chunk)
    return merged
