"""The HTTP face of the app: OpenAI's routes (and vLLM's /tokenize, /detokenize) in front of one engine
deployment per model.

    client --HTTP--> OpenAIIngress --DeploymentHandle--> EngineDeployment (one per model)

The ingress validates requests, routes by `model`, and turns the engine's chunks into server-sent events
(a streaming handle call) or, for a request that does not stream, into one OpenAI object from the one
merged chunk the replica returns (one round trip). Overload is Serve's backpressure: an engine replica
takes `max_ongoing_requests` (rows plus its own short queue); beyond that `max_queued_requests` wait at the
ingress, and the rest get a 503 with Retry-After at once. A client that goes away cancels its handle call,
which frees its row. Every error becomes its status and OpenAI's error body in `http_errors`.
No `from __future__ import annotations` here: FastAPI must read the route annotations as real types
through Serve's ingress wrapper.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from mars_ray.core.errors import ConfigError
from mars_ray.serve import access
from mars_ray.serve.config import AppConfig
from mars_ray.serve.http_errors import HANDLERS, UnknownModel, logged, overloaded
from mars_ray.serve.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseBuilder,
    TokenizeRequest,
    error_body,
)
from mars_ray.serve.types import Chunk, SamplingParams

api = FastAPI(
    title="mars-ray",
    description="OpenAI-compatible serving of MARS multi-token models",
    exception_handlers=HANDLERS,
)
api.add_middleware(access.BodyLimit)  # inside the key check: a caller without the key sends no body
api.middleware("http")(access.check_access)


def _cancel(calls: Sequence[DeploymentResponse | DeploymentResponseGenerator]) -> None:
    """Cancel handle calls (the other choices of a request that failed); one that Serve turned away
    re-raises its error when cancelled, and has nothing to free."""
    for call in calls:
        with contextlib.suppress(Exception):
            call.cancel()


async def _interleaved(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """The chunks of several streams as they come, each with the index of its stream; the first failure
    ends it."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
            await queue.put((index, None))
        except Exception as error:
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """The HTTP face: OpenAI routes, one engine deployment handle per served model."""

    def __init__(
        self,
        engines: dict[str, DeploymentHandle],
        board: DeploymentHandle,
        config: AppConfig,
    ) -> None:
        self.engines, self.board, self.config = engines, board, config
        self.created = int(time.time())
        key = config.api_key.get_secret_value() if config.api_key else None
        access.configure(key, config.cors_origins, config.max_body_bytes)

    def _engine(self, model: str) -> DeploymentHandle:
        if model not in self.engines:
            raise UnknownModel("model", f"The model `{model}` does not exist.")
        return self.engines[model]

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every model has a replica that is loaded and warmed up, else 503."""

        async def ready(handle: DeploymentHandle) -> bool:
            return await handle.ready.remote()

        try:
            await asyncio.wait_for(asyncio.gather(*(ready(h) for h in self.engines.values())), timeout=5)
        except Exception as error:
            reason = logged("a model has no replica ready", error)
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @api.get("/v1/status")
    async def status(self) -> dict:
        """Each live replica of each model: its operating tau, controller state, load and speed."""
        return {"models": await self.board.snapshot.remote()}

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mars-ray"}

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self.engines]}

    @api.get("/v1/models/{model:path}")
    async def get_model(self, model: str) -> dict:
        self._engine(model)  # 404 for a model not served
        return self._model_card(model)

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's route: a prompt's (or a chat's) token ids, their count and the model's context."""
        try:
            source = body.text_or_messages()
        except ValueError as error:
            raise ConfigError("prompt", str(error)) from None
        engine = self._engine(body.model)
        tokens = await engine.tokenize.remote(source, body.add_generation_prompt)
        return {"count": len(tokens), "max_model_len": await engine.max_model_len.remote(), "tokens": tokens}

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        return {"prompt": await self._engine(body.model).detokenize.remote(body.tokens)}

    def _check_bounds(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        """The app's per-request bounds that a static schema cannot know (400 naming the field)."""
        config = self.config
        if body.n > config.max_n:
            raise ConfigError("n", f"at most {config.max_n} choices per request")
        if len(getattr(body, "messages", [])) > config.max_messages:
            raise ConfigError("messages", f"at most {config.max_messages} messages per request")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if any(len(stop) > config.max_stop_chars for stop in stops):
            raise ConfigError("stop", f"a stop string may hold at most {config.max_stop_chars} characters")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_bounds(body)
        messages = [m.as_template_input() for m in body.messages]
        engine, builder = self._engine(body.model), ResponseBuilder(chat=True, model=body.model)
        if body.stream:
            chat = engine.options(stream=True).chat
            return await self._stream(lambda params: chat.remote(messages, params), body, builder)
        return await self._whole(lambda params: engine.chat_whole.remote(messages, params), body, builder)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_bounds(body)
        engine, builder = self._engine(body.model), ResponseBuilder(chat=False, model=body.model)
        if body.stream:
            complete = engine.options(stream=True).complete
            return await self._stream(lambda params: complete.remote(body.prompt, params), body, builder)
        whole = engine.complete_whole
        return await self._whole(lambda params: whole.remote(body.prompt, params), body, builder)

    async def _whole(
        self,
        call: Callable[[SamplingParams], DeploymentResponse],
        body: ChatCompletionRequest | CompletionRequest,
        builder: ResponseBuilder,
    ):
        """One round trip per choice: the replica merged its chunks (errors still become status codes;
        Serve may turn a call away as it is made)."""
        responses: list[DeploymentResponse] = []
        try:
            responses = [call(params) for params in body.choice_params()]
            lasts = await asyncio.gather(*responses)
        except BackPressureError as error:
            _cancel(responses)
            return overloaded(error)
        except BaseException:
            _cancel(responses)
            raise
        return builder.whole(lasts)

    async def _stream(
        self,
        call: Callable[[SamplingParams], DeploymentResponseGenerator],
        body: ChatCompletionRequest | CompletionRequest,
        builder: ResponseBuilder,
    ):
        """Wait until the engine accepts every choice (errors still become status codes), then stream
        them interleaved, each chunk under its choice's index."""
        streams: list[DeploymentResponseGenerator] = []
        try:
            streams = [call(params) for params in body.choice_params()]
            firsts = [await stream.__anext__() for stream in streams]
        except BackPressureError as error:
            _cancel(streams)
            return overloaded(error)
        except BaseException:
            _cancel(streams)
            raise
        events = self._events(streams, firsts, body.include_usage, builder)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(
        self,
        streams: list[DeploymentResponseGenerator],
        firsts: list[Chunk],
        include_usage: bool,
        builder: ResponseBuilder,
    ) -> AsyncIterator[str]:
        lasts = list(firsts)
        try:
            for index, first in enumerate(firsts):
                yield _event(builder.piece(first, first=True, index=index))
            async for index, chunk in _interleaved(streams):
                lasts[index] = chunk
                yield _event(builder.piece(chunk, first=False, index=index))
            if include_usage:
                yield _event(builder.usage_piece(lasts))
            yield _event("[DONE]")
        except Exception as error:  # the status line is gone: report in the stream, then end it
            yield _event(error_body(logged("generation failed", error), kind="server_error"))
            yield _event("[DONE]")
        finally:
            for stream, last in zip(streams, lasts, strict=True):
                if last.finish_reason is None:  # the client left mid-stream (or it failed): free the row
                    stream.cancel()
