"""The Serve application: an OpenAI-compatible FastAPI ingress in front of one engine deployment per model.

    client --HTTP--> OpenAIIngress --DeploymentHandle--> EngineDeployment (one per model)

The ingress validates requests, routes by `model`, and turns the engine's chunks into server-sent events
(a streaming handle call) or, for a request that does not stream, into one OpenAI object from the one
merged chunk the replica returns (one round trip). Overload is Serve's backpressure: an engine replica
takes `max_ongoing_requests` (rows plus its own short queue); beyond that `max_queued_requests` wait at the
ingress, and the rest get a 503 with Retry-After at once. A client that goes away cancels its handle call,
which frees its row.
`build_app` is the `import_path` of the YAMLs in `serve_configs/`.
No `from __future__ import annotations` here: FastAPI must read the route annotations as real types
through Serve's ingress wrapper.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve import metrics
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig
from ray.serve.deployment import Application
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from mars_ray.data import chat_ids, chat_prompt_ids
from mars_ray.serve import access
from mars_ray.serve.config import AppConfig, ModelConfig, TauObjective
from mars_ray.serve.controller import OperatingPoint, TauController
from mars_ray.serve.engine import Engine, EngineMetrics
from mars_ray.serve.policy import tau_first_policy
from mars_ray.serve.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponseBuilder,
    TokenizeRequest,
    error_body,
    error_param,
)
from mars_ray.serve.stats import EngineStats
from mars_ray.serve.types import Chunk, RequestError, SamplingParams
from mars_ray.serve.vllm_engine import VllmEngine

logger = logging.getLogger(__name__)
api = FastAPI(title="mars-ray", description="OpenAI-compatible serving of MARS multi-token models")
api.add_middleware(access.BodyLimit)  # inside the key check: a caller without the key sends no body
api.middleware("http")(access.check_access)


class UnknownModel(LookupError):
    pass


@api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error") or first["msg"]
        return JSONResponse(error_body(f"invalid JSON body: {reason}"), status_code=400)
    param = error_param(first["loc"])
    return JSONResponse(error_body(f"{param}: {first['msg']}", param), status_code=400)


@api.exception_handler(RequestError)
async def _unservable_request(request: Request, error: RequestError) -> JSONResponse:
    # An engine's error arrives wrapped in a RayTaskError that also is a RequestError and reads its fields.
    return JSONResponse(error_body(error.message, error.param), status_code=400)


@api.exception_handler(UnknownModel)
async def _unknown_model(request: Request, error: UnknownModel) -> JSONResponse:
    message = f"The model `{error.args[0]}` does not exist."
    return JSONResponse(error_body(message, "model", code="model_not_found"), status_code=404)


@api.exception_handler(RayError)
async def _replica_lost(request: Request, error: RayError) -> JSONResponse:
    """An engine replica that died (or an actor call that failed) under a request: a 503 with an OpenAI
    body (the client may retry: Serve replaces the replica), not a bare 500."""
    if isinstance(error, RequestError):  # the engine's 400, wrapped by Ray in a class that is both
        return await _unservable_request(request, error)
    message = _logged("the model's replica failed", error)
    body = error_body(message, kind="server_error", code="replica_failed")
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


def _logged(what: str, error: BaseException) -> str:
    """What a client is told of an internal error: `what` and an id. The error itself (Ray's pid, address and
    actor, a torch message, the remote traceback) goes to the log only, under that id."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("%s (error id %s)", what, error_id, exc_info=error)
    return f"{what} (error id {error_id})"


def _overloaded(error: BackPressureError) -> JSONResponse:
    """Serve's backpressure as an OpenAI error (Serve would answer a bare-text 503 itself)."""
    headers = {} if error.retry_after_s is None else {"Retry-After": str(math.ceil(error.retry_after_s))}
    body = error_body(f"The server is overloaded: {error.message}", kind="server_error", code="overloaded")
    return JSONResponse(body, status_code=error.status_code, headers=headers)


LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
MAX_DRAFT_POSITIONS = 16  # per-position acceptance is counted for the first this many proposals


class ServeMetrics(EngineMetrics):
    """The engine's figures as Ray Serve metrics, labelled by model (Serve adds deployment and replica).

    vLLM's families under the `mars_` prefix (Ray exports each as `ray_mars_...`): TTFT, inter-token,
    end-to-end and queue-time histograms, running and waiting gauges, prompt and generation token counters,
    and the speculative-decoding counters (`spec_decode_num_drafts`, `..._num_draft_tokens`,
    `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), so that the mean accepted length is
    1 + accepted / drafts, as vLLM's users compute it. Plus MARS's own: tau, forwards, tokens per forward.
    """

    def __init__(self, model: str) -> None:
        def labelled(metric):
            metric.set_default_tags({"model": model})
            return metric

        def counter(name: str, description: str, *tags: str):
            return labelled(metrics.Counter(name, description, tag_keys=("model", *tags)))

        def histogram(name: str, description: str, boundaries: list[float]):
            return labelled(metrics.Histogram(name, description, boundaries=boundaries, tag_keys=("model",)))

        def gauge(name: str, description: str):
            return labelled(metrics.Gauge(name, description, tag_keys=("model",)))

        self.requests = counter("mars_request_success", "Requests that ended, by how", "finished_reason")
        self.prompt_tokens = counter("mars_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("mars_generation_tokens", "Tokens generated")
        self.forwards = counter("mars_forward_passes", "Batched forward passes")
        self.drafts = counter("mars_spec_decode_num_drafts", "Row-forwards that offered proposals")
        self.draft_tokens = counter(
            "mars_spec_decode_num_draft_tokens", "Proposals offered (mask slots, drafts)"
        )
        self.accepted_tokens = counter("mars_spec_decode_num_accepted_tokens", "Proposals accepted")
        self.accepted_per_pos = counter(
            "mars_spec_decode_num_accepted_tokens_per_pos", "Proposals accepted, by position", "position"
        )
        self.tokens_per_forward = histogram(
            "mars_tokens_per_forward",
            "Tokens a request accepted in one forward",
            [1, 2, 3, 4, 5, 6, 8, 12, 16],
        )
        self.ttft = histogram(
            "mars_time_to_first_token_seconds", "Arrival at the replica to the first token", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "mars_inter_token_latency_seconds",
            "Time per token between a request's forwards",
            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1],
        )
        self.e2e = histogram("mars_e2e_request_latency_seconds", "Arrival to the end", LATENCY_BUCKETS)
        self.queue_time = histogram("mars_request_queue_time_seconds", "Arrival to a row", LATENCY_BUCKETS)
        self.operating_tau = gauge("mars_tau", "Operating tau of the replica")
        self.waiting = gauge("mars_num_requests_waiting", "Requests waiting for a row")
        self.running = gauge("mars_num_requests_running", "Rows in the running batch")

    def step(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        self.forwards.inc()
        self.generation_tokens.inc(sum(accepted))
        for taken, offered in zip(accepted, drafted, strict=True):
            self.tokens_per_forward.observe(taken)
            if offered:
                kept = max(taken - 1, 0)
                self.drafts.inc()
                self.draft_tokens.inc(offered)
                if kept:
                    self.accepted_tokens.inc(kept)
                for position in range(min(kept, MAX_DRAFT_POSITIONS)):
                    self.accepted_per_pos.inc(tags={"position": str(position)})

    def admitted(self, queued_seconds: float, prompt_tokens: int) -> None:
        self.queue_time.observe(queued_seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.inc(tags={"finished_reason": reason})
        self.e2e.observe(seconds)

    def load(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def tau(self, tau: float) -> None:
        self.operating_tau.set(tau)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class StatusBoard:
    """Where every engine replica posts its operating point each tick; read by `GET /v1/status`.

    Every method is async, here and on `EngineDeployment`: Serve runs a sync method in a thread pool, where
    it would race the event loop's (or another call's) changes to the same state (iterating `replicas` while
    a post grows it, reading the engine's deques while a forward appends to them); async, they run one at a
    time on the replica's event loop."""

    def __init__(self, stale_after_s: float = 5.0) -> None:
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, dict] = {}

    async def post(self, replica: str, status: dict) -> None:
        self.replicas[replica] = {**status, "posted": time.time()}

    async def snapshot(self) -> dict[str, dict[str, dict]]:
        """{model: {replica id: status}}, replicas silent for `stale_after_s` dropped (they are gone)."""
        now = time.time()
        self.replicas = {r: s for r, s in self.replicas.items() if now - s["posted"] < self.stale_after_s}
        models: dict[str, dict[str, dict]] = {}
        for replica, status in sorted(self.replicas.items()):
            models.setdefault(status["model"], {})[replica] = status
        return models


@serve.deployment
class EngineDeployment:
    """One replica of one model: loads and warms up in its constructor, so ready means ready.

    Its user_config holds the tau controller's knobs (`TauObjective`): `reconfigure` applies them in
    place, so `serve deploy` with changed knobs reaches the running process. Each tick the controller
    moves the engine's operating tau, the replica posts its status, and `record_autoscaling_stats`
    hands the controller's state to the replica policy (`policy.tau_first_policy`).
    """

    async def __init__(self, config: ModelConfig, board: DeploymentHandle) -> None:
        self.config, self.board = config, board
        self.controller: TauController | None = None
        self.replica = serve.get_replica_context().replica_id.unique_id
        engine = VllmEngine if config.engine == "vllm" else Engine
        self.engine = await asyncio.to_thread(engine.load, config, ServeMetrics(config.served_name))
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
        try:
            prompt = chat_prompt_ids(self.engine.tokenizer, messages)
        except jinja2.TemplateError as error:
            raise RequestError(f"the chat template rejected the messages: {error}", "messages") from None
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
        try:
            if add_generation_prompt:
                return chat_prompt_ids(tokenizer, source)
            return chat_ids(tokenizer, source)
        except jinja2.TemplateError as error:
            raise RequestError(f"the chat template rejected the messages: {error}", "messages") from None

    async def detokenize(self, tokens: list[int]) -> str:
        self.engine.check_token_ids(tokens, "tokens")
        return self.engine.tokenizer.decode(tokens)

    async def max_model_len(self) -> int:
        return self.engine.max_context

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def ready(self) -> bool:
        return True


async def _merged(chunks: AsyncIterator[Chunk]) -> Chunk:
    merged = None
    async for chunk in chunks:
        merged = chunk if merged is None else merged.then(chunk)
    return merged


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
            raise UnknownModel(model)
        return self.engines[model]

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every model has a replica that is loaded and warmed up, else 503."""

        async def ready(handle: DeploymentHandle) -> bool:
            return await handle.ready.remote()

        try:
            await asyncio.wait_for(asyncio.gather(*(ready(h) for h in self.engines.values())), timeout=5)
        except Exception as error:
            reason = _logged("a model has no replica ready", error)
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
            raise RequestError(str(error), "prompt") from None
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
            raise RequestError(f"at most {config.max_n} choices per request", "n")
        if len(getattr(body, "messages", [])) > config.max_messages:
            raise RequestError(f"at most {config.max_messages} messages per request", "messages")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if any(len(stop) > config.max_stop_chars for stop in stops):
            raise RequestError(f"a stop string may hold at most {config.max_stop_chars} characters", "stop")

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
            return _overloaded(error)
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
            return _overloaded(error)
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
            yield _event(error_body(_logged("generation failed", error), kind="server_error"))
            yield _event("[DONE]")
        finally:
            for stream, last in zip(streams, lasts, strict=True):
                if last.finish_reason is None:  # the client left mid-stream (or it failed): free the row
                    stream.cancel()


def build_app(args: dict | AppConfig) -> Application:
    """The application for an `AppConfig` (the `args` of a Serve YAML)."""
    config = AppConfig.model_validate(args)
    board = StatusBoard.bind()
    # The tau knobs reach replicas only as user_config: with them out of the constructor's arguments, a
    # `serve deploy` that changes only them updates running replicas in place instead of replacing them.
    engines = {
        model.served_name: _engine_deployment(model).bind(
            model.model_copy(update={"tau_control": None}), board
        )
        for model in config.models
    }
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        # The ingress holds the HTTP streams: replaced, it drains them as long as the engines do.
        graceful_shutdown_timeout_s=max(m.graceful_shutdown_timeout_s for m in config.models),
    ).bind(engines, board, config)


def _engine_deployment(model: ModelConfig):
    """The engine deployment of one model: resources, backpressure, tau knobs, replica autoscaling."""
    options = dict(
        name=model.deployment_name,
        ray_actor_options={"num_cpus": model.num_cpus, "num_gpus": model.num_gpus},
        max_ongoing_requests=model.max_ongoing_requests,
        max_queued_requests=model.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=model.retry_after_s),
        max_constructor_retry_count=3,  # a model that does not load fails soon, not after 20 tries
        # A replica being replaced (a redeploy that restarts it) or removed (scale-in) first finishes its
        # requests, streams included, for up to this long.
        graceful_shutdown_timeout_s=model.graceful_shutdown_timeout_s,
    )
    if model.tau_control:
        options["user_config"] = model.tau_control.model_dump()
    if model.max_replicas and model.max_replicas > model.num_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=model.num_replicas,
            max_replicas=model.max_replicas,
            upscale_delay_s=model.upscale_delay_s,
            downscale_delay_s=model.downscale_delay_s,
            look_back_period_s=model.look_back_period_s,
            policy=AutoscalingPolicy(policy_function=tau_first_policy),
        )
    else:
        options["num_replicas"] = model.num_replicas
    return EngineDeployment.options(**options)
