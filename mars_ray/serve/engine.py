"""The replica's engine: continuous multi-token batching around `SlidingDecoder`, streamed per request.

Requests wait in a queue. The forwards run in a worker thread, pipelined as vLLM's async scheduling is:
once forward N is back, the engine drops cancelled and stopped rows, admits waiting requests up to
`max_batch_size` rows (a new row's prompt is prefilled within the budget of the next forwards), moves the
requests that follow the replica's operating point (tau, window) to its current value, and starts forward
N+1; only then do forward N's tokens become text and go out. So detokenizing, stop strings and streaming
run on the event loop while the next forward runs, never between two forwards. A row that a stop string
ends at forward N is computed once more and that forward's tokens are dropped.
No Ray here: the Serve deployment (`app.py`) wraps it and exports `EngineMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_ray import models
from mars_ray.core.compile import compile_steps
from mars_ray.core.decoding import (
    TRAINED_BLOCK_SIZE,
    DecodeConfig,
    DecodeState,
    SlidingDecoder,
    TokenLogprob,
)
from mars_ray.core.errors import ConfigError
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.text import TextStream

logger = logging.getLogger(__name__)
MAX_UNTRAINED_BLOCK_SIZE = 16  # the widest window a model that records no trained B may be asked for


class RequestError(ValueError):
    """A request the engine cannot serve as asked (HTTP 400); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)  # both in `args`, so the error pickles across Ray intact
        self.message, self.param = message, param

    def __str__(self) -> str:
        return self.message


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


@dataclass(frozen=True)
class EngineStats:
    """A cheap snapshot of the replica: its operating point, its load and its recent speed and latency."""

    tau: float
    block_size: int
    waiting: int
    running: int
    max_batch_size: int
    tokens_per_s: float  # generated tokens over the last `window_s`
    forwards_per_s: float
    tokens_per_forward: float  # per row and forward, recent
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    window_s: float
    generated_tokens: int  # totals since start
    forward_passes: int
    finished: dict[str, int]  # requests by how they ended: stop, length, cancelled, error
    verify: bool = False  # the operating mode: verified decoding for greedy requests that do not choose


class EngineMetrics:
    """Where the engine reports what it does; the Serve deployment exports these (no-ops here).

    Shaped like vLLM's metric families, so that its dashboards' queries carry over: per row and forward,
    `drafted` is how many proposals the forward offered that row (a lossy row: its window's W-1 mask
    slots; a verified row: the drafts it checked; 0 at one token per forward) and `accepted` how many
    tokens it took (at most drafted + 1), as vLLM's speculative-decoding counters count them.
    """

    def step(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """One forward: per row, the tokens it accepted and the proposals it was offered."""

    def admitted(self, queued_seconds: float, prompt_tokens: int) -> None:
        """A request got its row after waiting this long."""

    def first_token(self, seconds: float) -> None:
        """Time from a request's arrival to its first accepted token."""

    def inter_token(self, seconds: float) -> None:
        """Time per token between two of a request's forwards."""

    def finished(self, reason: str, seconds: float) -> None:
        """A request ended (stop, length, cancelled or error) this long after it arrived."""

    def load(self, waiting: int, running: int) -> None:
        """Requests waiting for a row, and rows in the batch."""

    def tau(self, tau: float) -> None:
        """The operating tau changed."""


@dataclass(frozen=True)
class RowOutput:
    """What one forward gave one row, read in the decode thread as the forward ended: the event loop turns
    it into text while the next forward already changes the row's `DecodeState`."""

    state: DecodeState
    tokens: list[int]  # accepted by this forward
    completion_tokens: int  # the row's tokens so far, these included
    forward_passes: int
    finish_reason: str | None  # "stop" (a stop token) or "length"; None while it goes on
    config: DecodeConfig  # the operating point this forward ran at
    drafted: int  # proposals this forward offered the row (see `EngineMetrics.step`)

    @classmethod
    def of(cls, state: DecodeState, tokens: list[int]) -> RowOutput:
        config = state.config
        drafted = state.drafted[-1] if config.verify else config.window - 1
        return cls(
            state, tokens, len(state.tokens), state.forward_passes, state.finish_reason, config, drafted
        )


class _Request:
    """One request inside the engine: its decode state, its text stream and its outbox."""

    def __init__(self, state: DecodeState, text: TextStream, params: SamplingParams) -> None:
        self.state, self.text, self.params = state, text, params
        self.outbox: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.last_tokens_at: float | None = None
        self.finish_reason: str | None = None  # stop, length, cancelled or error
        self.unsent: list[int] = []  # decoded tokens not yet in a chunk (their text may be held back)
        self.sent = 0  # tokens already in a chunk

    def chunk(self, text: str, tokenizer: PreTrainedTokenizerBase, output: RowOutput | None = None) -> Chunk:
        """The next chunk: `text` and the tokens decoded since the last chunk, as of `output` (None: before
        the first forward)."""
        s = self.state
        reason = self.finish_reason if self.finish_reason in ("stop", "length") else None
        tokens, self.unsent = self.unsent, []
        config = s.config if output is None else output.config
        # Tokens accepted in the same forward past a stop string were decoded but are not the completion.
        completion = 0 if output is None else output.completion_tokens
        if self.text.stopped:
            completion = self.text.stop_tokens
        forward_passes = 0 if output is None else output.forward_passes
        mode = "ar" if config.window == 1 else "verify" if config.verify else "mars"
        logprobs = None
        if config.logprobs is not None:
            # Only ever appended to (by the decode thread), so the entries up to `completion` are settled.
            logprobs = [_named(lp, tokenizer) for lp in s.logprobs[self.sent : max(self.sent, completion)]]
        self.sent += len(tokens)
        return Chunk(
            text, len(s.prompt), completion, forward_passes, reason, tokens, config.tau, mode, logprobs
        )


def _named(logprob: TokenLogprob, tokenizer: PreTrainedTokenizerBase) -> Logprob:
    """Token ids as the text each one decodes to, as OpenAI reports them."""
    top = tuple((tokenizer.decode([token]), value) for token, value in logprob.top)
    return Logprob(tokenizer.decode([logprob.token]), logprob.logprob, top)


def _decode_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mars-decode")


def _load_model(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch.set_num_threads(config.torch_threads or max(1, int(config.num_cpus)))
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    return models.load(config.model, dtype=dtype, device=config.device)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class Engine:
    """Continuous batching of MARS decoding for one model; `generate` streams `Chunk`s per request."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: ModelConfig,
        metrics: EngineMetrics | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the thread that runs the engine's forwards; by default the engine's own."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.metrics = metrics or EngineMetrics()
        self.max_context = config.max_context or int(model.config.max_position_embeddings)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        trained = getattr(model.config, TRAINED_BLOCK_SIZE, None)
        self.max_block_size = config.max_block_size or trained or MAX_UNTRAINED_BLOCK_SIZE
        # Stops, calibrated temperatures: what every request's config starts from.
        self.decode = DecodeConfig.for_model(model, tokenizer, config.block_size, allow_wider=True)
        if self.decode.block_size > self.max_block_size:
            raise ConfigError(
                "block_size", f"{self.decode.block_size} exceeds max_block_size {self.max_block_size}"
            )
        self._own_executor = executor is None
        self._executor = executor or _decode_thread()
        if config.compile:
            compile_steps(model)
        elif config.prepack_weights and can_prepack(model):  # inductor cannot lower packed weights
            self._executor.submit(prepack_linears, model).result()  # where the forwards will run
        self.decoder = self._new_decoder()
        self._tau, self._block_size, self._verify = config.tau, self.decode.block_size, config.verify
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # by id() of the decode state
        self._cancelled: list[_Request] = []
        self._stopped: list[DecodeState] = []  # rows a stop string ended, still in the decoder
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._started = time.monotonic()
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, rows, tokens) within the window
        self._ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # the most recent, within the window
        self._itl: deque[tuple[float, float]] = deque(maxlen=4096)
        self._generated = self._forwards = 0
        self._finished: Counter[str] = Counter()
        self.metrics.tau(self._tau)

    @classmethod
    def load(cls, config: ModelConfig, metrics: EngineMetrics | None = None) -> Engine:
        """Load the model through the same loader as training, with the replica's thread count, in the
        thread that will run its forwards: a thread that is not the first to run torch's parallel work
        pays for oneDNN's small bf16 products (packed weights: 0.67x there, BENCHMARKS.md)."""
        decode_thread = _decode_thread()
        model, tokenizer = decode_thread.submit(_load_model, config).result()
        engine = cls(model, tokenizer, config, metrics, decode_thread)
        engine._own_executor = True  # made for this engine: it shuts down with it
        return engine

    def _new_decoder(self) -> SlidingDecoder:
        tokenizer = self.tokenizer
        return SlidingDecoder(
            self.model, tokenizer.mask_token_id, tokenizer.pad_token_id, self.config.max_prefill_tokens
        )

    # The operating point: requests without their own tau / block_size / verify follow it from the next
    # forward.
    @property
    def tau(self) -> float:
        return self._tau

    @tau.setter
    def tau(self, tau: float) -> None:
        if not 0 < tau <= 1:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        self._tau = tau
        self.metrics.tau(tau)

    @property
    def verify(self) -> bool:
        return self._verify

    @verify.setter
    def verify(self, verify: bool) -> None:
        self._verify = verify

    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, block_size: int) -> None:
        if not 1 <= block_size <= self.max_block_size:
            raise ValueError(f"block_size must be in [1, {self.max_block_size}], got {block_size}")
        self._block_size = block_size

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, prompt_field: str = "prompt"
    ) -> AsyncIterator[Chunk]:
        """Stream one request: first an empty chunk once it is accepted (with its prompt length), then
        a chunk per forward that produced text (with `stream_interval_s`, after the first text, the chunks
        of that interval as one), the last one with its `finish_reason`. Closing the iterator early (a
        client that went away) cancels the request and frees its row."""
        request = self._new_request(list(prompt), params, prompt_field)
        self._waiting.append(request)
        self._start()
        interval, sent_text = self.config.stream_interval_s, False
        try:
            yield request.chunk("", self.tokenizer)
            while True:
                item, failure = await request.outbox.get(), None
                if interval and sent_text and isinstance(item, Chunk) and not item.finish_reason:
                    await asyncio.sleep(interval)  # what the next forwards add goes out with it, as one
                while isinstance(item, Chunk) and not request.outbox.empty():
                    later = request.outbox.get_nowait()  # a slow reader gets what piled up as one chunk
                    if isinstance(later, BaseException):
                        failure = later  # after the text merged so far, which is not lost
                        break
                    item = item.then(later)
                if isinstance(item, BaseException):
                    raise item
                yield item
                sent_text = True
                if failure is not None:
                    raise failure
                if item.finish_reason:
                    return
        finally:
            if request.finish_reason is None:
                request.finish_reason = "cancelled"
                self._cancelled.append(request)
                self._wake.set()

    def _new_request(self, prompt: list[int], params: SamplingParams, prompt_field: str) -> _Request:
        if not prompt:
            raise RequestError("the prompt is empty", prompt_field)
        if not all(0 <= token < self.vocab_size for token in prompt):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})", prompt_field)
        room = self.max_context - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_context}",
                prompt_field,
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else min(self.config.max_tokens, room)
        if max_tokens > room:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together more than "
                f"this model's context of {self.max_context}",
                "max_tokens",
            )
        if not all(0 <= token < self.vocab_size for token in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        stops = () if params.ignore_eos else self.decode.stop_token_ids
        block_size = self._block_size if params.block_size is None else params.block_size
        if not 1 <= block_size <= self.max_block_size:
            raise RequestError(f"block_size must be in [1, {self.max_block_size}]", "block_size")
        try:
            config = dataclasses.replace(
                self.decode,
                tau=self._tau if params.tau is None else params.tau,
                block_size=block_size,
                verify=self._verify_for(params),
                max_new_tokens=max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                logprobs=params.logprobs,
                stop_token_ids=tuple(dict.fromkeys(stops + params.stop_token_ids)),
                min_tokens=min(params.min_tokens, max_tokens),
            )
        except ConfigError as error:
            field = {"max_new_tokens": "max_tokens"}.get(error.field, error.field)
            raise RequestError(error.message, field) from None
        text = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return _Request(DecodeState(prompt, config), text, params)

    def _verify_for(self, params: SamplingParams) -> bool:
        """A request's own choice; else the replica's mode, where it applies (verification is greedy)."""
        if params.verify is not None:
            return params.verify
        return self._verify and params.temperature == 0

    async def prompt_logprobs(self, prompt: Sequence[int], k: int) -> list[Logprob]:
        """Each prompt token's log-probability given the tokens before it, and its k likeliest alternatives
        (for `echo`): one plain forward over the prompt on the decode thread, between two steps. The first
        token has none."""

        def forward() -> list[TokenLogprob]:
            with torch.inference_mode():
                ids = torch.tensor([list(prompt)], device=self.model.device)
                logits = self.model(input_ids=ids).logits[0, :-1]
            state = DecodeState(list(prompt), dataclasses.replace(self.decode, logprobs=k))
            state.record_logprobs(list(prompt[1:]), logits)
            return state.logprobs

        recorded = await asyncio.get_running_loop().run_in_executor(self._executor, forward)
        first = Logprob(self.tokenizer.decode([prompt[0]]), None)
        return [first] + [_named(lp, self.tokenizer) for lp in recorded]

    async def warm_up(self) -> None:
        """A short request through the whole path, a MARS window included, before reporting ready. With
        compiled steps, every kind of step a compiled forward tells apart runs here (one row and more, a
        window of one and more), so each compiles now and never in the middle of a request."""
        prompt = self.tokenizer("Hello, how are you?")["input_ids"] or [self.tokenizer.eos_token_id]
        kinds = [SamplingParams(max_tokens=8, tau=0.5, block_size=2, ignore_eos=True)]
        if self.config.compile:
            kinds.append(SamplingParams(max_tokens=8, block_size=1, ignore_eos=True))
        for rows in (1, 2) if self.config.compile else (1,):
            for params in kinds:
                await asyncio.gather(*(self._drain(prompt, params) for _ in range(rows)))

    async def _drain(self, prompt: Sequence[int], params: SamplingParams) -> None:
        async for _ in self.generate(prompt, params):
            pass

    def refresh_gauges(self) -> None:
        """Set the gauges again: an idle engine sets none, and Ray drops a gauge series not refreshed."""
        self.metrics.tau(self._tau)
        self.metrics.load(len(self._waiting), len(self._running))

    async def close(self) -> None:
        """Stop the decode loop and its thread. Every waiting and running request ends at once with an
        error (no reader is left waiting for a chunk that will never come)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for request in [*self._waiting, *self._running.values()]:
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.outbox.put_nowait(RuntimeError("the engine shut down"))
                self._end(request)
        self._waiting.clear()
        self._running.clear()
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        self._forget_before(now - self.config.stats_window_s)
        span = min(self.config.stats_window_s, now - self._started) or 1.0
        rows = sum(r for _, r, _ in self._steps)
        tokens = sum(t for _, _, t in self._steps)
        ttft, itl = [v for _, v in self._ttft], [v for _, v in self._itl]
        return EngineStats(
            tau=self._tau,
            block_size=self._block_size,
            waiting=len(self._waiting),
            running=len(self._running),
            max_batch_size=self.config.max_batch_size,
            tokens_per_s=tokens / span,
            forwards_per_s=len(self._steps) / span,
            tokens_per_forward=tokens / rows if rows else 0.0,
            ttft_p50_s=_percentile(ttft, 0.5),
            ttft_p95_s=_percentile(ttft, 0.95),
            itl_p50_s=_percentile(itl, 0.5),
            itl_p95_s=_percentile(itl, 0.95),
            window_s=self.config.stats_window_s,
            generated_tokens=self._generated,
            forward_passes=self._forwards,
            finished=dict(self._finished),
            verify=self._verify,
        )

    def _forget_before(self, horizon: float) -> None:
        for samples in (self._steps, self._ttft, self._itl):
            while samples and samples[0][0] < horizon:
                samples.popleft()

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        """The decode loop, pipelined: forward N+1 starts before forward N's rows are delivered."""
        loop = asyncio.get_running_loop()
        in_flight: asyncio.Future[list[RowOutput]] | None = None  # the forward in the decode thread
        while True:
            try:
                finished = in_flight
                in_flight = None  # awaited once, even when it fails
                outputs = [] if finished is None else await finished
                ended_at = time.monotonic()
                self._schedule()
                if self.decoder.active:
                    in_flight = loop.run_in_executor(self._executor, self._step)
                self._deliver(outputs, ended_at)
                if in_flight is None:  # idle until a request arrives
                    self._wake.clear()
                    await self._wake.wait()
            except Exception as error:  # a failed step fails the requests in the batch, not the replica
                logger.exception("decode step failed")
                self._fail_running(error)

    def _schedule(self) -> None:
        """Between two forwards: free rows that ended, admit waiting requests, move to the operating point."""
        self._release()
        self._admit()
        self.metrics.load(len(self._waiting), len(self._running))
        self._follow_operating_point()

    def _step(self) -> list[RowOutput]:
        """One forward, in the decode thread; what it gave each row is read before the next one starts."""
        return [RowOutput.of(state, tokens) for state, tokens in self.decoder.step()]

    def _release(self) -> None:
        """Free the rows of cancelled requests and of those a stop string ended."""
        if not self._cancelled and not self._stopped:
            return
        gone = {id(r.state) for r in self._cancelled}
        self._waiting = deque(r for r in self._waiting if id(r.state) not in gone)
        gone.update(id(state) for state in self._stopped)
        leaving = [state for state in [*self.decoder.seqs, *self.decoder.joining] if id(state) in gone]
        if leaving:
            self.decoder.remove(leaving)
        for request in self._cancelled:
            self._running.pop(id(request.state), None)
            self._end(request)
        self._cancelled.clear()
        self._stopped.clear()

    def _admit(self) -> None:
        # Counts the rows the decoder holds: a request that finished at the last forward is not delivered yet.
        decoder = self.decoder
        while self._waiting and len(decoder.seqs) + len(decoder.joining) < self.config.max_batch_size:
            request = self._waiting.popleft()
            self._running[id(request.state)] = request
            self.decoder.add(request.state)
            self.metrics.admitted(time.monotonic() - request.arrived, len(request.state.prompt))

    def _follow_operating_point(self) -> None:
        for request in self._running.values():
            config = request.state.config
            tau = self._tau if request.params.tau is None else request.params.tau
            block_size = self._block_size if request.params.block_size is None else request.params.block_size
            verify = self._verify_for(request.params)
            if (config.tau, config.block_size, config.verify) != (tau, block_size, verify):
                request.state.config = dataclasses.replace(
                    config, tau=tau, block_size=block_size, verify=verify
                )

    def _deliver(self, outputs: list[RowOutput], now: float) -> None:
        """Each row's new tokens become text; finished rows are answered and leave."""
        delivered = []
        for output in outputs:
            request = self._running.get(id(output.state))
            if request is None or request.finish_reason is not None:
                continue  # ended by a stop string a forward ago, or cancelled: nobody reads these tokens
            delivered.append(output)
            tokens = output.tokens
            if request.last_tokens_at is None:
                ttft = now - request.arrived
                self._ttft.append((now, ttft))
                self.metrics.first_token(ttft)
            elif tokens:
                itl = (now - request.last_tokens_at) / len(tokens)
                self._itl.append((now, itl))
                self.metrics.inter_token(itl)
            request.last_tokens_at = now
            request.unsent += tokens
            text = request.text.push(tokens)
            if request.text.stopped:
                request.finish_reason = "stop"
                self._stopped.append(request.state)
            elif output.finish_reason is not None:
                request.finish_reason = output.finish_reason
                text += request.text.finish()
            if text or request.finish_reason:
                request.outbox.put_nowait(request.chunk(text, self.tokenizer, output))
            if request.finish_reason:
                self._running.pop(id(request.state))
                self._end(request)
        if not delivered:  # the step only cached joining prompts, or every row it ran had ended before
            return
        accepted = [len(output.tokens) for output in delivered]
        self._steps.append((now, len(delivered), sum(accepted)))
        self._forget_before(now - self.config.stats_window_s)
        self._generated += sum(accepted)
        self._forwards += 1
        self.metrics.step(accepted, [output.drafted for output in delivered])

    def _end(self, request: _Request) -> None:
        """Count a request that ended (its `finish_reason` set)."""
        self._finished[request.finish_reason] += 1
        self.metrics.finished(request.finish_reason, time.monotonic() - request.arrived)

    def _fail_running(self, error: Exception) -> None:
        """Answer every batched request with the error and start from an empty cache."""
        for request in self._running.values():
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.outbox.put_nowait(RuntimeError(f"decoding failed: {error}"))
                self._end(request)
        self._running.clear()
        self._stopped.clear()
        self.decoder = self._new_decoder()
